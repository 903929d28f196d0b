"""CPU backend benchmark: Kiln's C++ kernels against eager and stock Inductor, in one run.

Every case runs through ``torch.compile`` (``backend="kiln"``, whose default CPU backend is
C++, and the default Inductor backend), so both pay the same Dynamo guard overhead. It
prints the median time per call and the ratios. Not a test: run it by hand, e.g.

    OMP_NUM_THREADS=2 .venv/bin/python bench/cpu_bench.py     # --rounds N --calls N --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


@dataclass(frozen=True)
class BenchCase:
    name: str
    shape: str
    fn: Callable[..., Any]
    make_inputs: Callable[[], list[torch.Tensor]]


def seed_fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return ((a + b) * c.relu()).sum(dim=-1)


def layer_norm_fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b)


def softmax_fn(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


def mlp_fn(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
           b2: torch.Tensor) -> torch.Tensor:
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def column_sum_fn(x: torch.Tensor) -> torch.Tensor:
    return x.sum(dim=0)  # a bias gradient's reduction: along strided rows


def _randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape) * scale


CASES = [
    BenchCase("seed ((a+b)*relu(c)).sum(-1)", "3 x (8192, 4096)", seed_fn,
              lambda: [_randn(8192, 4096) for _ in range(3)]),
    BenchCase("layer_norm", "(8192, 4096)", layer_norm_fn,
              lambda: [_randn(8192, 4096), _randn(4096), _randn(4096)]),
    BenchCase("softmax(dim=-1)", "(8192, 4096)", softmax_fn, lambda: [_randn(8192, 4096)]),
    BenchCase("MLP forward (linear-gelu-linear)", "x (2048, 1024), hidden 4096", mlp_fn,
              lambda: [_randn(2048, 1024), _randn(4096, 1024, scale=0.03), _randn(4096),
                       _randn(1024, 4096, scale=0.015), _randn(1024)]),
    BenchCase("column sum x.sum(0) (extra)", "(8192, 4096)", column_sum_fn,
              lambda: [_randn(8192, 4096)]),
]


def time_calls(fn: Callable[..., Any], args: list[torch.Tensor], calls: int) -> list[float]:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return times


def run_case(case: BenchCase, rounds: int, calls: int) -> dict[str, Any]:
    """Eager, Inductor and Kiln in turn, ``rounds`` times ``calls`` calls each, so that
    load from other processes falls on all three alike; the median of all calls counts."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    args = case.make_inputs()
    variants = {"eager": case.fn, "inductor": torch.compile(case.fn),
                "kiln": torch.compile(case.fn, backend="kiln")}
    expected = case.fn(*args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Kiln fallback to eager would make figures lie
        for name, fn in variants.items():
            torch.testing.assert_close(fn(*args), expected, rtol=1e-3, atol=1e-3,
                                       msg=_named(name))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            fn(*args)  # warm
            times[name] += time_calls(fn, args, calls)
    ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    best = {name: min(t) * 1e3 for name, t in times.items()}
    return {"case": case.name, "shape": case.shape, "eager_ms": ms["eager"],
            "inductor_ms": ms["inductor"], "kiln_ms": ms["kiln"],
            "kiln_vs_inductor": ms["inductor"] / ms["kiln"],
            "kiln_vs_eager": ms["eager"] / ms["kiln"],
            "best_ms": best}


def _named(name: str) -> Callable[[str], str]:
    return lambda message: f"{name}: {message}"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=5, help="calls per round and variant")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", default="", help="run cases whose name contains this")
    opts = parser.parse_args()
    os.environ.setdefault("KILN_FARM", "inprocess")  # no Ray processes competing for cores
    torch.set_grad_enabled(False)
    results = [run_case(c, opts.rounds, opts.calls) for c in CASES if opts.only in c.name]
    if opts.json:
        print(json.dumps(results, indent=2))
        return
    from kiln.compiler.codegen.cpp.build import DEFAULT_ISA

    print(f"# {_cpu_name()}, torch {torch.__version__}, Kiln ISA level {DEFAULT_ISA}, "
          f"threads {torch.get_num_threads()}, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; median of {opts.rounds} rounds x "
          f"{opts.calls} calls, interleaved")
    print(f"{'case':34} {'shape':28} {'eager':>8} {'inductor':>8} {'kiln':>8} "
          f"{'ind/kiln':>8} {'eager/kiln':>10}   best: eager / inductor / kiln")
    for r in results:
        best = r["best_ms"]
        print(f"{r['case']:34} {r['shape']:28} {r['eager_ms']:6.1f}ms {r['inductor_ms']:6.1f}ms "
              f"{r['kiln_ms']:6.1f}ms {r['kiln_vs_inductor']:7.2f}x {r['kiln_vs_eager']:9.2f}x   "
              f"{best['eager']:.1f} / {best['inductor']:.1f} / {best['kiln']:.1f} ms")


if __name__ == "__main__":
    main()
