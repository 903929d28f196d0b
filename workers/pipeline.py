"""The farm's work, without Ray: a request to kernel sources, kernels to binaries, and the
finished ``CompiledGraph``. Every farm mode (``inprocess``, embedded Ray, a cluster) runs
these same functions on the same decoded request, which is why they give byte-identical
artifacts; the modes differ only in where each step runs.

    compile_sources(request_bytes, key)        stages 1-6 on a CompileWorker (no binaries)
    kernel_jobs(compiled, target, autotune)     one job per (kernel, candidate config)
    run_kernel_job(job)                         one binary: a Ray task, or a plain call
    finish(compiled, chosen, ...)               binaries and chosen configs into the graph
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgpack

from kiln.compiler import trace
from kiln.compiler.codegen.kernel_spec import KernelSpec
from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.errors import KilnCompileError
from kiln.compiler.kernel_compile import KernelBinary, compile_kernel
from kiln.compiler.request import CompileRequest, canonical, compile_options
from kiln.compiler.versions import versions

from . import foreground

if TYPE_CHECKING:
    from .artifact import StoredRequest

log = logging.getLogger("kiln.workers")

# Test hook: seconds a worker sleeps before compiling a graph (to kill it mid-compile).
# The client reads it and passes it along with the request; it never enters the key.
TEST_DELAY_ENV = "KILN_TEST_COMPILE_DELAY"
KERNEL_THREADS_ENV = "KILN_KERNEL_THREADS"


class FarmVersionMismatch(RuntimeError):
    """The worker's compiler is not the one the request (and its key) was made for."""


class FarmKeyMismatch(RuntimeError):
    """A caller's key is not the one the farm computes from the request's bytes."""


class CompileFailure(KilnCompileError):
    """A compile error that names its graph key, stage and op, and crosses processes.

    ``KilnCompileError`` and its subclasses take keyword-only fields and so do not
    unpickle; this one keeps every field in ``args``, which is what pickling replays."""

    def __init__(self, message: str, stage: str = "compile", key: str = "", node: str = "",
                 op: str = "", kernel: str = "", graph: str = "") -> None:
        RuntimeError.__init__(self, message, stage, key, node, op, kernel, graph)
        self.message, self.key = message, key
        self.stage, self.node, self.op, self.kernel, self.graph = stage, node, op, kernel, graph

    def __str__(self) -> str:
        return f"{self.message} [graph key {self.key}]" if self.key else self.message

    @classmethod
    def wrap(cls, error: BaseException, key: str) -> CompileFailure:
        """``error`` as a CompileFailure for ``key`` (its stage, node, op and kernel kept)."""
        if isinstance(error, CompileFailure):
            return error if error.key else cls(error.message, error.stage, key, error.node,
                                               error.op, error.kernel, error.graph)
        message = str(error) if isinstance(error, KilnCompileError) else \
            f"{type(error).__name__}: {error}"
        fields = {name: str(getattr(error, name, "") or "")
                  for name in ("node", "op", "kernel", "graph")}
        return cls(message, str(getattr(error, "stage", "") or "compile"), key, **fields)


def graph_name(key: str) -> str:
    """The compiled graph's name: from its key, so the wrapper's bytes depend on nothing
    a client chose (``forward_0`` in one process is ``forward_3`` in another)."""
    return f"kiln_{key[:16]}"


def test_delay() -> float:
    try:
        return max(0.0, float(os.environ.get(TEST_DELAY_ENV, "0") or 0))
    except ValueError:
        return 0.0


def check_versions(request: CompileRequest) -> None:
    """Refuse a request whose compiler, torch or triton differ from this process's."""
    mine = versions()
    theirs = request.versions
    differing = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
    if differing:
        detail = ", ".join(f"{k}: client {theirs.get(k)!r}, farm {mine.get(k)!r}"
                           for k in differing)
        raise FarmVersionMismatch(
            f"the farm runs other versions than the client ({detail}); the client compiles "
            "locally. Deploy the client's Kiln, torch and triton to the farm's image")


def compile_sources(request_bytes: bytes, key: str, *, delay: float = 0.0,
                    extra_options: dict[str, Any] | None = None) -> CompiledGraph:
    """Stages 1 to 6 of the compiler on a decoded request: sources, no binaries.

    Inputs are FakeTensors of the request's device type, so a CPU-only worker lowers a
    CUDA graph (and its kernels are cross-compiled for the request's target later).
    Of the request's options only compile options reach the compiler (``debug_dir`` or
    ``logs`` in a request are dropped: a caller never picks a path on a worker);
    ``extra_options`` are this process's own: debug folders and logs, never in the key."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kiln.compiler.driver import compile_graph
    from kiln.compiler.request import compiler_input, deserialize_graph

    request = CompileRequest.from_bytes(request_bytes)
    check_versions(request)
    if delay > 0:
        time.sleep(delay)
    with trace.span("deserialize request", cat="compiler", key=key[:16]):
        mode = FakeTensorMode()
        gm = deserialize_graph(request.graph, with_fake_meta=True, fake_mode=mode,
                               nsymbols=len(request.symbols))
        inputs = [compiler_input(meta, mode) for meta in request.inputs]
    start = time.perf_counter()
    options = {**compile_options(request.options), **(extra_options or {})}
    with trace.span("graph stage", cat="compiler", key=key[:16], nodes=len(gm.graph.nodes)):
        compiled = compile_graph(gm, inputs, options, name=graph_name(key),
                                 target=request.target, compile_kernels=False,
                                 symbols=request.symbols)
    compiled.timings["graph_compile"] = time.perf_counter() - start
    return compiled


def warm_up() -> None:
    """Run a tiny CUDA graph through every stage, kernel compile included, so that a
    worker's first real request pays no one-time start-up (imports, Triton's first
    compile). A worker without Triton or a CUDA backend just skips it."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kiln.compiler.decompositions import trace_aten
    from kiln.compiler.driver import DEFAULT_TARGETS, compile_graph

    versions()
    try:
        gm = trace_aten(lambda x: (x * 2).sum(-1), [torch.ones(4, 32)])
        with FakeTensorMode():
            inputs = [torch.empty(4, 32, device="cuda")]
        target: dict[str, Any] = dict(DEFAULT_TARGETS["cuda"])  # type: ignore[call-overload]
        compile_graph(gm, inputs, {}, name="kiln_warm_up", target=target)
    except Exception as e:  # warm-up is an optimization, never an error
        log.debug("kiln worker warm-up skipped: %s", e)


# ---------------------------------------------------------------------------------------
# Kernel jobs.


def needs_binary(spec: KernelSpec, target: dict[str, Any]) -> bool:
    """Whether ``spec`` is compiled for ``target`` (Triton's interpreter runs sources)."""
    kind = target.get("kind")
    return (kind == "cuda" and spec.backend == "triton") or (kind == "cpu" and
                                                             spec.backend == "cpp")


def _spec_identity(spec: KernelSpec) -> dict[str, Any]:
    """What a kernel's binary depends on: not its buffer names or candidate list."""
    return {"backend": spec.backend, "kind": spec.kind, "source": spec.source,
            "signature": spec.signature, "xnumel": spec.xnumel, "rnumel": spec.rnumel}


@dataclass(frozen=True)
class KernelJob:
    """One kernel compiled with one config for one target: the unit of fan-out."""

    spec: KernelSpec
    config: dict[str, Any]
    target: dict[str, Any]
    key: str = field(init=False)

    def __post_init__(self) -> None:
        wire = canonical([_spec_identity(self.spec), self.config, self.target], "kernel job")
        digest = hashlib.sha256(msgpack.packb(wire, use_bin_type=True)).hexdigest()
        object.__setattr__(self, "key", digest)


def candidate_configs(spec: KernelSpec, autotune: bool, bucket: bool = False
                      ) -> list[dict[str, Any]]:
    """The heuristic config alone, or every distinct candidate when autotuning. A kernel
    with dynamic sizes is tuned per size bucket (``bucket``: ``workers.buckets``), at the
    sizes a process sees, never at its compile-time hint."""
    configs = [dict(c) for c in spec.configs] or [{}]
    if not autotune or (spec.size_args and not bucket):
        return configs[:1]
    unique: list[dict[str, Any]] = []
    for config in configs:
        if config not in unique:
            unique.append(config)
    return unique


def kernel_jobs(compiled: CompiledGraph, target: dict[str, Any], autotune: bool = False
                ) -> dict[str, list[KernelJob]]:
    """Per kernel name, the jobs to run: one, or one per candidate when autotuning."""
    return {spec.name: [KernelJob(spec, config, target)
                        for config in candidate_configs(spec, autotune)]
            for spec in compiled.kernels if needs_binary(spec, target)}


def run_kernel_job(spec: dict[str, Any], config: dict[str, Any], target: dict[str, Any]
                   ) -> dict[str, Any]:
    """Compile one kernel job; plain dicts in and out (this is what a Ray task runs)."""
    return compile_kernel(KernelSpec.from_dict(spec), config, target).to_dict()


def finish(compiled: CompiledGraph, chosen: dict[str, KernelBinary], *,
           autotune: dict[str, list[dict[str, Any]]] | None = None, kernel_wall_s: float = 0.0
           ) -> CompiledGraph:
    """Put the chosen binaries and their configs into the graph; record how they were
    chosen (``autotuned`` only when every compiled kernel with candidates was timed)."""
    names = [spec.name for spec in compiled.kernels if spec.name in chosen]
    compiled.binaries = {name: chosen[name] for name in names}
    compiled.configs = {name: dict(chosen[name].config) for name in names}
    tunable = [s.name for s in compiled.kernels if s.name in chosen and len(s.configs) > 1]
    timed = autotune or {}
    compiled.autotuned = bool(tunable) and all(name in timed for name in tunable)
    if timed:
        compiled.stats["autotune"] = {name: timed[name] for name in names if name in timed}
    compiled.stats["kernels_compiled"] = len(names)
    compiled.timings["kernel_compile"] = kernel_wall_s
    compiled.timings["kernel_compile_cpu"] = sum(b.compile_seconds for b in chosen.values())
    return compiled


# ---------------------------------------------------------------------------------------
# In-process: the same steps, one after another, with a process-wide kernel cache.


def kernel_threads() -> int:
    """Threads that compile one graph's kernels in process (``KILN_KERNEL_THREADS``,
    default this machine's CPUs up to 16)."""
    try:
        wanted = int(os.environ.get(KERNEL_THREADS_ENV, "0"))
    except ValueError:
        wanted = 0
    return max(1, wanted or min(16, os.cpu_count() or 1))


class KernelBacking(Protocol):
    """Where a cache looks before compiling (``workers.kernel_store.KernelStore``)."""

    def get(self, job: KernelJob) -> KernelBinary | None: ...

    def put(self, job: KernelJob, binary: KernelBinary) -> bool: ...


def _background_compile(job: KernelJob) -> KernelBinary | None:
    """A background GPU kernel's binary from a child process (``workers.compile_procs``:
    off this interpreter, whose GIL the program's calls need), or None: this process
    compiles it."""
    if job.target.get("kind") != "cuda":
        return None
    from .compile_procs import compile_in_child, pool

    if pool() is None:  # off or broken: no span of a child's compile
        return None
    with trace.span("kernel compile", cat="kernel", kernel=job.spec.name,
                    config=json.dumps(job.config, sort_keys=True), child=True) as span:
        binary: KernelBinary | None = compile_in_child(job.spec, job.config, job.target)
        span["child"] = binary is not None  # False: the child failed, compiled here next
    return binary


class KernelCache:
    """Binaries by job key, bounded (least recently used out); thread-safe. With a
    ``backing`` store, a kernel missing here is looked up there before it is compiled,
    and what is compiled is put there (kernels shared across graphs and processes)."""

    def __init__(self, max_entries: int = 4096, backing: KernelBacking | None = None) -> None:
        self.max_entries = max_entries
        self.backing = backing
        self._entries: OrderedDict[str, KernelBinary] = OrderedDict()
        self._lock = threading.Lock()
        self._inflight: dict[str, Future[KernelBinary]] = {}
        self.hits = 0
        self.store_hits = 0
        self.compiles = 0

    def get_or_compile(self, job: KernelJob) -> KernelBinary:
        """The job's binary: cached, from the backing store, or compiled; threads asking
        for one job at once wait for one compile."""
        with self._lock:
            if job.key in self._entries:
                self._entries.move_to_end(job.key)
                self.hits += 1
                return self._entries[job.key]
            running = self._inflight.get(job.key)
            if running is None:
                running = self._inflight[job.key] = Future()
                owner = True
            else:
                owner = False
        if not owner:
            with self._lock:
                self.hits += 1
            return running.result()
        try:
            binary = self._fetch_or_compile(job)
        except BaseException as e:
            running.set_exception(e)
            raise
        finally:
            with self._lock:
                self._inflight.pop(job.key, None)
        running.set_result(binary)
        return binary

    def _fetch_or_compile(self, job: KernelJob) -> KernelBinary:
        binary = self._from_backing(job)
        if binary is None:
            binary = _background_compile(job) if trace.in_background() else None
            if binary is None:
                binary = compile_kernel(job.spec, job.config, job.target)
            with self._lock:
                self.compiles += 1
            if self.backing is not None:
                self.backing.put(job, binary)
        with self._lock:
            self._entries[job.key] = binary
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        return binary

    def compile_all(self, jobs: list[KernelJob]) -> list[KernelBinary]:
        """Every job's binary, in order, compiled on ``kernel_threads()`` threads at once
        (Triton's LLVM and ptxas steps release the GIL; background work: at most 8).
        Their spans are recorded as the caller's are (``trace.carry``). Background work
        lets this process's compiles on the way to a first output go first: each job
        waits for them (``workers.foreground``)."""
        behind = trace.in_background()
        one = foreground.yielding(self.get_or_compile) if behind else self.get_or_compile
        if len(jobs) < 2:
            return [one(job) for job in jobs]
        work = trace.carry(one)
        threads = min(8, kernel_threads()) if behind else kernel_threads()
        with ThreadPoolExecutor(min(threads, len(jobs)),
                                thread_name_prefix="kiln-kernel") as pool:
            return list(pool.map(work, jobs))

    def _from_backing(self, job: KernelJob) -> KernelBinary | None:
        if self.backing is None:
            return None
        with trace.span("kernel store lookup", cat="kernel", kernel=job.spec.name) as info:
            binary = self.backing.get(job)
            info["hit"] = binary is not None
        if binary is not None:
            with self._lock:
                self.store_hits += 1
        return binary


def compile_inprocess(request_bytes: bytes, key: str, *, cache: KernelCache | None = None,
                      delay: float = 0.0, extra_options: dict[str, Any] | None = None,
                      choices: Any = None, stages: Any = None) -> CompiledGraph:
    """The whole pipeline in this process, no Ray, with heuristic configs. Max-autotune
    first chooses each matmul's algorithm (``workers.select``; ``choices`` caches them).
    Where this process could autotune (asked, a GPU of the target's arch) and some kernel
    has several candidates, ``stats["autotune_pending"]`` says so: the client then runs
    ``autotune_inprocess`` in the background. ``stages``: a ``StagePool`` whose child
    processes run the graph stage (this process's GIL stays free for other graphs)."""
    cache = cache or KernelCache()
    compiled = _graph_stage(request_bytes, key, delay, extra_options, stages)
    request = CompileRequest.from_bytes(request_bytes)
    target = request.target
    if compiled.stats.get("gemm_pending"):
        from .select import MemoryChoiceCache, select_inprocess

        compiled = select_inprocess(request_bytes, key, compiled, target,
                                    cache.get_or_compile, choices or MemoryChoiceCache(),
                                    extra_options, bool(request.options.get("autotune", True)))
    start = time.perf_counter()
    firsts = {name: jobs[0] for name, jobs in kernel_jobs(compiled, target).items()}
    chosen = dict(zip(firsts, cache.compile_all(list(firsts.values()))))
    finish(compiled, chosen, kernel_wall_s=time.perf_counter() - start)
    if local_autotune(request) and tunable(compiled, target):
        compiled.stats["autotune_pending"] = True
    return compiled


def _graph_stage(request_bytes: bytes, key: str, delay: float,
                 extra_options: dict[str, Any] | None, stages: Any) -> CompiledGraph:
    if stages is not None:
        from .stage_pool import StagePoolError

        try:
            return stages.compile_sources(request_bytes, key, delay=delay,  # type: ignore[no-any-return]
                                          extra_options=extra_options)
        except StagePoolError as e:  # the pool is an optimization: compile here
            log.debug("kiln: graph stage in this process: %s", e)
    return compile_sources(request_bytes, key, delay=delay, extra_options=extra_options)


def tunable(compiled: CompiledGraph, target: dict[str, Any]) -> bool:
    """Whether any kernel of the graph has more than one candidate config to time."""
    return any(len(jobs) > 1 for jobs in kernel_jobs(compiled, target, autotune=True).values())


def autotune_inprocess(heuristic: CompiledGraph, target: dict[str, Any],
                       cache: KernelCache | None = None, *, beside_program: bool = True
                       ) -> CompiledGraph:
    """The graph with kernels' candidates compiled and timed on this process's GPU
    (``workers.autotune.benchmark``), the fastest chosen: what a client runs in the
    background after its first output came from heuristic configs. The GPU runs the
    user's program meanwhile: every launch waits for a turn of ``workers.gpu_share``;
    each kernel's heuristic config is timed first, and only kernels it leaves far from
    the roofline (``worth_tuning``), the slowest first, have their other candidates
    compiled and timed. ``beside_program=False``: a GPU worker with no program of its
    own (``kiln precompile --gpu-worker``) times every candidate, in turns only where
    another process computes on its GPU (``gpu_share.farm_pacer``)."""
    from . import gpu_share

    cache = cache or KernelCache()
    compiled = CompiledGraph.from_dict(heuristic.to_dict())
    compiled.stats.pop("autotune_pending", None)
    start = time.perf_counter()
    jobs = kernel_jobs(compiled, target, autotune=True)
    if beside_program:
        share = gpu_share.local_share()
        with share.tuning(), trace.span("autotune beside the program", cat="autotune",
                                        gpu=share.stats.gpu):
            chosen, timed = _tune_sliced(jobs, cache, share, share.stats.gpu)
        compiled.stats["gpu_share"] = {"skipped_near_roofline": sum(
            1 for records in timed.values() if records and records[0].get("kept"))}
    else:
        chosen, timed = _tune_sliced(jobs, cache, gpu_share.farm_pacer(), "local",
                                     every_kernel=True)
    return finish(compiled, chosen, autotune=timed, kernel_wall_s=time.perf_counter() - start)


def _tune_sliced(jobs: dict[str, list[KernelJob]], cache: KernelCache, pacer: Any,
                 gpu: str, every_kernel: bool = False
                 ) -> tuple[dict[str, KernelBinary], dict[str, list[dict[str, Any]]]]:
    """Each kernel's chosen binary and its timing record (see ``autotune_inprocess``);
    ``pacer`` None: the GPU is the tuner's own."""
    from . import gpu_share
    from .autotune import benchmark

    heuristics = dict(zip(jobs, cache.compile_all([group[0] for group in jobs.values()])))
    chosen: dict[str, KernelBinary] = dict(heuristics)
    first: dict[str, float] = {}
    for name, group in jobs.items():
        if len(group) > 1:
            foreground.wait_idle()
            with trace.span("autotune heuristic", cat="autotune", kernel=name, gpu=gpu):
                first[name] = benchmark(group[0].spec, [heuristics[name]], pacer=pacer)[0]
    peak = gpu_share.peak_gb_s(pacer or gpu_share.Unpaced()) if first and not every_kernel \
        else None
    timed: dict[str, list[dict[str, Any]]] = {}
    for name in sorted(first, key=lambda n: -first[n] if math.isfinite(first[n]) else -1e9):
        group = jobs[name]
        if not every_kernel and not gpu_share.worth_tuning(
                sum(group[0].spec.arg_bytes), first[name], peak):
            timed[name] = [{"config": group[0].config, "ms": first[name], "kept": True}]
            continue
        rest = cache.compile_all(group[1:])
        foreground.wait_idle()
        with trace.span("autotune benchmark", cat="autotune", kernel=name, gpu=gpu,
                        candidates=len(group)):
            timings = [first[name], *benchmark(group[0].spec, rest, pacer=pacer)]
        chosen[name], timed[name] = fastest(group, timings, [heuristics[name], *rest])
    return chosen, timed


def local_autotune(request: CompileRequest | StoredRequest) -> bool:
    """Whether this process can autotune the request: asked, and a GPU of its arch (or
    the tests' fake benchmark)."""
    if not request.options.get("autotune", True) or request.target.get("kind") != "cuda":
        return False
    from .autotune import fake_autotune, gpu_arch

    return fake_autotune() or gpu_arch() == int(request.target.get("arch", -1))


def fastest(jobs: Iterable[KernelJob], timings_ms: list[float],
            binaries: list[KernelBinary]) -> tuple[KernelBinary, list[dict[str, Any]]]:
    """The binary with the lowest time, and the record the artifact keeps of the choice
    (``compiler.autotune``'s format: each candidate's config and median milliseconds)."""
    jobs = list(jobs)
    best = min(range(len(jobs)), key=lambda i: (timings_ms[i], i))
    record = [{"config": job.config, "ms": t} for job, t in zip(jobs, timings_ms)]
    return binaries[best], record
