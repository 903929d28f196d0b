"""Max-autotune's algorithm selection on the farm, without Ray: which matmuls of a graph
still need a choice, the kernel jobs of their template configs, the store-backed cache
of choices, and the graph compiled again with the winners.

    pending  = compiled.stats["gemm_pending"]         the first pass lowered them extern
    ruled    = the library call by rule, untimed       (fp32 in IEEE precision on Hopper)
    known    = choices cached under their choice keys  (a second model: all of them)
    todo     -> one KernelJob per template config      (CPU workers compile them)
             -> benchmark(problem, binaries)           (a GPU: extern call, every config)
             -> pick_winner -> cache.put
    compile_sources(..., gemm_choices=ruled + known + new)   the graph with the winners
                               (no second pass where every winner is the library call)

The inprocess farm runs these steps in order; the Ray coordinator (``coordinator.py``)
fans the jobs out as tasks and the benchmarks over its GPU ``Autotuner`` actors.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Protocol

from kiln.artifact_store import Artifact, Store
from kiln.compiler import trace
from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.ir.template import EXTERN, GemmProblem
from kiln.compiler.select_algorithm import (
    Candidate,
    candidates,
    check_record,
    describe_choice,
    library_only,
    library_record,
    pick_winner,
)

from .pipeline import KernelJob

log = logging.getLogger("kiln.select")


class ChoiceCache(Protocol):
    """Choice records by choice key (``compiler.select_algorithm``)."""

    def get(self, key: str) -> dict[str, Any] | None: ...

    def put(self, key: str, record: dict[str, Any]) -> None: ...


class MemoryChoiceCache:
    """A process's choices (in front of the store, and where there is no store)."""

    def __init__(self, backing: ChoiceCache | None = None) -> None:
        self.backing = backing
        self._records: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()

    def get(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            found = self._records.get(key)
        if found is None and self.backing is not None:
            found = self.backing.get(key)
            if found is not None:
                with self._lock:
                    self._records[key] = found
        return found

    def put(self, key: str, record: dict[str, Any]) -> None:
        with self._lock:
            self._records[key] = record
        if self.backing is not None:
            self.backing.put(key, record)


class StoreChoiceCache:
    """Choices in the artifact store, fleet-wide: one small signed manifest per choice
    key. What comes back is checked (``check_record``) before any compile uses it."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def get(self, key: str) -> dict[str, Any] | None:
        artifact = self.store.get(key)
        if artifact is None:
            return None
        try:
            return check_record(artifact.manifest.get("choice"))
        except ValueError as e:
            log.warning("kiln: choice %s in the store is malformed (%s); tuning again", key, e)
            return None

    def put(self, key: str, record: dict[str, Any]) -> None:
        blob = json.dumps(record, sort_keys=True).encode()
        self.store.publish(Artifact(key, {"kind": "gemm_choice", "choice": record},
                                    {"choice.json": blob}))


def pending_problems(compiled: CompiledGraph) -> dict[str, GemmProblem]:
    pending = compiled.stats.get("gemm_pending") or {}
    return {key: GemmProblem.from_dict(p) for key, p in sorted(pending.items())}


def by_rule(pending: dict[str, GemmProblem], target: dict[str, Any]
            ) -> tuple[dict[str, dict[str, Any]], dict[str, GemmProblem]]:
    """(choices decided without a benchmark: ``library_only`` problems, the rest)."""
    ruled = {key: library_record() for key, p in pending.items() if library_only(p, target)}
    return ruled, {key: p for key, p in pending.items() if key not in ruled}


def first_pass_as_chosen(compiled: CompiledGraph, pending: dict[str, GemmProblem],
                         chosen: dict[str, dict[str, Any]], stats: dict[str, int]
                         ) -> CompiledGraph | None:
    """The first pass itself where every choice is the library call (ruled, cached or
    timed): it lowered each pending problem to the library call already, so it is the
    graph a second pass with these choices would make; only its record of the choices
    changes. None where a template won: the graph is lowered again."""
    if any(record.get("kind") != EXTERN for record in chosen.values()):
        return None
    compiled.stats["gemm_choices"] = dict(sorted(
        {**(compiled.stats.get("gemm_choices") or {}),
         **{key: {"problem": pending[key].to_dict(), **record}
            for key, record in chosen.items()}}.items()))
    compiled.stats["gemm_pending"] = {}
    return with_choices(compiled, stats)


def split_known(pending: dict[str, GemmProblem], cache: ChoiceCache
                ) -> tuple[dict[str, dict[str, Any]], dict[str, GemmProblem]]:
    """(choices the cache has, problems still to benchmark)."""
    known: dict[str, dict[str, Any]] = {}
    todo: dict[str, GemmProblem] = {}
    for key, problem in pending.items():
        record = cache.get(key)
        if record is None:
            todo[key] = problem
        else:
            known[key] = record
    return known, todo


def template_jobs(key: str, problem: GemmProblem, target: dict[str, Any]
                  ) -> list[tuple[Candidate, KernelJob | None]]:
    """Every candidate of ``problem``: the extern call (nothing to compile), then one
    kernel job per template config."""
    from kiln.compiler.codegen.triton.templates import standalone_spec

    out: list[tuple[Candidate, KernelJob | None]] = []
    for i, cand in enumerate(candidates(problem, target)):
        if cand.kind == EXTERN:
            out.append((cand, None))
            continue
        assert cand.config is not None
        spec = standalone_spec(problem, cand.config, f"triton_tem_mm_{key[7:19]}_{i}")
        out.append((cand, KernelJob(spec, cand.config, target)))
    return out


def untuned_record() -> dict[str, Any]:
    """Where no GPU can measure: the heuristic (the library call), not cached."""
    return {"kind": EXTERN, "timings": [], "untuned": True}


def selection_stats(known: dict[str, Any], todo: dict[str, Any], tuned: bool
                    ) -> dict[str, int]:
    return {"problems": len(known) + len(todo), "cached": len(known),
            "benchmarked": len(todo) if tuned else 0, "untuned": 0 if tuned else len(todo)}


def decide(problem: GemmProblem, cands: list[Candidate], timings: dict[str, Any]
           ) -> dict[str, Any]:
    """The record for ``problem`` from a benchmark's answer (``workers.autotune``)."""
    ms = [float(timings["extern_ms"])] + [float(t) for t in timings["template_ms"]]
    return pick_winner(problem, list(zip(cands, ms)), float(timings.get("round_trip_ms", 0)))


def with_choices(compiled: CompiledGraph, stats: dict[str, int]) -> CompiledGraph:
    compiled.stats["gemm_selection"] = stats
    return compiled


def select_inprocess(request_bytes: bytes, key: str, compiled: CompiledGraph,
                     target: dict[str, Any], compile_job: Any, choices: ChoiceCache,
                     extra_options: dict[str, Any] | None = None, autotune: bool = True
                     ) -> CompiledGraph:
    """The selection in this process: cached choices, else every candidate of every
    problem compiled at once (``kernel_threads`` threads) and each problem timed here
    where this process has a GPU of the target's arch (and autotuning is not off)."""
    import time

    from .autotune import benchmark_gemm, fake_autotune, gpu_arch
    from .pipeline import compile_sources

    pending = pending_problems(compiled)
    if not pending:
        return compiled
    start = time.perf_counter()
    ruled, rest = by_rule(pending, target)
    known, todo = split_known(rest, choices)
    can_time = autotune and (fake_autotune() or gpu_arch() == int(target.get("arch", -1)))
    new: dict[str, dict[str, Any]] = {}
    if can_time:
        jobs = {choice: template_jobs(choice, problem, target)
                for choice, problem in todo.items()}
        binaries = _compile_all([job for js in jobs.values() for _, job in js
                                 if job is not None], compile_job)
        for choice, problem in todo.items():
            kernel_jobs = [job for _, job in jobs[choice] if job is not None]
            with trace.span("gemm benchmark", cat="autotune", gpu="local",
                            problem=choice[7:23], candidates=1 + len(kernel_jobs)):
                timings = benchmark_gemm(problem, [j.spec for j in kernel_jobs],
                                         [binaries[id(j)] for j in kernel_jobs])
            new[choice] = decide(problem, [c for c, _ in jobs[choice]], timings)
            log.info("kiln: GEMM choice %s", describe_choice(problem, new[choice]))
            choices.put(choice, new[choice])
    else:
        new = {choice: untuned_record() for choice in todo}
    chosen, stats = {**ruled, **known, **new}, selection_stats(known, todo, can_time)
    result = first_pass_as_chosen(compiled, pending, chosen, stats)
    if result is None:
        options = {**(extra_options or {}), "gemm_choices": chosen}
        result = with_choices(compile_sources(request_bytes, key, extra_options=options), stats)
    result.timings["gemm_selection"] = time.perf_counter() - start
    return result


def _compile_all(jobs: list[KernelJob], compile_job: Any) -> dict[int, Any]:
    """Each job's binary (None where it failed), by ``id(job)``: one pool for all the
    graph's template configs, so the CPUs stay busy across problems."""
    from concurrent.futures import ThreadPoolExecutor

    from .pipeline import kernel_threads

    if not jobs:
        return {}
    with ThreadPoolExecutor(min(kernel_threads(), len(jobs))) as pool:
        binaries = list(pool.map(lambda job: _try_compile(compile_job, job), jobs))
    return {id(job): binary for job, binary in zip(jobs, binaries)}


def _try_compile(compile_job: Any, job: KernelJob) -> Any:
    """A config's binary, or None where it does not compile (it is then never chosen)."""
    try:
        return compile_job(job)
    except Exception as e:
        log.warning("kiln: GEMM template %s config %s did not compile: %s", job.spec.name,
                    job.config, e)
        return None
