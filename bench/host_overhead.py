"""Host time per call of small compiled graphs: where the microseconds go between the
user's call and the kernels (Dynamo's frame and guards, AOTAutograd's runtime wrappers,
Kiln's wrapper, the CUDA-graph runner), for Kiln and Inductor, on one device.

    python3 bench/host_overhead.py [--device cuda|cpu] [--calls 2000] [--profile]
                                   [--only seed,block] [--json OUT]

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

Columns: host µs per call (the best of 5 runs of ``--calls``/5 calls, each timed with
perf_counter up to a synchronize: on a host-bound graph this is the wall time per call)
and, on CUDA, the median wall µs of one call between CUDA events (``gpu_bench``'s
measure). ``dynamic=False`` (as ``gpu_bench`` compiles) makes Dynamo patch its config on
every call, and ``torch._dynamo.config.record_runtime_overhead`` (on by default) adds two
calls to every frame: both are in the "dynamo floor" row, for Kiln and Inductor alike.
Every Kiln row is compared with eager first and fails on ``KilnFallbackWarning``.
``--profile`` prints the functions with the most own time in Kiln's default and
reduce-overhead calls.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

os.environ.setdefault("KILN_FARM", "inprocess")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_bench import Block, seed_fn  # noqa: E402

SETS = 4


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
                 ("kiln reduce-overhead, same inputs", {"backend": "kiln", **ro}, True)]
    return rows


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
    kwargs = dict(kwargs)
    if kwargs["backend"] == "floor":
        kwargs["backend"] = floor_backend
    return torch.compile(fn, dynamic=False, **kwargs)


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
        start = time.perf_counter()
        for i in range(n):
            fn(*sets[i % len(sets)])
        sync()
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best


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


def run(device: str, calls: int, only: list[str], want_profile: bool) -> list[dict[str, Any]]:
    from kiln import KilnFallbackWarning
    from kiln.compiler.runtime import cudagraphs

    direct = cudagraphs.MAX_DIRECT
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
                used = sets[:1] if same else sets
                compiled = compile_variant(fn, kwargs)
                cudagraphs.MAX_DIRECT = 0 if vname.endswith(", copy") else direct
                with warnings.catch_warnings():
                    warnings.simplefilter("error", KilnFallbackWarning)
                    if vname != "dynamo floor":
                        check(vname, compiled, fn, used)
                    row[vname] = host_us(compiled, used, calls, sync)
                    if device == "cuda":
                        row[f"{vname} events"] = event_us(compiled, used)
                    if want_profile and vname in ("kiln", "kiln reduce-overhead"):
                        profile(compiled, used, f"{wname}: {vname}")
            out.append(row)
            print(json.dumps(row), file=sys.stderr)
    return out


def print_table(rows: list[dict[str, Any]]) -> None:
    names = [k for k in rows[0] if k != "workload" and not k.endswith(" events")]
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
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.device == "cpu":
        torch.set_num_threads(1)  # a tiny graph: threads only add noise
    rows = run(args.device, args.calls, [o for o in args.only.split(",") if o],
               args.profile)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
