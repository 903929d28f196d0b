"""What each way of serving the seed at 64x128 costs per call on a GPU: the
``mode="reduce-overhead"`` row of gpu_bench, taken apart (a diagnostic; needs CUDA).

    python3 bench/seed_launch.py [--calls 2000] [--rounds 2] [--shape 64x128]

gpu_bench's seed function ``((a + b) * c.relu()).sum(-1)`` (one Kiln kernel), called on
four input sets in turn as gpu_bench does. Rows:

- eager; Dynamo floor (a backend returning ready outputs, ``gpu_timing.floor_backend``);
- kiln plain (no CUDA graphs); kiln replay (reduce-overhead with the one-launch path
  off: each call replays a CUDA graph); kiln one launch (reduce-overhead as it ships:
  the graph's one kernel launched directly, ``compiler.runtime.one_launch``);
- no Dynamo: a bare ``CUDAGraph.replay()`` of a graph holding Kiln's kernel (one graph;
  and one graph per input set, replayed in turn, as kiln replay does), a bare launch of
  that kernel through torch's static launcher (arguments built once: addresses, as the
  one-launch path passes them, and tensors, as Kiln's wrappers pass them), one
  eager ``torch.sum`` and an empty Python function.

Columns, µs per call: ``events`` (gpu_bench's way: CUDA events around each call, the
median), ``back to back`` (calls in a row, one synchronize at the end) and ``host`` (the
median of the host time of one call, nothing waited for). Outputs are checked against
eager first; a ``KilnFallbackWarning`` fails the run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import types
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SETS = 4


def seed(a: Any, b: Any, c: Any) -> Any:
    return ((a + b) * c.relu()).sum(-1)


def _copy_of_seed() -> Any:
    """``seed`` with a code object of its own: a Dynamo cache (and a graph) per row."""
    return types.FunctionType(seed.__code__.replace(), seed.__globals__, "seed", None,
                              seed.__closure__)


def _kiln(sets: list[list[Any]], mode: str | None, one_launch: bool = True) -> Any:
    """The seed under Kiln, past its warm-up and recordings, outputs checked."""
    import torch

    from kiln.compiler.runtime import cudagraphs
    from kiln.frontend.client import wait_for_background

    real = cudagraphs.watched_call
    if not one_launch:  # every recording replays: no call is served by a launch
        cudagraphs.watched_call = lambda call, inputs: (call(list(inputs)), "off")
    try:
        fn = torch.compile(_copy_of_seed(), backend="kiln", mode=mode, dynamic=False)
        fn(*sets[0])
        wait_for_background(60)  # (the tuned kernels swapped in before any recording)
        for i in range(4 * SETS):
            args = sets[i % SETS]
            torch.testing.assert_close(fn(*args), seed(*args), rtol=1e-5, atol=1e-5)
    finally:
        cudagraphs.watched_call = real
    return fn


def one_launch_or_why() -> Any:
    """The OneLaunch of the reduce-overhead row's runner, or why its recordings have
    none (their reasons)."""
    import gc

    from kiln.compiler.runtime.cudagraphs import CudaGraphRunner

    runners = [o for o in gc.get_objects() if type(o) is CudaGraphRunner]
    found = [o.one_launch for o in runners if o.one_launch is not None]
    if found:
        return found[0]
    return "; ".join(sorted({str(rec.one) for o in runners for rec in (
        *o.direct.values(), *([o.recording] if o.recording else []))}))


def bare_rows(sets: list[list[Any]], one: Any) -> dict[str, Callable[..., Any]]:
    """The rows with no Dynamo: Kiln's kernel (``one``: its OneLaunch) replayed in a
    bare CUDA graph and launched bare, one eager kernel, nothing."""
    import torch


    def arguments(inputs: list[Any]) -> tuple[Any, ...]:
        return one.arguments(tuple(inputs), tuple(x.data_ptr() for x in inputs))

    args = arguments(sets[0])
    graphs = {}  # one graph per input set, keyed by its first input's address
    for inputs in sets:
        graphs[inputs[0].data_ptr()] = graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            one.launch(arguments(inputs), one.stream())
    graph = graphs[sets[0][0].data_ptr()]
    replay = torch._C._CUDAGraph.replay
    launch, stream, outputs = one.launch, one.stream, one.outputs
    out1 = torch.empty(sets[0][0].shape[0], device="cuda")

    def bare_graph_replay(*a: Any) -> Any:
        replay(graph)
        return outputs

    def bare_graph_replay_4(*a: Any) -> Any:  # (what replays per address set do)
        replay(graphs[a[0].data_ptr()])
        return outputs

    def bare_static_launch(*a: Any) -> Any:
        launch(args, stream())
        return outputs

    tensor_of = {x.data_ptr(): x for x in (*sets[0], *one.keep)}
    tensor_args = tuple(tensor_of.get(x, x) if isinstance(x, int) else x for x in args)

    def bare_static_launch_tensors(*a: Any) -> Any:  # (what Kiln's wrappers pass)
        launch(tensor_args, stream())
        return outputs

    def one_torch_sum(*a: Any) -> Any:
        return torch.sum(a[0], dim=-1, out=out1)

    def nothing(*a: Any) -> Any:
        return outputs

    bare_graph_replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(outputs[0], seed(*sets[0]), rtol=1e-5, atol=1e-5)
    return {"bare CUDAGraph.replay (Kiln's kernel)": bare_graph_replay,
            "bare CUDAGraph.replay, a graph per input set": bare_graph_replay_4,
            "bare static launch (Kiln's kernel), addresses": bare_static_launch,
            "bare static launch (Kiln's kernel), tensors": bare_static_launch_tensors,
            "one torch.sum(out=)": one_torch_sum, "empty Python function": nothing}


def measure(fn: Callable[..., Any], sets: list[list[Any]], calls: int) -> tuple[float, ...]:
    """µs per call: events (median), back to back, host (median)."""
    import torch
    from gpu_timing import cuda_event_ms

    for i in range(20):
        fn(*sets[i % SETS])
    events = statistics.median(1000 * cuda_event_ms(fn, sets[i % SETS]) for i in range(calls))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(calls):
        fn(*sets[i % SETS])
    torch.cuda.synchronize()
    back = 1e6 * (time.perf_counter() - start) / calls
    host = []
    for i in range(calls):
        t = time.perf_counter()
        fn(*sets[i % SETS])
        host.append(time.perf_counter() - t)
        if i % 256 == 255:
            torch.cuda.synchronize()  # (the queue never fills)
    torch.cuda.synchronize()
    return events, back, 1e6 * statistics.median(host)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shape", default="64x128")
    ns = parser.parse_args()
    os.environ.setdefault("KILN_CACHE_DIR", tempfile.mkdtemp())
    os.environ.setdefault("KILN_FARM", "inprocess")
    import torch
    from gpu_timing import floor_compiled

    from kiln import KilnFallbackWarning

    warnings.simplefilter("error", KilnFallbackWarning)
    torch.manual_seed(0)
    shape = [int(n) for n in ns.shape.split("x")]
    sets = [[torch.randn(shape, device="cuda") for _ in range(3)] for _ in range(SETS)]
    rows: dict[str, Callable[..., Any]] = {
        "eager": seed, "Dynamo floor": floor_compiled(_copy_of_seed(), sets[0]),
        "kiln plain": _kiln(sets, None),
        "kiln replay (one launch off)": _kiln(sets, "reduce-overhead", one_launch=False),
        "kiln one launch (reduce-overhead)": _kiln(sets, "reduce-overhead")}
    one = one_launch_or_why()
    if isinstance(one, str):  # (the rows above still say what they cost)
        print(f"# NO ONE LAUNCH: the seed's recordings replay ({one}); no bare rows")
    else:
        rows.update(bare_rows(sets, one))
    for rnd in range(ns.rounds):
        print(f"\nround {rnd + 1} of {ns.rounds}, seed {ns.shape} fp32, µs per call")
        print("| | events | back to back | host | events vs eager |")
        print("|---|---|---|---|---|")
        eager = None
        for name, fn in rows.items():
            events, back, host = measure(fn, sets, ns.calls)
            eager = eager or events
            print(f"| {name} | {events:.2f} | {back:.2f} | {host:.2f} | "
                  f"{events / eager:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
