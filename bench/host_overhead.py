"""Host time per call of small compiled graphs: where the microseconds go between the
user's call and the kernels (Dynamo's frame and guards, AOTAutograd's runtime wrappers,
Kiln's wrapper, the CUDA-graph runner), for Kiln and Inductor, on one device.

    python3 bench/host_overhead.py [--device cuda|cpu] [--calls 2000] [--profile]
                                   [--only seed,block] [--rows "kiln;kiln reduce-overhead"]
                                   [--json OUT]

(``--rows``: the rows below to run, by exact name, separated by ";"; eager and the dynamo
floor always run.)

Rows, each compiled fresh (``dynamic=False``) and called over 4 input sets in turn (as
``bench/gpu_bench.py`` does), except ``same inputs`` (one set every call):

    eager                       the function itself
    dynamo floor                Dynamo with a backend that returns a ready output: the
                                per-call cost no backend can remove
    inductor [reduce-overhead]  stock Inductor
    kiln                        Kiln's default (inference graphs called directly)
    kiln, AOT runtime           Kiln with ``inference_direct=0``: AOTAutograd's wrappers
    kiln reduce-overhead        CUDA graphs (GPU only): 4 address sets, each read in place
    kiln reduce-overhead, copy  the same with ``inference_direct=0`` and one recording that
                                copies its inputs in (``MAX_DIRECT`` = 0: what Kiln did
                                before recordings per address set)
    kiln reduce-overhead, same inputs
    kiln reduce-overhead, no-op replay
                                (CPU only) the same Python path with the CUDA graph stood
                                in for: a recording's replay is one C call that does no
                                work, so the row is the host time of everything between
                                Dynamo's call and ``cudaGraphLaunch`` (asserted to have
                                gone through the replay on every timed call)
    dynamo floor, dynamic=None  the floor compiled with torch.compile's default ``dynamic``
    kiln reduce-overhead, dynamic=None
                                (GPU only) the same for Kiln's reduce-overhead row

Columns: host µs per call (the best of 5 runs of ``--calls``/5 calls, each timed with
perf_counter up to a synchronize: on a host-bound graph this is the wall time per call;
on CPU the calling thread's CPU time, less disturbed by other processes) and, on CUDA,
the median wall µs of one call between CUDA events (``gpu_bench``'s measure).
``dynamic=False`` (as ``gpu_bench`` compiles) makes Dynamo patch its config on every
call (the row "dynamo floor, dynamic=None" shows its cost), and
``torch._dynamo.config.record_runtime_overhead`` (on by default) adds two calls to every
frame: both are in the "dynamo floor" row, for Kiln and Inductor alike.
Every Kiln row is compared with eager first and fails on ``KilnFallbackWarning``.
``--profile`` prints the functions with the most own time in Kiln's default and
reduce-overhead calls.

After the table, one line per workload reads the reduce-overhead row against the floor:
the host µs Kiln's reduce-overhead call adds to Dynamo's (on CUDA also the µs between
events). For a function (the seed), the floor and Kiln's reduce-overhead call are also
timed in alternating blocks (a loaded host slows both alike) and their Python frames and
C calls per call counted (deterministic). On CUDA the line ends with the host µs of one
CUDA-graph launch alone (torch's replay of a one-kernel graph in a loop, no Dynamo, no
Kiln): what is left above the floor once Kiln's Python is gone; in brackets the same
launch through the driver's ``cuGraphLaunch`` called with ctypes (where torch gives the
executable graph's handle): how much of it is torch's binding.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import json
import os
import pstats
import statistics
import sys
import time
import types
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KILN_FARM", "inprocess")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bench import Block, seed_fn  # noqa: E402

SETS = 4
CLOCK = time.perf_counter  # time.thread_time on CPU (see the module docstring)


def workloads(device: str) -> dict[str, tuple[Callable[..., Any], Callable[[], list[Any]]]]:
    cuda = device == "cuda"
    block = Block(1024, 16) if cuda else Block(64, 4)
    block = block.to(device).eval()
    dtype = torch.float16 if cuda else torch.float32
    block = block.to(dtype)
    shape = (8, 512, 1024) if cuda else (2, 16, 64)
    return {
        "seed 64x128 fp32": (seed_fn, lambda: [torch.randn(64, 128, device=device)
                                                for _ in range(3)]),
        f"block {'x'.join(map(str, shape))} {str(dtype)[6:]}":
            (block, lambda: [torch.randn(*shape, device=device, dtype=dtype)]),
    }


def variants(device: str) -> list[tuple[str, dict[str, Any], bool]]:
    """(row, torch.compile kwargs, same inputs every call)."""
    rows: list[tuple[str, dict[str, Any], bool]] = [
        ("dynamo floor", {"backend": "floor"}, False),
        ("dynamo floor, dynamic=None", {"backend": "floor", "dynamic": None}, False),
        ("inductor", {"backend": "inductor"}, False),
        ("kiln", {"backend": "kiln"}, False),
        ("kiln, AOT runtime", {"backend": "kiln", "options": {"inference_direct": False}},
         False)]
    if device == "cuda":
        ro = {"mode": "reduce-overhead"}
        rows += [("inductor reduce-overhead", {"backend": "inductor", **ro}, False),
                 ("kiln reduce-overhead", {"backend": "kiln", **ro}, False),
                 ("kiln reduce-overhead, copy",  # (torch.compile takes mode or options)
                  {"backend": "kiln", "options": {"cudagraphs": True,
                                                  "inference_direct": False}}, False),
                 ("kiln reduce-overhead, same inputs", {"backend": "kiln", **ro}, True),
                 ("kiln reduce-overhead, dynamic=None",
                  {"backend": "kiln", "dynamic": None, **ro}, False)]
    else:
        rows.append((NOOP_REPLAY, {"backend": "kiln", "mode": "reduce-overhead"}, False))
    return rows


NOOP_REPLAY = "kiln reduce-overhead, no-op replay"


class NoopReplay:
    """Kiln's CUDA-graph runner on CPU graphs, with each capture stood in for (while the
    ``with`` block lasts): a recording's replay runs the graph again into the recording's
    outputs (so the row can be checked against eager) until :meth:`noop`, from which on a
    replay is one C call that only notes itself in ``replays``."""

    def __init__(self) -> None:
        self.replays: list[None] = []
        self.recordings: list[Any] = []

    def noop(self) -> None:
        for rec in self.recordings:
            rec.launch = functools.partial(self.replays.append, None)

    def __enter__(self) -> NoopReplay:
        from kiln.compiler.runtime import cudagraphs

        def capture(runner: Any, graph_inputs: list[Any]) -> Any:
            outputs = runner.call([x.clone() for x in graph_inputs])  # runs nothing "now"

            def replay() -> None:
                for out, fresh in zip(outputs, runner.call(list(graph_inputs))):
                    out.copy_(fresh)

            rec = cudagraphs._Recording(types.SimpleNamespace(replay=replay),
                                        list(cudagraphs._pointers(graph_inputs)),
                                        graph_inputs, outputs)
            self.recordings.append(rec)
            return rec

        self._real = cudagraphs.skip_reason, cudagraphs.CudaGraphRunner._capture
        cudagraphs.skip_reason = lambda device_type, inputs: None
        cudagraphs.CudaGraphRunner._capture = capture  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: Any) -> None:
        from kiln.compiler.runtime import cudagraphs

        cudagraphs.skip_reason, cudagraphs.CudaGraphRunner._capture = self._real  # type: ignore[method-assign]


def floor_backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """A backend whose graph costs nothing: it returns the eager outputs of the first call."""
    out: list[Any] = []

    def ready(*args: Any) -> Any:
        if not out:
            out.append(gm(*args))
        return out[0]

    return ready


def compile_variant(fn: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[..., Any]:
    torch._dynamo.reset()
    kwargs = {"dynamic": False, **kwargs}
    if kwargs["backend"] == "floor":
        kwargs["backend"] = floor_backend
    return torch.compile(fn, **kwargs)


def host_us(fn: Callable[..., Any], sets: list[list[Any]], calls: int, sync: Callable[[], None],
            blocks: int = 5) -> float:
    """µs per call: the best of ``blocks`` runs of ``calls // blocks`` calls (the least
    disturbed by other work on the host)."""
    for i in range(20):
        fn(*sets[i % len(sets)])
    sync()
    n = max(calls // blocks, len(sets))
    best = float("inf")
    for _ in range(blocks):
        start = CLOCK()
        for i in range(n):
            fn(*sets[i % len(sets)])
        sync()
        best = min(best, (CLOCK() - start) / n * 1e6)
    return best


def paired_us(fn: Callable[..., Any], rows: dict[str, dict[str, Any]], sets: list[list[Any]],
              calls: int, sync: Callable[[], None], blocks: int = 10) -> dict[str, float]:
    """Host µs per call of ``rows`` (name: torch.compile kwargs) of one function, timed in
    alternating blocks so that a loaded host slows them alike (the best block each). Each
    row compiles its own copy of the function's code (Dynamo keeps a cache per code
    object). Kiln rows are checked against eager first and fail on a fallback to eager or
    to plain launches; a stand-in replay (CPU) is made a no-op after its check."""
    from kiln import KilnFallbackWarning
    from kiln.compiler.runtime.cudagraphs import KilnCudaGraphWarning

    torch._dynamo.reset()
    compiled = {}
    with warnings.catch_warnings(), \
            NoopReplay() if NOOP_REPLAY in rows else contextlib.nullcontext() as stand_in:
        warnings.simplefilter("error", KilnFallbackWarning)
        warnings.simplefilter("error", KilnCudaGraphWarning)  # the replay path or nothing
        for name, kwargs in rows.items():
            copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__)
            compiled[name] = torch.compile(copy, **{"dynamic": False, **kwargs})
            if kwargs["backend"] == "kiln":
                check(name, compiled[name], fn, sets)
            else:
                compiled[name](*sets[0])
        if stand_in is not None:
            stand_in.noop()
        best = {name: float("inf") for name in rows}
        for _ in range(blocks):
            for name, f in compiled.items():
                best[name] = min(best[name], host_us(f, sets, calls // blocks, sync, 1))
        found = {f"{name} (paired)": us for name, us in best.items()}
        for name, f in compiled.items():
            found[f"{name} (python calls)"], found[f"{name} (c calls)"] = calls_per_call(f, sets)
    return found


def calls_per_call(fn: Callable[..., Any], sets: list[list[Any]], n: int = 400
                   ) -> tuple[float, float]:
    """Python frames and C function calls per call (counted, not timed: the same on a
    loaded host)."""
    counts = {"call": 0, "c_call": 0}

    def note(frame: Any, event: str, arg: Any) -> None:
        if event in counts:
            counts[event] += 1

    sys.setprofile(note)
    try:
        for i in range(n):
            fn(*sets[i % len(sets)])
    finally:
        sys.setprofile(None)
    return counts["call"] / n, counts["c_call"] / n


def event_us(fn: Callable[..., Any], sets: list[list[Any]], reps: int = 200) -> float:
    times = []
    for i in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*sets[i % len(sets)])
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def check(name: str, fn: Callable[..., Any], ref: Callable[..., Any], sets: list[list[Any]]
          ) -> None:
    """Kiln's outputs equal eager's on every set (fp32 and fp16 tolerances)."""
    for args in sets * 3:  # past the warm-up and recording calls of CUDA graphs
        got = fn(*args)
        got = got.clone() if isinstance(got, torch.Tensor) else got
        want = ref(*args)
        tol = 1e-3 if want.dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=name)


def profile(fn: Callable[..., Any], sets: list[list[Any]], title: str, top: int = 14) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for i in range(2000):
        fn(*sets[i % len(sets)])
    prof.disable()
    print(f"# {title}: own time per call, top {top}", file=sys.stderr)
    stats = pstats.Stats(prof)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]  # type: ignore[attr-defined]
    for (path, line, func), (_, calls, own, cum, _) in rows:
        print(f"#   {own / 2000 * 1e6:7.2f} us own {cum / 2000 * 1e6:7.2f} us cum "
              f"x{calls / 2000:<4.0f} {os.path.basename(path)}:{line}({func})", file=sys.stderr)


def run(device: str, calls: int, only: list[str], want_profile: bool, wanted: list[str]
        ) -> list[dict[str, Any]]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out = []
    with torch.no_grad():
        for wname, (fn, make) in workloads(device).items():
            if only and not any(o in wname for o in only):
                continue
            sets = [make() for _ in range(SETS)]
            row: dict[str, Any] = {"workload": wname,
                                   "eager": host_us(fn, sets, calls, sync)}
            if device == "cuda":
                row["eager events"] = event_us(fn, sets)
            for vname, kwargs, same in variants(device):
                if wanted and vname not in wanted and vname != "dynamo floor":
                    continue
                profiled = want_profile and vname in ("kiln", "kiln reduce-overhead",
                                                      NOOP_REPLAY)
                row.update(measure(fn, vname, kwargs, sets[:1] if same else sets, calls,
                                   sync, device, f"{wname}: {vname}" if profiled else None))
            if isinstance(fn, types.FunctionType):
                ro = "kiln reduce-overhead" if device == "cuda" else NOOP_REPLAY
                row.update(paired_us(fn, {"dynamo floor": {"backend": floor_backend},
                                          ro: {"backend": "kiln", "mode": "reduce-overhead"}},
                                     sets, calls, sync))
            if device == "cuda":
                row.update(graph_launch_us(calls))
            out.append(row)
            print(json.dumps(row), file=sys.stderr)
    return out


def measure(fn: Callable[..., Any], vname: str, kwargs: dict[str, Any], sets: list[list[Any]],
            calls: int, sync: Callable[[], None], device: str, profile_title: str | None
            ) -> dict[str, float]:
    """One row's host µs per call (and µs between events on CUDA), after its check;
    its profile when given a title."""
    from kiln import KilnFallbackWarning
    from kiln.compiler.runtime import cudagraphs

    direct = cudagraphs.MAX_DIRECT
    cudagraphs.MAX_DIRECT = 0 if vname.endswith(", copy") else direct
    found: dict[str, float] = {}
    try:
        with warnings.catch_warnings(), NoopReplay() if vname == NOOP_REPLAY else \
                contextlib.nullcontext() as stand_in:
            warnings.simplefilter("error", KilnFallbackWarning)
            compiled = compile_variant(fn, kwargs)
            if not vname.startswith("dynamo floor"):
                check(vname, compiled, fn, sets)
            if stand_in is not None:
                stand_in.noop()
                before = len(stand_in.replays)
            found[vname] = host_us(compiled, sets, calls, sync)
            if stand_in is not None:
                timed = 20 + 5 * max(calls // 5, len(sets))  # (host_us's calls)
                if len(stand_in.replays) - before != timed:
                    raise RuntimeError(f"{vname}: {len(stand_in.replays) - before} replays "
                                       f"in {timed} calls: the row did not time the replay")
            if device == "cuda":
                found[f"{vname} events"] = event_us(compiled, sets)
            if profile_title is not None:
                profile(compiled, sets, profile_title)
    finally:
        cudagraphs.MAX_DIRECT = direct
    return found


def graph_launch_us(calls: int) -> dict[str, float]:
    """Host µs of one CUDA-graph launch of a one-kernel graph, in a loop (no Dynamo, no
    Kiln): through torch's C++ replay, as Kiln's runner calls it, and (where torch gives
    the executable graph's handle) through the driver's ``cuGraphLaunch`` called with
    ctypes, which skips torch's binding (its GIL release, device guard and checks). Each
    checks that every launch ran."""
    from kiln.compiler.runtime.cudagraphs import _Recording, first_replay

    x = torch.zeros(64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x.add_(1)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    rec = _Recording(graph, [], [], None)
    first_replay(rec)  # (falls back to the Python method where torch's binding refuses)
    found = {"graph launch alone": _counted_launches(rec.launch, x, calls)}
    try:
        found["graph launch via cuGraphLaunch"] = _counted_launches(
            _driver_launch(graph), x, calls)
    except Exception as e:  # a diagnostic: its absence is reported, never fatal
        print(f"# cuGraphLaunch through ctypes not measured: {type(e).__name__}: {e}",
              file=sys.stderr)
    return found


def _counted_launches(launch: Callable[[], Any], x: torch.Tensor, calls: int) -> float:
    before = x[0].item()
    us = host_us(launch, [[]], calls, torch.cuda.synchronize)
    launches = 20 + 5 * max(calls // 5, 1)  # (host_us's calls)
    if x[0].item() - before != launches:
        raise RuntimeError(f"graph launch: {x[0].item() - before:.0f} of {launches} ran")
    return us


def _driver_launch(graph: Any) -> Callable[[], Any]:
    """``cuGraphLaunch(graph's executable, current stream)`` as one ctypes call."""
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuGraphLaunch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.cuGraphLaunch.restype = ctypes.c_int
    exec_handle = graph.raw_cuda_graph_exec()
    stream = torch.cuda.current_stream().cuda_stream
    if lib.cuGraphLaunch(exec_handle, stream) != 0:
        raise RuntimeError("cuGraphLaunch returned an error")
    return functools.partial(lib.cuGraphLaunch, exec_handle, stream)


def summary(rows: list[dict[str, Any]]) -> list[str]:
    """Per workload: what Kiln's reduce-overhead call adds to Dynamo's floor."""
    lines = []
    for r in rows:
        for ro in ("kiln reduce-overhead", NOOP_REPLAY):
            if ro not in r:
                continue
            line = (f"{r['workload']}: {ro} - dynamo floor = "
                    f"{r[ro] - r['dynamo floor']:.1f} us host")
            events = r.get(f"{ro} events")
            if events is not None:
                line += (f", {events - r['dynamo floor events']:.1f} us between events; "
                         f"between events: eager {r['eager events']:.1f} us, {ro} "
                         f"{events:.1f} ({events / r['eager events']:.2f}x eager)")
            if f"{ro} (paired)" in r:
                line += (f"; timed in alternating blocks: {r[f'{ro} (paired)']:.1f} against "
                         f"{r['dynamo floor (paired)']:.1f} "
                         f"({r[f'{ro} (paired)'] - r['dynamo floor (paired)']:+.1f}); "
                         f"Python frames per call {r[f'{ro} (python calls)']:.0f} against "
                         f"{r['dynamo floor (python calls)']:.0f}, C calls "
                         f"{r[f'{ro} (c calls)']:.0f} against {r['dynamo floor (c calls)']:.0f}")
            if "graph launch alone" in r:
                line += f"; one CUDA-graph launch alone {r['graph launch alone']:.1f} us host"
            if "graph launch via cuGraphLaunch" in r:
                line += (f" ({r['graph launch via cuGraphLaunch']:.1f} through ctypes' "
                         "cuGraphLaunch)")
            lines.append(line)
    return lines


def print_table(rows: list[dict[str, Any]]) -> None:
    names = [k for k in rows[0] if k != "workload" and not k.endswith(" events")
             and not k.endswith(("(paired)", "calls)")) and not k.startswith("graph launch")]
    print("| workload | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for r in rows:
        cells = []
        for n in names:
            ev = r.get(f"{n} events")
            cells.append(f"{r[n]:.1f}" + (f" ({ev:.1f})" if ev is not None else ""))
        print(f"| {r['workload']} | " + " | ".join(cells) + " |")
    print("host µs per call (on CUDA, in brackets: median µs between CUDA events)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--only", default="")
    parser.add_argument("--rows", default="")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.device == "cpu":
        global CLOCK
        CLOCK = time.thread_time
        torch.set_num_threads(1)  # a tiny graph: threads only add noise
    rows = run(args.device, args.calls, [o for o in args.only.split(",") if o],
               args.profile, [r.strip() for r in args.rows.split(";") if r.strip()])
    print_table(rows)
    for line in summary(rows):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
