"""Does a compiled training step cost more host time after the process compiled other
graphs? The encoder training step, compiled and timed alone, then again after ``--rows``
other workloads were compiled and run in the same process, in ``bench/gpu_bench.py``'s
order (per row: Inductor, then Kiln with the wait for its background tuning and the
reload of the tuned artifact), for Kiln and Inductor.

    python3 bench/host_growth.py [--device cpu|cuda] [--rows 8] [--calls 60]

Columns per backend and phase: wall ms per step (the best of 3 blocks, synchronized at
the end of each block), CPU ms per step of the calling thread (less disturbed by other
processes on a shared host), Python function calls per step (cProfile: deterministic;
work that grows with the number of compiled graphs shows here first), gc collections per
100 steps, and the threads alive. On CPU the step is the encoder at a small size (2
layers, width 64, 2x32 tokens, fp32); on CUDA it is ``gpu_bench``'s row "encoder
training step 4 layers 8x256 bf16 autocast" and the other rows are ``gpu_bench``'s
lighter ones. Every compiled step's loss is compared with eager's, and a Kiln graph that
falls back to eager (``KilnFallbackWarning``) fails the run.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

_CACHE = tempfile.mkdtemp(prefix="kiln_growth_")
for _name, _sub in (("KILN_CACHE_DIR", "kiln"), ("TRITON_CACHE_DIR", "triton"),
                    ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
    os.environ.setdefault(_name, os.path.join(_CACHE, _sub))
os.environ.setdefault("KILN_FARM", "inprocess")
os.environ.setdefault("KILN_STORE", "file://" + os.path.join(_CACHE, "store"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_bench as gb  # noqa: E402

# fn, inputs, training, torch.compile mode
Row = tuple[Callable[..., Any], Callable[[], list[Any]], bool, "str | None"]
BACKENDS = ("inductor", "kiln")
GC_COUNTS = [0, 0, 0]


def _count_gc(phase: str, info: dict[str, Any]) -> None:
    if phase == "start":
        GC_COUNTS[info["generation"]] += 1


def step_row(device: str) -> Row:
    """The encoder training step (``gpu_bench``'s on CUDA, a small one on CPU)."""
    if device == "cuda":
        w = gb.encoder_workloads()[0]
        return w.fn, w.make_inputs, True, None
    torch.manual_seed(0)
    model = gb.Encoder(layers=2, vocab=1000, d=64, heads=4, seq=32)
    labels = torch.randint(0, 2, (2,))

    def train_step(ids: torch.Tensor, segments: torch.Tensor, keep: torch.Tensor
                   ) -> torch.Tensor:
        loss = F.cross_entropy(model(ids, segments, keep), labels)
        loss.backward()
        return loss

    def inputs() -> list[Any]:
        keep = torch.arange(32)[None, :] < torch.randint(16, 33, (2, 1))
        return [torch.randint(0, 1000, (2, 32)), torch.randint(0, 2, (2, 32)), keep]

    return train_step, inputs, True, None


def other_rows(device: str) -> list[Row]:
    if device == "cuda":
        skip = ("encoder", "GPT-2", "ResNet")
        return [(w.fn, w.make_inputs, w.train, w.mode) for w in gb.workloads()
                if not any(s in w.name for s in skip)]
    r = torch.randn
    mlp = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64))

    def mlp_step(x: torch.Tensor) -> torch.Tensor:
        loss = mlp(x).square().mean()
        loss.backward()
        return loss

    block = gb.Block(64, 4).eval()
    w, b = r(64), r(64)
    return [(gb.seed_fn, lambda: [r(64, 128), r(64, 128), r(64, 128)], False, None),
            (gb.mlp_tail, lambda: [r(32, 64), r(64, 64), r(64), r(32, 64)], False, None),
            (lambda x: F.layer_norm(x, (64,), w, b), lambda: [r(32, 64)], False, None),
            (lambda x: F.rms_norm(x, (64,), w, eps=1e-6), lambda: [r(32, 64)], False, None),
            (lambda x: torch.softmax(x, -1), lambda: [r(32, 64)], False, None),
            (lambda x, t: F.cross_entropy(x, t),
             lambda: [r(32, 100), torch.randint(0, 100, (32,))], False, None),
            (mlp_step, lambda: [r(32, 64)], True, None),
            (block, lambda: [r(2, 16, 64)], False, None)]


def compiled(fn: Callable[..., Any], backend: str, args: list[Any], train: bool,
             mode: str | None = None) -> Callable[..., Any]:
    """As ``gpu_bench.compiled``: two calls; for Kiln, the wait for background tuning and
    a second compile that loads the tuned artifact. Fails on ``KilnFallbackWarning``."""
    from kiln import KilnFallbackWarning
    from kiln.frontend.core.client import wait_for_background

    with warnings.catch_warnings(), torch.set_grad_enabled(train):
        warnings.simplefilter("error", KilnFallbackWarning)
        torch._dynamo.reset()
        out = torch.compile(fn, backend=backend, dynamic=False, mode=mode)
        out(*args)
        out(*args)
        if backend == "kiln":
            wait_for_background(900)
            torch._dynamo.reset()
            out = torch.compile(fn, backend=backend, dynamic=False, mode=mode)
            out(*args)
            out(*args)
    return out


def measure(fn: Callable[..., Any], sets: list[list[Any]], calls: int,
            sync: Callable[[], None]) -> dict[str, Any]:
    for i in range(8):
        fn(*sets[i % len(sets)])
    sync()
    wall, cpu, n = float("inf"), float("inf"), max(calls // 3, 1)
    before = list(GC_COUNTS)
    for _ in range(3):
        start, start_cpu = time.perf_counter(), time.thread_time()
        for i in range(n):
            fn(*sets[i % len(sets)])
        sync()
        wall = min(wall, (time.perf_counter() - start) / n * 1e3)
        cpu = min(cpu, (time.thread_time() - start_cpu) / n * 1e3)
    collections = sum(a - b for a, b in zip(GC_COUNTS, before)) * 100 / (3 * n)
    prof = cProfile.Profile()
    prof.enable()
    for i in range(20):
        fn(*sets[i % len(sets)])
    prof.disable()
    sync()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    py_calls = sum(v[1] for v in stats.values()) / 20
    return {"wall_ms": wall, "cpu_ms": cpu, "py_calls": py_calls, "gc_per_100": collections,
            "threads": sorted(t.name for t in threading.enumerate())}


def check(step: Callable[..., Any], fn: Callable[..., Any], args: list[Any], name: str) -> None:
    got, want = fn(*args).detach().float(), step(*args).detach().float()
    tol = 3e-2 if args[0].is_cuda else 1e-4
    torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=name)


def phase(name: str, device: str, calls: int) -> list[dict[str, Any]]:
    step, make, _, _ = step_row(device)
    sets = [make() for _ in range(4)]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    rows = []
    with torch.enable_grad():
        eager = measure(step, sets, calls, sync)
        rows.append({"phase": name, "backend": "eager", **eager})
        for backend in BACKENDS:
            fn = compiled(step, backend, sets[0], True)
            check(step, fn, sets[1], f"{backend} {name}")
            rows.append({"phase": name, "backend": backend, **measure(fn, sets, calls, sync)})
    return rows


def compile_others(device: str, count: int) -> None:
    for fn, make, train, mode in other_rows(device)[:count]:
        args = make()
        for backend in BACKENDS:
            with torch.set_grad_enabled(train):
                compiled(fn, backend, args, train, mode)(*args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--calls", type=int, default=60)
    ns = parser.parse_args()
    if ns.device == "cpu":
        torch.set_num_threads(1)  # the shared CPU host: one thread, steadier figures
    gc.callbacks.append(_count_gc)
    rows = phase("alone", ns.device, ns.calls)
    compile_others(ns.device, ns.rows)
    rows += phase(f"after {ns.rows} rows", ns.device, ns.calls)
    print("| phase | backend | wall ms/step | thread CPU ms/step | Python calls/step | "
          "gc/100 steps | threads |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['phase']} | {r['backend']} | {r['wall_ms']:.3f} | {r['cpu_ms']:.3f} | "
              f"{r['py_calls']:.1f} | {r['gc_per_100']:.1f} | {', '.join(r['threads'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
