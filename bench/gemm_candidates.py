"""Max-autotune's work for a model, counted without a GPU (CPU machine): the GEMM problems
each of its graphs poses, the candidates of each (the library call and the template
configs that fit the target's shared memory), and the seconds to cross-compile every
template candidate for the target on ``--threads`` threads (what the farm's CPU workers
do before the GPU benchmarks; the benchmarks themselves need the GPU).

    python bench/gemm_candidates.py [--models mlp_train,block,gpt2] [--threads 2]
        [--count-only] [--json OUT]

Models: gpu_bench.py's "MLP training step 4096x1024 fp32" (forward and backward graphs)
and "transformer block fwd 8x512x1024 fp16", and coldstart.py's GPT-2 (bf16, 4 x 512
tokens), traced through the kiln backend's own Dynamo and AOTAutograd path on CPU, then
lowered for fake CUDA inputs of the same metadata.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SM90 = {"kind": "cuda", "backend": "cuda", "arch": 90, "warp_size": 32, "sm_count": 132}


def mlp_train() -> tuple[Any, list[torch.Tensor]]:
    mlp = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024))

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = mlp(x).square().mean()
        loss.backward()
        return loss

    return step, [torch.randn(4096, 1024)]


def block() -> tuple[Any, list[torch.Tensor]]:
    from gpu_bench import Block

    model = Block().half().eval()

    def forward(x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return model(x)  # type: ignore[no-any-return]

    return forward, [torch.randn(8, 512, 1024, dtype=torch.float16)]


def gpt2() -> tuple[Any, list[torch.Tensor]]:
    """bench/coldstart.py's GPT-2 (HF's where transformers is installed, else its stand-in
    of the same sizes) as it runs on the GPU: bf16, 4 x 512 tokens."""
    from coldstart_models import MODELS as COLDSTART

    case = COLDSTART["gpt2"]("cpu", False)
    module = case.module.to(torch.bfloat16)
    ids = case.inputs[0]

    def forward(ids: torch.Tensor) -> Any:
        with torch.no_grad():
            return module(ids)

    return forward, [ids]


MODELS = {"mlp_train": mlp_train, "block": block, "gpt2": gpt2}


def problems_of(model: str) -> list[tuple[str, str, Any]]:
    """(graph, choice key, problem) for every matmul problem of the model's graphs."""
    from kiln.compiler.driver import compile_graph
    from kiln.compiler.ir.template import GemmProblem
    from tests.gemm_helpers import aot_graphs, as_fake_cuda

    fn, args = MODELS[model]()
    out = []
    for name, gm, inputs in aot_graphs(fn, args):
        first = compile_graph(gm, as_fake_cuda(inputs), {"max_autotune": True}, name=name,
                              compile_kernels=False, target=SM90)
        for key, p in sorted(first.stats["gemm_pending"].items()):
            out.append((name, key, GemmProblem.from_dict(p)))
    return out


def measure(model: str, threads: int, compile_all: bool = True) -> dict[str, Any]:
    from kiln.compiler.kernel_compile import compile_kernel
    from kiln.workers.select import template_jobs

    found = problems_of(model)
    unique = {key: (graph, p) for graph, key, p in found}
    jobs = [job for key, (_, p) in unique.items()
            for _, job in template_jobs(key, p, SM90) if job is not None]
    start = time.perf_counter()
    if compile_all:
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda j: compile_kernel(j.spec, j.config, SM90), jobs))
    wall = time.perf_counter() - start
    rows = [{"graph": g, "problem": f"{p.op} {p.batch}x{p.m}x{p.n}x{p.k} {p.dtype} "
             f"a{list(p.a_stride)} b{list(p.b_stride)} epilogue={p.epilogue}",
             "candidates": 1 + sum(1 for _, j in template_jobs(k, p, SM90) if j is not None)}
            for k, (g, p) in unique.items()]
    return {"model": model, "problems": len(found), "distinct": len(unique),
            "template_configs": len(jobs), "compile_wall_s": wall, "threads": threads,
            "per_config_cpu_s": wall * threads / max(1, len(jobs)), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="mlp_train,block")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default="")
    parser.add_argument("--count-only", action="store_true",
                        help="list the problems and count the configs; compile nothing")
    ns = parser.parse_args()
    results = []
    for model in ns.models.split(","):
        r = measure(model.strip(), ns.threads, not ns.count_only)
        results.append(r)
        print(f"# {r['model']}: {r['problems']} GEMM problems ({r['distinct']} distinct), "
              f"{r['template_configs']} template configs cross-compiled for sm_90 in "
              f"{r['compile_wall_s']:.1f} s on {r['threads']} threads "
              f"({r['per_config_cpu_s']:.1f} CPU s each)", flush=True)
        for row in r["rows"]:
            print(f"#   {row['graph']}: {row['problem']}: {row['candidates']} candidates")
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
