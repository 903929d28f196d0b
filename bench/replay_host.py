"""Host time per call of a ``mode="reduce-overhead"`` graph whose inputs have a recording,
on a machine with no GPU: what Kiln runs between Dynamo's call and the CUDA graph's
replay, against Dynamo's floor.

    python3 bench/replay_host.py [--calls 40000] [--shape 64x128] [--profile]

gpu_bench's seed function ``((a + b) * c.relu()).sum(-1)`` on CPU tensors, compiled with
``backend="kiln", mode="reduce-overhead"`` and called on four input sets in turn (refilled
in place, as gpu_bench does), with what needs a GPU stood in (``tests.cudagraph_stand_in``):
a capture runs the wrapper on clones, a replay recomputes the outputs in place. Outputs are
checked against eager on fresh values with those replays; then each recording's replay
becomes a no-op C call (a real replay is a C call of about 5 µs of host time on the H200
host, the same for every caller: not counted here). Rows:

- Dynamo floor: a backend whose graph returns outputs made once (``gpu_timing``);
- kiln: the CUDA-graph runner as a graph loaded from the store gets it;
- kiln, tunable: the runner behind a ``SwappableGraph`` (``frontend.core.hotswap``), as a graph
  this process compiled while its autotuning is pending gets it: gpu_bench's case.

Columns: CPU µs per call (this thread's CPU time, the best of 40 blocks, the rows' blocks
interleaved; ``bench/wrapper_host.host_us``), µs above the floor, Python frames per call
and the names of Kiln's. Not a GPU measure: the H200 figures come from
``bench/gpu_bench.py --only "seed 64x128 fp32 reduce-overhead"``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import tempfile
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SETS = 4
BLOCKS = 40  # (the best block of each row: a shared machine disturbs some of them)


def seed(a: Any, b: Any, c: Any) -> Any:
    return ((a + b) * c.relu()).sum(-1)


def _copy_of_seed() -> Any:
    """``seed`` with a code object of its own: a Dynamo cache (and a graph) per row."""
    return types.FunctionType(seed.__code__.replace(), seed.__globals__, "seed", None,
                              seed.__closure__)


def compiled_rows(sets: list[list[Any]]) -> dict[str, Callable[..., Any]]:
    """The rows' functions, each compiled and past its recordings, outputs checked."""
    import torch
    from gpu_timing import floor_compiled

    from kiln import KilnFallbackWarning
    from kiln.compiler.runtime import cudagraphs
    from kiln.frontend.core import hotswap
    from tests.cudagraph_stand_in import cpu_capture

    cudagraphs.skip_reason = lambda device_type, inputs: None  # CPU graphs get runners
    cudagraphs.CudaGraphRunner._capture = cpu_capture  # type: ignore[method-assign]
    real_wants_swap = hotswap.wants_swap
    rows = {"Dynamo floor": floor_compiled(_copy_of_seed(), sets[0])}
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        for name, swap in (("kiln", False), ("kiln, tunable", True)):
            hotswap.wants_swap = (lambda *args: True) if swap else real_wants_swap
            fn = torch.compile(_copy_of_seed(), backend="kiln", mode="reduce-overhead",
                               dynamic=False)
            for i in range(4 * SETS):
                args = sets[i % SETS]
                for a in args:
                    a.copy_(torch.randn_like(a))
                torch.testing.assert_close(fn(*args), seed(*args), rtol=1e-5, atol=1e-5)
            rows[name] = fn
    hotswap.wants_swap = real_wants_swap
    return rows


def replays_as_no_ops() -> int:
    """Every recording's replay becomes a no-op C call; how many recordings there are."""
    from kiln.compiler.runtime.cudagraphs import CudaGraphRunner

    recordings = [rec for o in gc.get_objects() if type(o) is CudaGraphRunner
                  for rec in o.direct.values()]
    for rec in recordings:
        rec.launch = tuple  # type: ignore[assignment]
    return len(recordings)


def frames_per_call(fn: Callable[..., Any], sets: list[list[Any]], calls: int = 40
                    ) -> tuple[float, list[str]]:
    """Python frames per call of ``fn`` and the names of those in Kiln's folders."""
    ours = tuple(str(ROOT / d) + os.sep for d in ("compiler", "frontend", "workers"))
    codes: list[Any] = []

    def note(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            codes.append(frame.f_code)

    collecting = gc.isenabled()
    gc.disable()
    sys.setprofile(note)
    try:
        for i in range(calls):
            fn(*sets[i % SETS])
    finally:
        sys.setprofile(None)
        if collecting:
            gc.enable()
    names = sorted({c.co_name for c in codes if c.co_filename.startswith(ours)})
    return len(codes) / calls, names


def _boxed(fn: Callable[..., Any]) -> Callable[[list[Any]], Any]:
    """``fn`` called as ``host_us`` calls (one list): the same frame for every row."""
    return lambda args: fn(*args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40000)
    parser.add_argument("--shape", default="64x128")
    parser.add_argument("--profile", action="store_true",
                        help="the functions with the most own time in the tunable row")
    ns = parser.parse_args()
    os.environ.setdefault("KILN_CACHE_DIR", tempfile.mkdtemp())
    os.environ.setdefault("KILN_FARM", "inprocess")
    import torch
    from wrapper_host import host_us

    shape = [int(n) for n in ns.shape.split("x")]
    sets = [[torch.randn(shape) for _ in range(3)] for _ in range(SETS)]
    rows = compiled_rows(sets)
    recordings = replays_as_no_ops()
    timed = [(_boxed(fn), list(sets[0])) for fn in rows.values()]
    us = dict(zip(rows, host_us(timed, max(ns.calls // BLOCKS, 1), BLOCKS)))
    print(f"| seed {ns.shape} fp32 reduce-overhead, replay a no-op ({recordings} "
          "recordings) | host µs per call | above the floor | frames per call | Kiln's |")
    print("|---|---|---|---|---|")
    for name, fn in rows.items():
        frames, ours = frames_per_call(fn, sets)
        print(f"| {name} | {us[name]:.2f} | {us[name] - us['Dynamo floor']:+.2f} | "
              f"{frames:.0f} | {', '.join(ours) or '-'} |", flush=True)
    if ns.profile:
        prof = cProfile.Profile()
        tunable = rows["kiln, tunable"]
        prof.enable()
        for i in range(2000):
            tunable(*sets[i % SETS])
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
