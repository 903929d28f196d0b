"""How ``bench/gpu_bench.py`` times a call: CUDA events around each call, the sides of a
row (eager, Inductor, Kiln, ...) timed in alternating blocks, and a Dynamo floor for rows
that measure per-call overhead.

A host whose speed drifts during a run (another process, clocks, the allocator's state)
moves whichever side it happens to be timing. ``time_interleaved`` times ``blocks``
blocks of every side in turn (eager, Inductor, Kiln, eager, Inductor, Kiln, ...), each
block after two untimed calls, and reports the median of all of a side's calls: a drift
lands on every side alike.

``floor_backend`` is a ``torch.compile`` backend that does no work: it runs the graph
once at compile time and every call returns those outputs. Dynamo's guards, its frame
evaluation and the call into a backend are all that is left, so its time per call is the
lowest any backend can reach under Dynamo (a row's "Dynamo floor").

``sdpa_priority()`` (a diagnostic): ``BENCH_SDPA_PRIORITY=efficient,flash,cudnn,math``
runs the whole bench under that attention-backend priority (``sdpa_kernel(...,
set_priority=True)``) for eager, Inductor and Kiln alike: how much of a row is the
backend the dispatcher picks (cuDNN attention first on sm_90 with torch 2.11).
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

# ms of one call of fn(*args), however the caller measures it (CUDA events on the GPU).
Timer = Callable[[Callable[..., Any], list[Any]], float]


def cuda_event_ms(fn: Callable[..., Any], args: list[Any]) -> float:
    """One call between two CUDA events, waited for."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn(*args)
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


def time_fn(fn: Callable[..., Any], input_sets: list[list[Any]], reps: int,
            timer: Timer = cuda_event_ms) -> float:
    """Median ms per call over ``reps`` timed calls, rotating over the input sets."""
    return time_interleaved({"fn": fn}, input_sets, reps, blocks=1, timer=timer)["fn"]


def time_interleaved(fns: dict[str, Callable[..., Any]], input_sets: list[list[Any]],
                     reps: int, blocks: int = 4, timer: Timer = cuda_event_ms,
                     warmup: int = 5) -> dict[str, float]:
    """Median ms per call of each of ``fns``: ``blocks`` blocks of ``reps / blocks``
    calls (at least one) per function, the functions' blocks alternating, each block
    after two untimed calls (a CUDA-graph tree switching functions settles there); the
    calls rotate over ``input_sets``."""
    for fn in fns.values():
        for i in range(warmup):
            fn(*input_sets[i % len(input_sets)])
    per_block = max(1, -(-reps // blocks))
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(blocks):
        for name, fn in fns.items():
            for i in range(2):
                fn(*input_sets[i % len(input_sets)])
            for i in range(per_block):
                times[name].append(timer(fn, input_sets[i % len(input_sets)]))
    return {name: statistics.median(t) for name, t in times.items()}


def floor_backend(gm: Any, example_inputs: Sequence[Any]) -> Callable[..., Any]:
    """A backend that returns the graph's outputs computed once, here (see the module
    docstring): what is left per call is Dynamo's."""
    ready = gm(*example_inputs)

    def floor(*args: Any) -> Any:
        return ready

    return floor


def floor_compiled(fn: Callable[..., Any], args: list[Any]) -> Callable[..., Any]:
    """``fn`` under Dynamo with ``floor_backend``, compiled by a first call on ``args``."""
    import torch

    compiled = torch.compile(fn, backend=floor_backend, dynamic=False)
    compiled(*args)
    return compiled


def sdpa_priority() -> contextlib.AbstractContextManager[Any]:
    """The attention-backend priority of ``BENCH_SDPA_PRIORITY`` (see the module
    docstring), or no change when it is unset."""
    names = [n.strip() for n in os.environ.get("BENCH_SDPA_PRIORITY", "").split(",")
             if n.strip()]
    if not names:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    known = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"BENCH_SDPA_PRIORITY: unknown backends {unknown}; known: "
                         f"{sorted(known)}")
    return sdpa_kernel([known[n] for n in names], set_priority=True)
