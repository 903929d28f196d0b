"""Autotuning per size bucket, for kernels of graphs with dynamic shapes.

A loaded graph reports each (kernel, bucket) it launches with no tuned config yet
(``compiler.runtime.buckets``), with the launch's sizes: its integer size arguments and
the byte extent of each tensor argument. ``tune_buckets`` compiles the kernel's candidate
configs (the kernel cache shares binaries across buckets), times each on scratch buffers
of those sizes on this process's GPU (``workers.autotune.benchmark``) and returns a copy
of the graph with the fastest config (and binary) recorded for the bucket; the artifact
keeps them (``CompiledGraph.buckets``), so a later process starts tuned.

Under Triton's interpreter (CPU, tests only) kernels have no binaries: with the tests'
fake benchmark, the chosen configs still run for real.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from kiln.compiler import trace
from kiln.compiler.codegen.kernel_spec import KernelSpec
from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.kernel_compile import KernelBinary
from kiln.compiler.request import CompileRequest
from kiln.compiler.runtime.buckets import aligned_sizes, generic_config

from . import foreground
from .pipeline import KernelCache, KernelJob, candidate_configs, fastest, needs_binary

if TYPE_CHECKING:
    from .artifact import StoredRequest

# (kernel, bucket) -> (byte extent of each tensor argument, integer size arguments)
Seen = dict[tuple[str, str], tuple[list[int], list[int]]]


def can_tune_buckets(request: CompileRequest | StoredRequest) -> bool:
    """Whether this process can tune a request's buckets: autotuning asked, and a GPU of
    its arch (or the tests' fake benchmark, which also serves the interpreter)."""
    from .autotune import fake_autotune
    from .pipeline import local_autotune

    if not request.options.get("autotune", True):
        return False
    return fake_autotune() or local_autotune(request)


def tune_buckets(graph: CompiledGraph, target: dict[str, Any], seen: Seen,
                 cache: KernelCache | None = None) -> CompiledGraph:
    """A copy of ``graph`` with a timed config for each (kernel, bucket) of ``seen``; the
    compiles and benchmarks share the program's GPU and GIL (``workers.gpu_share``)."""
    from . import gpu_share

    share = gpu_share.local_share()
    with share.tuning():
        return _tune_buckets(graph, target, seen, cache or KernelCache(), share)


def _tune_buckets(graph: CompiledGraph, target: dict[str, Any], seen: Seen,
                  cache: KernelCache, share: Any) -> CompiledGraph:
    from .autotune import benchmark

    out = CompiledGraph.from_dict(graph.to_dict())
    specs = {spec.name: spec for spec in out.kernels}
    todo = [(name, bucket) for name, bucket in seen if name in specs]
    jobs = {item: [KernelJob(specs[item[0]], c, target)
                   for c in bucket_candidates(specs[item[0]], seen[item][1])]
            for item in todo}
    binaries = _compile(jobs, target, cache)
    start = time.perf_counter()
    for (name, bucket), group in jobs.items():
        nbytes, sizes = seen[(name, bucket)]
        candidates = [binaries.get(j.key) or KernelBinary(name, target, j.config)
                      for j in group]
        foreground.check_stopped()  # exit: not into another benchmark
        with trace.span("bucket autotune benchmark", cat="autotune", kernel=name,
                        bucket=bucket, candidates=len(group), gpu=share.stats.gpu):
            timings = benchmark(specs[name], candidates, sizes, nbytes, pacer=share)
        if not any(math.isfinite(t) for t in timings):
            continue  # no candidate ran at this size: the heuristic config stays
        best, record = fastest(group, timings, candidates)
        out.buckets.setdefault(name, {})[bucket] = dict(best.config)
        if best.binary:
            out.bucket_binaries.setdefault(name, {})[bucket] = best
        out.stats.setdefault("bucket_autotune", {}).setdefault(name, {})[bucket] = record
    out.timings["bucket_autotune"] = time.perf_counter() - start
    return out


def bucket_candidates(spec: KernelSpec, sizes: list[int]) -> list[dict[str, Any]]:
    """A bucket's candidate configs: the ``ALIGN`` variants (vectorized loads) where the
    sizes seen in that bucket allow them, else the generic ones."""
    configs = candidate_configs(spec, True, bucket=True)
    if aligned_sizes(spec, sizes):
        return configs
    plain = [generic_config(c) or c for c in configs]
    return [c for i, c in enumerate(plain) if c not in plain[:i]]


def _compile(jobs: dict[tuple[str, str], list[KernelJob]], target: dict[str, Any],
             cache: KernelCache) -> dict[str, KernelBinary]:
    """Every candidate that the target needs a binary for, compiled side by side."""
    flat = list({j.key: j for group in jobs.values() for j in group
                 if needs_binary(j.spec, target)}.values())
    return dict(zip((j.key for j in flat), cache.compile_all(flat)))
