"""``KilnFarm``: the farm's one named, detached coordinator actor.

Every client of a cluster calls the same ``KilnFarm`` (found by name), which is what lets
it de-duplicate: a key already in flight is not compiled again, its waiters share the
one result; a key finished a moment ago is answered from a small recent-results list
(the client that asked first may not have published it yet). For each graph it asks a
``CompileWorker`` for kernel sources, fans the kernels out as Ray tasks (one per unique
kernel source, config and target, remembered across graphs and requests, so identical
kernels compile once), has ``Autotuner`` actors time the candidates where the cluster has
a GPU of the target's arch, and returns the finished ``CompiledGraph`` as a dict.

The actor's namespace carries a hash of the compiler's versions: a client with another
Kiln gets (and warms) its own farm instead of one that would refuse its requests.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import logging
import os
import time
from collections import Counter, OrderedDict
from typing import Any

import ray

from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.ir.template import GemmProblem
from kiln.compiler.kernel_compile import KernelBinary
from kiln.compiler.request import CompileRequest
from kiln.compiler.versions import compiler_dir, versions
from kiln.workers import FARM_COUNTERS

from .actors import Autotuner, CompileWorker, compile_kernel_task, warm_kernel_process
from .pipeline import CompileFailure, KernelJob, fastest, finish, kernel_jobs
from .select import (
    ChoiceCache,
    MemoryChoiceCache,
    StoreChoiceCache,
    decide,
    pending_problems,
    selection_stats,
    split_known,
    template_jobs,
    untuned_record,
    with_choices,
)

log = logging.getLogger("kiln.farm")

FARM_NAME = "KilnFarm"
AUTOTUNER_RECHECK_S = 60.0


def farm_namespace() -> str:
    """The Ray namespace of this Kiln's farm: one per compiler version."""
    digest = hashlib.sha256(json.dumps(versions(), sort_keys=True).encode()).hexdigest()
    return f"kiln-{digest[:12]}"


def root_cause(error: BaseException) -> BaseException:
    """The exception under Ray's task-error wrappers (a task that awaited a task...)."""
    while isinstance(error, ray.exceptions.RayTaskError) and error.cause is not None:
        error = error.cause
    return error


def default_graph_workers(cpus: int) -> int:
    return max(1, min(8, cpus // 2))


class KilnFarm:
    """The coordinator (an async Ray actor): de-duplication, fan-out, autotuning."""

    def __init__(self, graph_workers: int | None = None, kernel_cache_entries: int = 4096,
                 recent_entries: int = 64) -> None:
        cpus = int(ray.cluster_resources().get("CPU", 1))
        count = graph_workers or default_graph_workers(cpus)
        self.workers = [CompileWorker.remote() for _ in range(count)]  # type: ignore[attr-defined]
        self.load = [0] * count
        self.inflight: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.recent: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.recent_entries = recent_entries
        self.kernels: OrderedDict[str, Any] = OrderedDict()  # job key -> ObjectRef
        self.kernel_cache_entries = kernel_cache_entries
        self.autotuners: list[Any] = []
        self.autotuner_arch: list[int | None] = []
        self.autotuners_checked = -AUTOTUNER_RECHECK_S
        self.counters: Counter[str] = Counter()
        self.choices: ChoiceCache | None = None
        self.started = time.time()
        # Start the workers' processes now: the first miss should not pay for imports.
        self._warming = [w.warm.remote() for w in self.workers]
        self._warming += [warm_kernel_process.remote() for _ in range(max(1, cpus))]

    # -- introspection ----------------------------------------------------------------

    async def ping(self) -> dict[str, Any]:
        resources = ray.cluster_resources()
        return {"pid": os.getpid(), "graph_workers": len(self.workers),
                "cpus": resources.get("CPU", 0), "gpus": resources.get("GPU", 0),
                "versions": versions(), "compiler": str(compiler_dir()),
                "since": self.started}

    async def wait_warm(self) -> int:
        """Wait until the workers and kernel processes have imported the compiler."""
        pids = await asyncio.gather(*self._warming)
        return len(set(pids))

    async def stats(self) -> dict[str, Any]:
        return {**dict.fromkeys(FARM_COUNTERS, 0), **dict(self.counters),
                "inflight": len(self.inflight),
                "kernel_cache": len(self.kernels), "recent": len(self.recent),
                "graph_workers": len(self.workers), "autotuners": len(self.autotuners)}

    async def worker_pids(self) -> list[int]:
        return list(await asyncio.gather(*(w.pid.remote() for w in self.workers)))

    # -- compiling --------------------------------------------------------------------

    async def compile(self, key: str, request_bytes: bytes, delay: float = 0.0
                      ) -> dict[str, Any]:
        """The compiled graph of ``key`` (``CompiledGraph.to_dict()``); one compile however
        many clients ask at once."""
        self.counters["requests"] += 1
        if key in self.recent:
            self.counters["recent_hits"] += 1
            self.recent.move_to_end(key)
            return self.recent[key]
        future = self.inflight.get(key)
        if future is None:
            future = asyncio.ensure_future(self._compile(key, request_bytes, delay))
            self.inflight[key] = future
            future.add_done_callback(functools.partial(self._done, key))
        else:
            self.counters["deduplicated"] += 1
        return await asyncio.shield(future)

    def _done(self, key: str, future: asyncio.Future[dict[str, Any]]) -> None:
        self.inflight.pop(key, None)
        if future.cancelled() or future.exception() is not None:
            self.counters["failures"] += 1
            return
        self.recent[key] = future.result()
        while len(self.recent) > self.recent_entries:
            self.recent.popitem(last=False)

    async def _compile(self, key: str, request_bytes: bytes, delay: float) -> dict[str, Any]:
        self.counters["graph_compiles"] += 1
        try:
            return await self._compile_graph(key, request_bytes, delay)
        except ray.exceptions.RayTaskError as e:
            cause = root_cause(e)
            if isinstance(cause, CompileFailure):
                raise CompileFailure.wrap(cause, key) from None
            raise

    async def _compile_graph(self, key: str, request_bytes: bytes, delay: float
                             ) -> dict[str, Any]:
        i = min(range(len(self.workers)), key=lambda j: self.load[j])
        self.load[i] += 1
        try:
            sources = await self.workers[i].compile_sources.remote(request_bytes, key, delay)
        finally:
            self.load[i] -= 1
        compiled = CompiledGraph.from_dict(sources)
        request = CompileRequest.from_bytes(request_bytes)
        tuners = await self._autotuners_for(request) if request.options.get(
            "autotune", True) else []
        if compiled.stats.get("gemm_pending"):
            # Max-autotune: choose each matmul's algorithm, then the graph again with them.
            compiled = await self._select(key, request_bytes, compiled, request, tuners, i)
        start = time.perf_counter()
        jobs = kernel_jobs(compiled, request.target, autotune=bool(tuners))
        results = await asyncio.gather(*(self._kernel(name, group, tuners)
                                         for name, group in jobs.items()))
        chosen = {name: binary for name, binary, _ in results}
        timed = {name: record for name, _, record in results if record is not None}
        finish(compiled, chosen, autotune=timed, kernel_wall_s=time.perf_counter() - start)
        return compiled.to_dict()

    async def _select(self, key: str, request_bytes: bytes, compiled: CompiledGraph,
                      request: CompileRequest, tuners: list[Any], worker: int
                      ) -> CompiledGraph:
        """Cached choices from the store; the rest compiled as kernel tasks and timed on
        the GPU autotuners (problems spread over them); winners cached for the fleet."""
        start = time.perf_counter()
        cache = self._choice_cache()
        known, todo = await asyncio.to_thread(split_known, pending_problems(compiled), cache)
        new: dict[str, dict[str, Any]] = {}
        if tuners:
            found = await asyncio.gather(*(
                self._tune_gemm(choice, problem, request.target, tuners[n % len(tuners)])
                for n, (choice, problem) in enumerate(todo.items())))
            new = dict(found)
            for choice, record in new.items():
                await asyncio.to_thread(cache.put, choice, record)
        else:
            new = {choice: untuned_record() for choice in todo}
        options = {"gemm_choices": {**known, **new}}
        sources = await self.workers[worker].compile_sources.remote(request_bytes, key, 0.0,
                                                                    options)
        result = CompiledGraph.from_dict(sources)
        result.timings["gemm_selection"] = time.perf_counter() - start
        return with_choices(result, selection_stats(known, todo, bool(tuners)))

    async def _tune_gemm(self, choice: str, problem: GemmProblem, target: dict[str, Any],
                         tuner: Any) -> tuple[str, dict[str, Any]]:
        jobs = template_jobs(choice, problem, target)
        kernel_jobs = [job for _, job in jobs if job is not None]
        outcomes = await asyncio.gather(*(self._binary(job) for job in kernel_jobs),
                                        return_exceptions=True)
        binaries = [None if isinstance(o, BaseException) else o.to_dict() for o in outcomes]
        self.counters["gemm_benchmarks"] += 1
        timings = await tuner.benchmark_gemm.remote(
            problem.to_dict(), [job.spec.to_dict() for job in kernel_jobs], binaries)
        return choice, decide(problem, [c for c, _ in jobs], timings)

    def _choice_cache(self) -> ChoiceCache:
        """The farm's matmul choices: in the store its environment names (fleet-wide),
        with this coordinator's memory in front; memory alone if no store opens."""
        if self.choices is None:
            try:
                from kiln.artifact_store import open_store

                self.choices = MemoryChoiceCache(StoreChoiceCache(open_store()))
            except Exception as e:  # choices are an optimization: tune again later
                log.warning("kiln farm: no store for matmul choices (%s)", e)
                self.choices = MemoryChoiceCache()
        return self.choices

    async def _kernel(self, name: str, jobs: list[KernelJob], tuners: list[Any]
                      ) -> tuple[str, KernelBinary, list[dict[str, Any]] | None]:
        outcomes = await asyncio.gather(*(self._binary(job) for job in jobs),
                                        return_exceptions=True)
        if isinstance(outcomes[0], BaseException) and (len(jobs) == 1 or all(
                isinstance(o, BaseException) for o in outcomes)):
            raise outcomes[0]  # the heuristic config itself does not compile
        if len(jobs) == 1 or not tuners:
            return name, outcomes[0], None  # type: ignore[return-value]
        usable = [i for i, o in enumerate(outcomes) if not isinstance(o, BaseException)]
        binaries: list[KernelBinary] = [outcomes[i] for i in usable]  # type: ignore[misc]
        tuner = tuners[self.counters["autotune_calls"] % len(tuners)]
        self.counters["autotune_calls"] += 1
        timings = await tuner.benchmark.remote(jobs[0].spec.to_dict(),
                                               [b.to_dict() for b in binaries])
        best, record = fastest([jobs[i] for i in usable], timings, binaries)
        self.counters["autotuned_kernels"] += 1
        return name, best, record

    async def _binary(self, job: KernelJob) -> KernelBinary:
        """The binary of one job: compiled once per farm, shared by every graph."""
        ref = self.kernels.get(job.key)
        if ref is None:
            ref = compile_kernel_task.remote(job.spec.to_dict(), job.config, job.target)
            self.counters["kernel_compiles"] += 1
            self.kernels[job.key] = ref
            while len(self.kernels) > self.kernel_cache_entries:
                self.kernels.popitem(last=False)
        else:
            self.counters["kernel_cache_hits"] += 1
            self.kernels.move_to_end(job.key)
        try:
            return KernelBinary.from_dict(await ref)
        except Exception:
            self.kernels.pop(job.key, None)  # the next request tries again
            raise

    async def _autotuners_for(self, request: CompileRequest) -> list[Any]:
        """Autotuners whose GPU is the request's arch; none for a CPU target or farm."""
        target = request.target
        if target.get("kind") != "cuda":
            return []
        now = time.monotonic()
        if now - self.autotuners_checked >= AUTOTUNER_RECHECK_S:
            self.autotuners_checked = now
            await self._add_autotuners()
        arch = int(target.get("arch", -2))
        return [t for t, a in zip(self.autotuners, self.autotuner_arch) if a in (arch, -1)]

    async def _add_autotuners(self) -> None:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        new = [Autotuner.remote() for _ in range(max(0, gpus - len(self.autotuners)))]  # type: ignore[attr-defined]
        if not new:
            return
        try:
            arches = await asyncio.wait_for(
                asyncio.gather(*(t.arch.remote() for t in new)), timeout=120)
        except Exception as e:  # GPUs that will not start: autotune without them
            log.warning("kiln farm: GPU autotuners did not start (%s)", e)
            return
        self.autotuners += new
        self.autotuner_arch += list(arches)


RemoteKilnFarm = ray.remote(KilnFarm)


def get_farm_actor(graph_workers: int | None = None) -> Any:
    """The cluster's coordinator for this Kiln: found by name, else created (detached)."""
    return RemoteKilnFarm.options(  # type: ignore[attr-defined]
        name=FARM_NAME, namespace=farm_namespace(), lifetime="detached", get_if_exists=True,
        num_cpus=0, max_restarts=-1, max_concurrency=10000,
    ).remote(graph_workers)
