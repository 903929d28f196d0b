"""Autotuning on a real GPU: compile each candidate config of a kernel, launch it alone
on scratch buffers of the right sizes, and keep the fastest.

Scratch inputs: floats are random normal values; integers and booleans are zeros, so an
index read from them is always in bounds.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .codegen.kernel_spec import KernelSpec
from .compiled_graph import CompiledGraph
from .kernel_compile import KernelBinary, compile_kernel

log = logging.getLogger("kiln.autotune")

_TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                 "fp64": torch.float64, "i64": torch.int64, "i32": torch.int32,
                 "i16": torch.int16, "i8": torch.int8, "u8": torch.uint8, "i1": torch.bool}


def scratch_args(spec: KernelSpec, device: torch.device,
                 arg_bytes: tuple[int, ...] | None = None) -> list[torch.Tensor]:
    """One buffer per pointer argument, as large as the graph's buffer was (or as
    ``arg_bytes`` says: a launch of a kernel with dynamic sizes)."""
    args = []
    pointer_types = [t for t in spec.signature.values() if t.startswith("*")]
    for sig, nbytes in zip(pointer_types, arg_bytes or spec.arg_bytes):
        dtype = _TORCH_DTYPES[sig[1:]]
        numel = max(1, nbytes // dtype.itemsize)
        if dtype.is_floating_point:
            args.append(torch.randn(numel, device=device, dtype=dtype))
        else:
            args.append(torch.zeros(numel, device=device, dtype=dtype))
    return args


def time_launch(run: Any, args: list[torch.Tensor], reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of one launch, timed with CUDA events."""
    for _ in range(warmup):
        run(*args)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


# Kernels smaller than this run in microseconds whatever their config: not tuned.
MIN_TUNED_ELEMENTS = 2**16
MAX_CANDIDATES = 4


def candidates(spec: KernelSpec) -> list[dict[str, Any]]:
    # A kernel of a graph with dynamic shapes (size arguments) is tuned per size bucket,
    # at the sizes a process sees (workers.buckets), not here.
    if spec.xnumel * spec.rnumel < MIN_TUNED_ELEMENTS or not spec.arg_bytes or spec.size_args:
        return [dict(spec.configs[0])]
    return [dict(c) for c in spec.configs[:MAX_CANDIDATES]]


def compile_candidates(specs: list[KernelSpec], target: dict[str, Any]
                       ) -> dict[str, list[KernelBinary]]:
    """Every candidate of every kernel compiled in one pool of threads (Triton's passes
    release the GIL), so a graph's kernels compile side by side."""
    jobs = [(spec, cfg) for spec in specs for cfg in candidates(spec)]
    workers = max(1, min(len(jobs), os.cpu_count() or 1, 16))
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(lambda job: compile_kernel(job[0], job[1], target), jobs))
    out: dict[str, list[KernelBinary]] = {}
    for (spec, _), binary in zip(jobs, results):
        out.setdefault(spec.name, []).append(binary)
    return out


def compile_configs(spec: KernelSpec, target: dict[str, Any]) -> list[KernelBinary]:
    return compile_candidates([spec], target)[spec.name]


def autotune_kernel(spec: KernelSpec, target: dict[str, Any], device: torch.device,
                    binaries: list[KernelBinary] | None = None
                    ) -> tuple[KernelBinary, list[tuple[dict[str, Any], float]]]:
    """The fastest config's binary, and each config's median time."""
    binaries = binaries or compile_configs(spec, target)
    if len(binaries) == 1 or len(spec.arg_bytes) == 0:
        return binaries[0], []
    timings = time_candidates(spec, binaries, device)
    results = [(b.config, ms) for b, ms in zip(binaries, timings) if ms != math.inf]
    if not results:
        return binaries[0], []
    best = min(range(len(binaries)), key=lambda i: timings[i])
    return binaries[best], results


def time_candidates(spec: KernelSpec, binaries: list[KernelBinary], device: torch.device,
                    sizes: Sequence[int] = (), arg_bytes: tuple[int, ...] | None = None,
                    pacer: Any = None) -> list[float]:
    """Median milliseconds of each candidate binary of ``spec`` on scratch arguments
    (``arg_bytes`` where given, then the integer ``sizes`` of a dynamic kernel's bucket);
    infinity where one does not run (resources). Never during a CUDA graph capture of
    this process: the benchmark's allocations and syncs would invalidate it. ``pacer``
    (``workers.gpu_share``): the GPU is shared with a program, and each group of launches
    waits for a turn that the pacer grants (and that holds the capture lock itself)."""
    from .runtime.cudagraphs import GPU_WORK_LOCK

    if pacer is not None:
        return _time_paced(spec, binaries, device, sizes, arg_bytes, pacer)
    with GPU_WORK_LOCK:
        args: list[Any] = [*scratch_args(spec, device, arg_bytes), *sizes]
        return [_time_one(spec, binary, lambda run: time_launch(run, args))
                for binary in binaries]


def _time_one(spec: KernelSpec, binary: KernelBinary, timer: Any) -> float:
    """``timer(launch)`` for one candidate; infinity where it cannot run."""
    from .runtime.triton_launcher import TritonLauncher

    try:
        launcher = TritonLauncher(spec, binary.config, "binary", binary)
        return float(timer(launcher.run))
    except Exception as e:  # a candidate that cannot run is never chosen
        log.warning("kiln autotune: kernel %s config %s failed: %s", spec.name,
                    binary.config, e)
        return math.inf


# Timed launches of one candidate on a shared GPU (fewer than alone: turns are short).
PACED_REPS = 10
# A candidate whose one launch takes this many turn budgets cannot share the GPU with the
# program: it is never chosen (the heuristic config is measured first, and stays).
OVER_BUDGET = 2.0


def _time_paced(spec: KernelSpec, binaries: list[KernelBinary], device: torch.device,
                sizes: Sequence[int], arg_bytes: tuple[int, ...] | None, pacer: Any
                ) -> list[float]:
    with pacer.turn():  # scratch buffers are filled on the turn's stream too
        args: list[Any] = [*scratch_args(spec, device, arg_bytes), *sizes]
    return [_time_one(spec, binary, lambda run: time_sliced(run, args, pacer))
            for binary in binaries]


def time_sliced(run: Any, args: list[Any], pacer: Any, reps: int = PACED_REPS,
                launches: Any = None) -> float:
    """Median milliseconds of one launch, timed in the pacer's turns: as many launches
    per turn as its budget holds (one at first, after a warm-up launch); infinity
    for a launch too long for any turn (``OVER_BUDGET``). ``launches(run, args, n)``:
    the milliseconds of ``n`` launches (CUDA events; a stand-in in tests)."""
    launches = launches or _timed_launches
    times: list[float] = []
    estimate: float | None = None
    first = True
    while len(times) < reps:
        with pacer.turn() as budget:
            if first:  # the warm-up launch (a cubin's load), then one timed launch
                run(*args)
                first = False
            count = reps if not math.isfinite(budget) else (
                1 if estimate is None else int(budget // max(estimate, 1e-3)))
            times.extend(launches(run, args, max(1, min(count, reps - len(times)))))
        estimate = statistics.median(times)
        if estimate > OVER_BUDGET * budget:
            log.debug("kiln autotune: a launch takes %.3f ms, over a turn's %.3f ms",
                      estimate, budget)
            return math.inf
    return statistics.median(times)


def _timed_launches(run: Any, args: list[Any], count: int) -> list[float]:
    events = []
    for _ in range(count):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run(*args)
        end.record()
        events.append((start, end))
    events[-1][1].synchronize()
    return [start.elapsed_time(end) for start, end in events]


def autotune_graph(compiled: CompiledGraph, target: dict[str, Any],
                   device: torch.device | None = None) -> None:
    """Pick each Triton kernel's config by measurement on this machine's GPU."""
    device = device or torch.device("cuda", torch.cuda.current_device())
    specs = [s for s in compiled.kernels if s.backend == "triton"]
    compiled_candidates = compile_candidates(specs, target)
    tunable = timed = 0
    for spec in specs:
        binary, results = autotune_kernel(spec, target, device,
                                          compiled_candidates[spec.name])
        compiled.binaries[spec.name] = binary
        compiled.configs[spec.name] = dict(binary.config)
        compiled.stats.setdefault("autotune", {})[spec.name] = [
            {"config": c, "ms": ms} for c, ms in results]
        if len(compiled_candidates[spec.name]) > 1:
            tunable += 1
            timed += bool(results)
    # Only a graph whose every kernel with candidates was timed counts as autotuned: one
    # of heuristic configs alone (small kernels, configs that failed) must not claim it.
    compiled.autotuned = tunable > 0 and timed == tunable
