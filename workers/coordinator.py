"""``KilnFarm``: the farm's one named, detached coordinator actor.

Every client of a cluster calls the same ``KilnFarm`` (found by name), which is what lets
it de-duplicate. A caller sends request bytes, never a key: the coordinator recomputes
the key from them (a caller naming another graph's key is refused), and, where the farm
is a builder (its own ``KILN_STORE`` and private ``KILN_SIGNING_KEY``), publishes the
signed artifact itself before answering (``workers.publish``). A key already in flight
is not compiled again, its waiters share the one result; a key finished a moment ago is
answered from a small recent-results list. For each graph it asks a
``CompileWorker`` for kernel sources, fans the kernels out over its warm
``KernelWorker`` actors (one job per unique kernel source, config and target, remembered
across graphs and requests, so identical kernels compile once), returns the finished
``CompiledGraph`` as a dict, and then has ``Autotuner`` actors time the candidates in the
background where the cluster has a GPU of the target's arch (the answer waits neither for
tuning nor for the autotuners to start, except max-autotune's matmul choices).

The actor's namespace carries a hash of the compiler's versions: a client with another
Kiln gets (and warms) its own farm instead of one that would refuse its requests.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from collections import Counter, OrderedDict
from typing import Any

import ray

from kiln.compiler import trace
from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.ir.template import GemmProblem
from kiln.compiler.kernel_compile import KernelBinary
from kiln.compiler.keys import KeyInfo, compute_key
from kiln.compiler.request import CompileRequest
from kiln.compiler.select_algorithm import describe_choice
from kiln.compiler.versions import compiler_dir, versions
from kiln.workers import FARM_COUNTERS

from .actors import Autotuner, CompileWorker, KernelWorker
from .gpu_pool import ActorPool, gpu_lane_event
from .kernel_store import KernelStore
from .names import FARM_NAME, namespace_for
from .pipeline import CompileFailure, FarmKeyMismatch, KernelJob, fastest, finish, kernel_jobs
from .publish import FarmPublisher
from .select import (
    ChoiceCache,
    MemoryChoiceCache,
    StoreChoiceCache,
    by_rule,
    decide,
    first_pass_as_chosen,
    pending_problems,
    selection_stats,
    split_known,
    template_jobs,
    untuned_record,
    with_choices,
)

log = logging.getLogger("kiln.farm")

AUTOTUNER_RECHECK_S = 60.0
# The longest background tuning of a graph waits for a client to ask for it (``tuned``).
TUNING_HOLD_S = 10.0
# An honest request decodes well within this; a slower one is refused, and the loop serves on.
DECODE_DEADLINE_S = 10.0


def farm_namespace() -> str:
    """The Ray namespace of this Kiln's farm: one per compiler version."""
    return namespace_for(versions())


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
                 recent_entries: int = 64, max_gpus: int | None = None) -> None:
        """``max_gpus``: autotune on at most this many of the cluster's GPUs (all if
        None)."""
        trace.set_process_name("farm coordinator")
        self.max_gpus = max_gpus
        cpus = int(ray.cluster_resources().get("CPU", 1))
        count = graph_workers or default_graph_workers(cpus)
        self.workers = [CompileWorker.remote() for _ in range(count)]  # type: ignore[attr-defined]
        self.load = [0] * count
        self.inflight: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.recent: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.recent_entries = recent_entries
        self.kernels: OrderedDict[str, Any] = OrderedDict()  # job key -> future of a dict
        self._kernels_store: KernelStore | None = None
        self._kernels_store_checked = False
        self._background: set[asyncio.Future[Any]] = set()
        self.kernel_cache_entries = kernel_cache_entries
        self.tuning: OrderedDict[str, asyncio.Future[dict[str, Any] | None]] = OrderedDict()
        self.tuning_events: list[trace.Event] = []
        self.tuning_gates: dict[str, asyncio.Event] = {}
        self.gpus = ActorPool()  # one Autotuner actor per GPU of the cluster
        self.autotuners_checked = -AUTOTUNER_RECHECK_S
        self._finding_autotuners: asyncio.Future[None] | None = None
        self.counters: Counter[str] = Counter()
        self.choices: ChoiceCache | None = None
        self.publisher = FarmPublisher()
        self.started = time.time()
        # One kernel worker per CPU, spread over the cluster's nodes (they reserve none).
        self.kernel_workers = ActorPool()
        for _ in range(max(1, cpus)):
            self.kernel_workers.add(KernelWorker.options(  # type: ignore[attr-defined]
                scheduling_strategy="SPREAD").remote(), {})
        # Start the workers' processes now: the first miss should not pay for imports.
        self._warming = [w.warm.remote() for w in self.workers]
        self._warming += [m.actor.warm.remote() for m in self.kernel_workers.members]

    # -- introspection ----------------------------------------------------------------

    async def ping(self) -> dict[str, Any]:
        resources = ray.cluster_resources()
        return {"pid": os.getpid(), "graph_workers": len(self.workers),
                "cpus": resources.get("CPU", 0), "gpus": resources.get("GPU", 0),
                "versions": versions(), "compiler": str(compiler_dir()),
                "since": self.started, "kernel_store": self.kernel_store_url()}

    def kernel_store_url(self) -> str | None:
        store = self._kernel_store()
        return None if store is None else store.store.url

    async def wait_warm(self) -> int:
        """Wait until the workers and kernel processes have imported the compiler, and
        the GPU autotuners have started (the first request does not wait for them)."""
        pids = await asyncio.gather(*self._warming)
        await self._find_autotuners()
        return len(set(pids))

    async def stats(self) -> dict[str, Any]:
        return {**dict.fromkeys(FARM_COUNTERS, 0), **dict(self.counters),
                "inflight": len(self.inflight),
                "kernel_cache": len(self.kernels), "recent": len(self.recent),
                "graph_workers": len(self.workers), "autotuners": len(self.gpus.members)}

    async def gpu_usage(self) -> list[dict[str, Any]]:
        """Per GPU autotuner: the GPU ids Ray bound it to, jobs run, seconds busy."""
        return self.gpus.usage()

    async def worker_pids(self) -> list[int]:
        return list(await asyncio.gather(*(w.pid.remote() for w in self.workers)))

    async def kernel_worker_pids(self) -> list[int]:
        return list(await asyncio.gather(*(m.actor.pid.remote()
                                           for m in self.kernel_workers.members)))

    # -- compiling --------------------------------------------------------------------

    async def compile(self, request_bytes: bytes, delay: float = 0.0,
                      expected_key: str | None = None, traced: bool = False
                      ) -> dict[str, Any]:
        """``{"key", "compiled", "published"}`` for a request: its recomputed key, the
        ``CompiledGraph.to_dict()`` (heuristic configs) and the store URL the farm
        published it to ("" if not: the store was down or full; asked for again, it is
        published again). One compile however many clients ask at once.
        ``expected_key`` is what the caller computed: a mismatch is refused, never stored
        under either key. ``traced``: ``trace`` holds the spans of every process that
        worked on it. Where GPU autotuners fit the target, ``stats["autotune_pending"]``
        says tuning goes on in the background (the farm publishes the tuned artifact;
        ``tuned(key)`` returns it)."""
        self.counters["requests"] += 1
        request, key = await self._decode_off_loop(request_bytes, expected_key)
        if key.key in self.recent:
            self.counters["recent_hits"] += 1
            self.recent.move_to_end(key.key)
            result = self.recent[key.key]
            if not result["published"]:  # the store was down or full: it may be back
                result["published"] = await self._publish(key, request, result["compiled"],
                                                          result["wall_s"])
                self.counters["republished"] += bool(result["published"])
            return result
        future = self.inflight.get(key.key)
        if future is None:
            future = asyncio.ensure_future(self._compile(key, request, request_bytes, delay,
                                                         traced))
            self.inflight[key.key] = future
            future.add_done_callback(functools.partial(self._done, key.key))
        else:
            self.counters["deduplicated"] += 1
        return await asyncio.shield(future)

    async def tuned(self, key: str) -> dict[str, Any] | None:
        """The autotuned graph of ``key`` once its background tuning ends; None if none
        runs (no GPU of the target's arch, nothing to tune) or it failed."""
        future = self.tuning.get(key)
        if future is None:
            return None
        gate = self.tuning_gates.get(key)
        if gate is not None:
            gate.set()  # asked for: it starts now
        try:
            return await asyncio.shield(future)
        except Exception as e:  # tuning is an optimization: the heuristic artifact stays
            log.warning("kiln farm: autotuning graph %s failed: %s", key[:16], e)
            return None

    async def _decode_off_loop(self, request_bytes: bytes, expected_key: str | None
                               ) -> tuple[CompileRequest, KeyInfo]:
        """``_decode`` on a thread, within DECODE_DEADLINE_S: hostile bytes (bounded by
        the decoder, and this bound besides) never hold the loop that serves every other
        client."""
        try:
            return await asyncio.wait_for(
                asyncio.to_thread(self._decode, request_bytes, expected_key),
                DECODE_DEADLINE_S)
        except TimeoutError:
            self.counters["refused"] += 1
            raise CompileFailure.wrap(TimeoutError(
                f"the request did not decode within {DECODE_DEADLINE_S:g}s: refused"),
                expected_key or "") from None

    def _decode(self, request_bytes: bytes, expected_key: str | None
                ) -> tuple[CompileRequest, KeyInfo]:
        try:
            request = CompileRequest.from_bytes(request_bytes)
            key = compute_key(request)
        except Exception as e:  # hostile or damaged bytes: the caller's error
            self.counters["refused"] += 1
            raise CompileFailure.wrap(e, expected_key or "") from None
        if expected_key is not None and expected_key != key.key:
            self.counters["refused"] += 1
            raise FarmKeyMismatch(
                f"the request's bytes hash to key {key.key}, not {expected_key}: the farm "
                "computes every key itself and stores nothing under a key a caller names")
        return request, key

    def _done(self, key: str, future: asyncio.Future[dict[str, Any]]) -> None:
        self.inflight.pop(key, None)
        if future.cancelled() or future.exception() is not None:
            self.counters["failures"] += 1
            return
        result = {k: v for k, v in future.result().items() if k != "trace"}
        self.recent[key] = result
        while len(self.recent) > self.recent_entries:
            self.recent.popitem(last=False)

    async def _compile(self, key: KeyInfo, request: CompileRequest, request_bytes: bytes,
                       delay: float, traced: bool = False) -> dict[str, Any]:
        self.counters["graph_compiles"] += 1
        timeline: list[trace.Event] | None = [] if traced else None
        arrived = trace.now_us()
        start = time.perf_counter()
        # The farm's claim in its store tells processes compiling with no farm (or with
        # another farm) to wait for this artifact; the farm itself compiles either way.
        claim = await asyncio.to_thread(self.publisher.claim, key.key)
        try:
            compiled = await self._compile_graph(key, request_bytes, delay, timeline)
            wall = time.perf_counter() - start
            began = trace.now_us()
            published = await self._publish(key, request, compiled, wall)
        except ray.exceptions.RayTaskError as e:
            cause = root_cause(e)
            if isinstance(cause, CompileFailure):
                raise CompileFailure.wrap(cause, key.key) from None
            raise
        finally:
            if claim is not None:
                await asyncio.to_thread(claim.release)
        self.counters["published" if published else "not_published"] += 1
        result: dict[str, Any] = {"key": key.key, "compiled": compiled,
                                  "published": published, "wall_s": wall}
        if timeline is not None:
            now = trace.now_us()
            timeline.append(trace.make_event("farm publish", began, now, cat="farm",
                                             key=key.key[:16]))
            timeline.append(trace.make_event("farm request", arrived, now, cat="farm",
                                             key=key.key[:16]))
            result["trace"] = timeline
        return result

    async def _publish(self, key: KeyInfo, request: CompileRequest, compiled: dict[str, Any],
                       wall: float) -> str:
        """The store's URL once ``compiled`` is published there, "" if it is not (the
        store's faults are its own warnings, once per outage)."""
        try:
            return await asyncio.to_thread(self.publisher.publish, key, request, compiled,
                                           wall)
        except Exception as e:  # a bug: the store's methods do not raise
            log.warning("kiln farm: publishing %s failed: %s", key.key, e)
            return ""

    async def _compile_graph(self, key_info: KeyInfo, request_bytes: bytes, delay: float,
                             timeline: list[trace.Event] | None) -> dict[str, Any]:
        key = key_info.key
        asked = trace.now_us()
        i = min(range(len(self.workers)), key=lambda j: self.load[j])
        self.load[i] += 1
        try:
            sources = await self.workers[i].compile_sources.remote(
                request_bytes, key, delay, timeline is not None)
        finally:
            self.load[i] -= 1
        worker_events = sources.pop("trace", None) or []
        if timeline is not None:
            began = min((float(e["ts"]) for e in worker_events), default=asked)
            timeline.append(trace.make_event("queue for a compile worker", asked, began,
                                             cat="farm", worker=i))
            timeline.extend(worker_events)
        compiled = CompiledGraph.from_dict(sources)
        request = CompileRequest.from_bytes(request_bytes)
        autotune = bool(request.options.get("autotune", True))
        if compiled.stats.get("gemm_pending"):
            # Max-autotune: choose each matmul's algorithm (on the GPUs, so this waits for
            # the autotuners), then the graph again with them.
            compiled = await self._select(key, request_bytes, compiled, request, autotune, i,
                                          timeline)
        fanned = trace.now_us()
        start = time.perf_counter()
        jobs = kernel_jobs(compiled, request.target)
        results = await asyncio.gather(*(self._kernel(name, group, [], timeline)
                                         for name, group in jobs.items()))
        chosen = {name: binary for name, binary, _ in results}
        finish(compiled, chosen, kernel_wall_s=time.perf_counter() - start)
        if timeline is not None:
            timeline.append(trace.make_event("kernel fan-out", fanned, trace.now_us(),
                                             cat="farm", kernels=len(jobs)))
        if autotune and self._may_autotune(request) and any(
                len(group) > 1 for group in
                kernel_jobs(compiled, request.target, autotune=True).values()):
            compiled.stats["autotune_pending"] = True
            self._start_tuning(key_info, compiled.to_dict(), request)
        return compiled.to_dict()

    def _start_tuning(self, key: KeyInfo, heuristic: dict[str, Any], request: CompileRequest
                      ) -> None:
        """Autotune in the background; the first answer waits neither for it nor for the
        autotuners to start. The benchmarks begin once a client asks for the result
        (``tuned``; a client asks after its graph's first output) or ``TUNING_HOLD_S``
        later: on a host whose one GPU serves both, they slowed the client's first call
        (GPT-2 on the H200 host: 1.3 s from the farm's answer to the first output,
        against 0.45 s in process, where tuning waits for the first call too)."""
        self.counters["autotune_started"] += 1
        gate = self.tuning_gates[key.key] = asyncio.Event()
        self.tuning[key.key] = asyncio.ensure_future(
            self._autotune(key, heuristic, request, gate))
        while len(self.tuning) > self.recent_entries:
            self.tuning.popitem(last=False)

    async def _autotune(self, key: KeyInfo, heuristic: dict[str, Any],
                        request: CompileRequest, gate: asyncio.Event
                        ) -> dict[str, Any] | None:
        finding = asyncio.ensure_future(self._autotuners_for(request))
        try:
            await asyncio.wait_for(gate.wait(), TUNING_HOLD_S)
        except TimeoutError:
            pass  # nobody asked: tune anyway, for the store
        finally:
            self.tuning_gates.pop(key.key, None)
        tuners = await finding
        if not tuners:
            return None  # no GPU of the target's arch: the heuristic artifact stays
        compiled = CompiledGraph.from_dict(heuristic)
        compiled.stats.pop("autotune_pending", None)
        start = time.perf_counter()
        jobs = kernel_jobs(compiled, request.target, autotune=True)
        results = await asyncio.gather(*(self._kernel(name, group, tuners, None)
                                         for name, group in jobs.items()))
        chosen = {name: binary for name, binary, _ in results}
        timed = {name: record for name, _, record in results if record is not None}
        finish(compiled, chosen, autotune=timed, kernel_wall_s=time.perf_counter() - start)
        self.counters["autotuned_graphs"] += int(compiled.autotuned)
        tuned = compiled.to_dict()
        if compiled.autotuned:  # the tuned artifact supersedes the first in the store
            wall = time.perf_counter() - start
            await asyncio.to_thread(self.publisher.publish, key, request, tuned, wall)
        return tuned

    async def _select(self, key: str, request_bytes: bytes, compiled: CompiledGraph,
                      request: CompileRequest, autotune: bool, worker: int,
                      timeline: list[trace.Event] | None = None) -> CompiledGraph:
        """The library call for problems it wins by rule (``by_rule``); cached choices
        from the store; for the rest (and only then are the autotuners waited for), every
        template config compiled as a kernel job (kernel workers, all at once) and each
        problem timed on whichever GPU autotuner frees first; winners cached for the
        fleet; the graph again with them, unless every winner is the library call (the
        first pass is that graph already)."""
        start, began = time.perf_counter(), trace.now_us()
        pending = pending_problems(compiled)
        ruled, rest = by_rule(pending, request.target)
        cache = self._choice_cache()
        known, todo = await asyncio.to_thread(split_known, rest, cache)
        tuners = await self._autotuners_for(request) if autotune and todo else []
        new: dict[str, dict[str, Any]] = {}
        if tuners:
            found = await asyncio.gather(*(
                self._tune_gemm(choice, problem, request.target, tuners, timeline)
                for choice, problem in todo.items()))
            new = dict(found)
            for choice, record in new.items():
                await asyncio.to_thread(cache.put, choice, record)
        else:
            new = {choice: untuned_record() for choice in todo}
        chosen = {**ruled, **known, **new}
        stats = selection_stats(known, todo, bool(tuners))
        result = first_pass_as_chosen(compiled, pending, chosen, stats)
        if result is None:  # a template won: the graph again, with the winners
            sources = await self.workers[worker].compile_sources.remote(
                request_bytes, key, 0.0, timeline is not None, {"gemm_choices": chosen})
            if timeline is not None:
                timeline.extend(sources.pop("trace", None) or [])
            result = with_choices(CompiledGraph.from_dict(sources), stats)
        if timeline is not None:
            timeline.append(trace.make_event(
                "gemm selection", began, trace.now_us(), cat="farm", key=key[:16],
                problems=len(known) + len(todo), benchmarked=len(todo) if tuners else 0))
        result.timings["gemm_selection"] = time.perf_counter() - start
        return result

    async def _tune_gemm(self, choice: str, problem: GemmProblem, target: dict[str, Any],
                         tuners: list[int], timeline: list[trace.Event] | None
                         ) -> tuple[str, dict[str, Any]]:
        jobs = template_jobs(choice, problem, target)
        kernel_jobs = [job for _, job in jobs if job is not None]
        outcomes = await asyncio.gather(*(self._binary(job, timeline) for job in kernel_jobs),
                                        return_exceptions=True)
        binaries = [None if isinstance(o, BaseException) else o.to_dict() for o in outcomes]
        self.counters["gemm_benchmarks"] += 1
        async with self.gpus.use(tuners) as gpu:
            began = trace.now_us()
            timings = await gpu.actor.benchmark_gemm.remote(
                problem.to_dict(), [job.spec.to_dict() for job in kernel_jobs], binaries)
            event = gpu_lane_event(gpu, "gemm benchmark", began, trace.now_us(),
                                   problem=choice[7:23], candidates=1 + len(kernel_jobs))
        self._record_tuning(event, timeline)
        record = decide(problem, [c for c, _ in jobs], timings)
        log.info("kiln farm: GEMM choice %s", describe_choice(problem, record))
        return choice, record

    def _record_tuning(self, event: trace.Event, timeline: list[trace.Event] | None) -> None:
        """A benchmark's span: in the request's timeline (when traced) and in the farm's
        recent tuning spans (``tuning_trace``)."""
        if timeline is not None:
            timeline.append(event)
        self.tuning_events.append(event)
        del self.tuning_events[:-4096]

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

    async def _kernel(self, name: str, jobs: list[KernelJob], tuners: list[int],
                      timeline: list[trace.Event] | None
                      ) -> tuple[str, KernelBinary, list[dict[str, Any]] | None]:
        outcomes = await asyncio.gather(*(self._binary(job, timeline) for job in jobs),
                                        return_exceptions=True)
        if isinstance(outcomes[0], BaseException) and (len(jobs) == 1 or all(
                isinstance(o, BaseException) for o in outcomes)):
            raise outcomes[0]  # the heuristic config itself does not compile
        if len(jobs) == 1 or not tuners:
            return name, outcomes[0], None  # type: ignore[return-value]
        usable = [i for i, o in enumerate(outcomes) if not isinstance(o, BaseException)]
        binaries: list[KernelBinary] = [outcomes[i] for i in usable]  # type: ignore[misc]
        self.counters["autotune_calls"] += 1
        async with self.gpus.use(tuners) as gpu:
            began = trace.now_us()
            timings = await gpu.actor.benchmark.remote(jobs[0].spec.to_dict(),
                                                       [b.to_dict() for b in binaries])
            event = gpu_lane_event(gpu, "autotune benchmark", began, trace.now_us(),
                                   kernel=name, candidates=len(binaries))
        self._record_tuning(event, timeline)
        best, record = fastest([jobs[i] for i in usable], timings, binaries)
        self.counters["autotuned_kernels"] += 1
        return name, best, record

    async def _binary(self, job: KernelJob, timeline: list[trace.Event] | None = None
                      ) -> KernelBinary:
        """The binary of one job: compiled once per farm (or found in the kernel store),
        shared by every graph."""
        pending = self.kernels.get(job.key)
        fresh = pending is None
        if pending is None:
            pending = asyncio.ensure_future(self._fetch_or_compile(job, timeline is not None))
            self.kernels[job.key] = pending
            while len(self.kernels) > self.kernel_cache_entries:
                self.kernels.popitem(last=False)
        else:
            self.counters["kernel_cache_hits"] += 1
            self.kernels.move_to_end(job.key)
        try:
            result = await asyncio.shield(pending)
        except Exception:
            self.kernels.pop(job.key, None)  # the next request tries again
            raise
        if fresh and timeline is not None:
            timeline.extend(result.get("trace") or [])
        return KernelBinary.from_dict(result)

    async def _fetch_or_compile(self, job: KernelJob, traced: bool) -> dict[str, Any]:
        """The kernel store's binary for the job, else a kernel worker's (then stored)."""
        store = self._kernel_store()
        if store is not None:
            began = trace.now_us()
            found = await asyncio.to_thread(store.get, job)
            if found is not None:
                self.counters["kernel_store_hits"] += 1
                result = found.to_dict()
                if traced:
                    result["trace"] = [trace.make_event(
                        "kernel store lookup", began, trace.now_us(), cat="farm",
                        kernel=job.spec.name, hit=True)]
                return result
        self.counters["kernel_compiles"] += 1
        async with self.kernel_workers.use(self.kernel_workers.everyone()) as worker:
            result = await worker.actor.compile.remote(job.spec.to_dict(), job.config,
                                                       job.target, traced)
        if store is not None:
            binary = KernelBinary.from_dict(result)
            self._background.add(asyncio.ensure_future(asyncio.to_thread(store.put, job,
                                                                         binary)))
            self._background = {t for t in self._background if not t.done()}
        return dict(result)

    def _kernel_store(self) -> KernelStore | None:
        """The farm's own store (its environment's KILN_STORE, or the default), where
        kernels are shared by content key; ``KILN_FARM_KERNEL_STORE=off`` turns it off."""
        if self._kernels_store_checked:
            return self._kernels_store
        self._kernels_store_checked = True
        if os.environ.get("KILN_FARM_KERNEL_STORE", "").lower() in ("off", "0", "false"):
            return None
        try:
            from kiln.artifact_store import open_store

            self._kernels_store = KernelStore(open_store())
        except Exception as e:  # no store: the farm's memory still shares kernels
            log.warning("kiln farm: no kernel store (%s)", e)
        return self._kernels_store

    async def tuning_trace(self) -> list[trace.Event]:
        """The autotune benchmarks timed so far (each with its GPU), for timelines."""
        return list(self.tuning_events)

    def _may_autotune(self, request: CompileRequest) -> bool:
        """Whether background tuning can find a GPU for the request (its autotuners may
        still be starting): a CUDA target, and the cluster has GPUs."""
        if request.target.get("kind") != "cuda":
            return False
        arch = int(request.target.get("arch", -2))
        return bool(self.gpus.matching(arch)) or ray.cluster_resources().get("GPU", 0) > 0

    async def _autotuners_for(self, request: CompileRequest) -> list[int]:
        """The pool's autotuners whose GPU is the request's arch; none for a CPU target
        or farm."""
        target = request.target
        if target.get("kind") != "cuda":
            return []
        await self._find_autotuners()
        return self.gpus.matching(int(target.get("arch", -2)))

    async def _find_autotuners(self) -> None:
        """Start an autotuner for each GPU the cluster has and none serves (checked at
        most every ``AUTOTUNER_RECHECK_S``); callers meanwhile wait for the one search."""
        now = time.monotonic()
        if self._finding_autotuners is None or (
                self._finding_autotuners.done()
                and now - self.autotuners_checked >= AUTOTUNER_RECHECK_S):
            self.autotuners_checked = now
            self._finding_autotuners = asyncio.ensure_future(self._add_autotuners())
        await asyncio.shield(self._finding_autotuners)

    async def _add_autotuners(self) -> None:
        """One ``Autotuner`` per GPU of the cluster (each holds its GPU for life)."""
        gpus = int(ray.cluster_resources().get("GPU", 0))
        if self.max_gpus is not None:
            gpus = min(gpus, self.max_gpus)
        new = [Autotuner.remote()  # type: ignore[attr-defined]
               for _ in range(max(0, gpus - len(self.gpus.members)))]
        if not new:
            return
        try:
            infos = await asyncio.wait_for(
                asyncio.gather(*(t.describe.remote() for t in new)), timeout=120)
        except Exception as e:  # GPUs that will not start: autotune without them
            log.warning("kiln farm: GPU autotuners did not start (%s)", e)
            return
        for actor, info in zip(new, infos):
            self.gpus.add(actor, info)


RemoteKilnFarm = ray.remote(KilnFarm)


def get_farm_actor(graph_workers: int | None = None, *, name: str = FARM_NAME,
                   runtime_env: dict[str, Any] | None = None, max_gpus: int | None = None
                   ) -> Any:
    """The cluster's coordinator for this Kiln: found by name, else created (detached).

    ``runtime_env`` (for a farm started from Python; a deployed farm takes its store and
    key from its image's environment) reaches the coordinator and every worker it starts."""
    options: dict[str, Any] = {"name": name, "namespace": farm_namespace(),
                               "lifetime": "detached", "get_if_exists": True, "num_cpus": 0,
                               "max_restarts": -1, "max_concurrency": 10000}
    if runtime_env is not None:
        options["runtime_env"] = runtime_env
    return RemoteKilnFarm.options(**options).remote(  # type: ignore[attr-defined]
        graph_workers, max_gpus=max_gpus)
