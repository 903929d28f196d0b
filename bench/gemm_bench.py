"""GEMM candidates benchmark (H200 host): every choice max-autotune weighs for one matmul
problem, timed as the GPU autotuner times it, with TFLOP/s and the winner.

    python3 bench/gemm_bench.py [--m 8192 --n 4096 --k 4096] [--dtype float16]
                                [--transposed-b] [--no-epilogue] [--json OUT]

Rows: the library call (charged the output's measured round trip where an epilogue
follows), then each template config (TMA / persistent marked). The winner is the one
``compiler.select_algorithm.pick_winner`` keeps.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from kiln.compiler.ir.template import GemmProblem
from kiln.compiler.kernel_compile import compile_kernel
from kiln.compiler.select_algorithm import candidates, pick_winner
from kiln.workers.autotune import benchmark_gemm
from kiln.workers.select import template_jobs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--m", type=int, default=8192)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--transposed-b", action="store_true")
    parser.add_argument("--no-epilogue", action="store_true")
    parser.add_argument("--json", default="")
    ns = parser.parse_args()
    major, minor = torch.cuda.get_device_capability()
    target = {"kind": "cuda", "backend": "cuda", "arch": major * 10 + minor, "warp_size": 32}
    b_stride = (0, 1, ns.k) if ns.transposed_b else (0, ns.n, 1)
    p = GemmProblem("mm", 1, ns.m, ns.n, ns.k, ns.dtype, ns.dtype, ns.dtype, (0, ns.k, 1),
                    b_stride, epilogue=not ns.no_epilogue,
                    allow_tf32=bool(torch.backends.cuda.matmul.allow_tf32))
    jobs = [job for _, job in template_jobs("choice-bench", p, target) if job is not None]
    start = time.perf_counter()
    binaries = [compile_kernel(job.spec, job.config, target) for job in jobs]
    compile_s = time.perf_counter() - start
    timings = benchmark_gemm(p, [job.spec for job in jobs], list(binaries))
    cands = candidates(p, target)
    ms = [timings["extern_ms"]] + list(timings["template_ms"])
    record = pick_winner(p, list(zip(cands, ms)), timings["round_trip_ms"])
    print(f"# {torch.cuda.get_device_name()}, {p.m}x{p.n}x{p.k} {p.dtype}, "
          f"{len(jobs)} configs compiled in {compile_s:.1f} s, output round trip "
          f"{timings['round_trip_ms']:.3f} ms")
    print("| candidate | ms | TFLOP/s | chosen |")
    print("|---|---|---|---|")
    for cand, t in zip(cands, ms):
        chosen = record["kind"] == cand.kind and record.get("config") == cand.config
        name = "extern (library)" if cand.config is None else _config_name(cand.config)
        print(f"| {name} | {t:.4f} | {p.flops() / t / 1e9:.0f} | {'*' if chosen else ''} |")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"problem": p.to_dict(), "timings": timings, "record": record}, f,
                      indent=1)


def _config_name(c: dict[str, object]) -> str:
    name = (f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} s{c['num_stages']} "
            f"w{c['num_warps']}")
    if c.get("NUM_SMS"):
        return name + " TMA persistent"
    return name + (" TMA" if c.get("TMA") else "")


if __name__ == "__main__":
    main()
