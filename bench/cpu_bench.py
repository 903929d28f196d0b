"""CPU backend benchmark: Kiln's C++ kernels against eager and stock Inductor, in one run.

Every case runs through ``torch.compile`` (``backend="kiln"``, whose default CPU backend is
C++, and the default Inductor backend), so both pay the same Dynamo guard overhead. It
prints the median time per call and the ratios. Not a test: run it by hand, e.g.

    OMP_NUM_THREADS=2 .venv/bin/python bench/cpu_bench.py            # --repeat N, --json
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
]


def median_time(fn: Callable[..., Any], args: list[torch.Tensor], repeat: int) -> float:
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_case(case: BenchCase, repeat: int) -> dict[str, Any]:
    import frontend.backend  # noqa: F401  (registers nothing; torch finds "kiln" by entry point)

    torch._dynamo.reset()
    torch.manual_seed(0)
    args = case.make_inputs()
    kiln = torch.compile(case.fn, backend="kiln")
    inductor = torch.compile(case.fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a Kiln fallback to eager would make figures lie
        expected = case.fn(*args)
        torch.testing.assert_close(kiln(*args), expected, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(inductor(*args), expected, rtol=1e-3, atol=1e-3)
    eager_s = median_time(case.fn, args, repeat)
    inductor_s = median_time(inductor, args, repeat)
    kiln_s = median_time(kiln, args, repeat)
    return {"case": case.name, "shape": case.shape, "eager_ms": eager_s * 1e3,
            "inductor_ms": inductor_s * 1e3, "kiln_ms": kiln_s * 1e3,
            "kiln_vs_inductor": inductor_s / kiln_s, "kiln_vs_eager": eager_s / kiln_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--only", default="", help="run cases whose name contains this")
    opts = parser.parse_args()
    torch.set_grad_enabled(False)
    results = [run_case(c, opts.repeat) for c in CASES if opts.only in c.name]
    if opts.json:
        print(json.dumps(results, indent=2))
        return
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"threads {torch.get_num_threads()}, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', 'unset')}; median of {opts.repeat}")
    print(f"{'case':36} {'shape':30} {'eager':>9} {'inductor':>9} {'kiln':>9} "
          f"{'ind/kiln':>9} {'eager/kiln':>10}")
    for r in results:
        print(f"{r['case']:36} {r['shape']:30} {r['eager_ms']:8.2f}ms {r['inductor_ms']:8.2f}ms "
              f"{r['kiln_ms']:8.2f}ms {r['kiln_vs_inductor']:8.2f}x {r['kiln_vs_eager']:9.2f}x")


if __name__ == "__main__":
    main()
