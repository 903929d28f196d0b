"""The suite's models compiled for a GPU on a machine without one (a diagnostic, not a
figure): each model at the size its users run, in its inference dtype, traced with fake
CUDA tensors (``frontend/cross/fake_device.py``: the path of ``kiln precompile --gpu``)
and every ATen graph compiled by Kiln's compiler for the target (Triton kernels, cubins
cross-compiled for it). What it finds is what fails on the GPU path before any kernel
runs: a lowering, the Triton code generator, a kernel Triton cannot compile, a graph that
cannot be keyed. It measures no speed, and it cannot see faults that happen at run time.

    python3 bench/suite/fake_gpu.py --models hf_bert,timm_resnet50 --json /tmp/fake.json
    python3 bench/suite/fake_gpu.py --gpu h100              # every model, inference
    python3 bench/suite/fake_gpu.py --dynamic --models hf   # traced with dynamic=True

Each model runs in its own process (a fresh Dynamo, a fresh store). Per model: the
graphs, whether each compiled, the error of each that did not (stage, op or kernel as
the compiler names them), Triton kernels, per-op fallbacks and seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULT = "FAKE_GPU_ROW "


def child(name: str, gpu: str, dynamic: bool) -> dict[str, Any]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from bench.suite.models import MODELS
    from kiln.frontend.config import KilnConfig
    from kiln.frontend.core.compile import compile_request
    from kiln.frontend.cross.fake_device import (
        fake_like,
        fake_module,
        parse_gpu,
        trace_requests,
    )

    spec = MODELS[name]
    torch.manual_seed(0)
    model = spec.build(False).to(spec.dtype).eval()
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    fake_module(model, mode)
    real = spec.model_inputs(spec.inputs(False, None), False)
    keys = list(real)
    def fake(v: Any) -> Any:
        if isinstance(v, (list, tuple)):  # the detection models take a list of images
            return type(v)(fake(x) for x in v)
        return fake_like(v.to(spec.dtype) if v.is_floating_point() else v, mode, "cuda")

    values = [fake(v) for v in real.values()]

    def call(*args: Any) -> Any:
        return model(**dict(zip(keys, args)))

    config = KilnConfig.resolve({})
    target = parse_gpu(gpu)
    t0 = time.perf_counter()
    traced = trace_requests(call, values, config, target, dynamic=dynamic)
    row: dict[str, Any] = {"model": name, "trace_s": round(time.perf_counter() - t0, 2),
                           "graphs": []}
    for graph in traced:
        entry: dict[str, Any] = {"name": graph.name, "notes": graph.notes}
        if graph.request is None:
            entry["error"] = graph.reason
            row["graphs"].append(entry)
            continue
        t1 = time.perf_counter()
        try:
            result = compile_request(graph.request, config, graph.name)
        except Exception as e:  # the row records it; the next graph goes on
            entry["error"] = f"{type(e).__name__}: {e}"[:2000]
        else:
            compiled = result.compiled
            entry["kernels"] = sum(k.backend == "triton" for k in compiled.kernels)
            entry["cubins"] = sum(bool(b.binary) for b in compiled.binaries.values())
            entry["fallback_ops"] = compiled.stats.get("fallback_ops", {})
        entry["compile_s"] = round(time.perf_counter() - t1, 2)
        row["graphs"].append(entry)
    return row


def run_one(name: str, gpu: str, timeout: float, dynamic: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kiln-fake-gpu-") as tmp:
        env = dict(os.environ, KILN_FARM="inprocess", KILN_STORE=f"{tmp}/store",
                   KILN_CACHE_DIR=f"{tmp}/cache", KILN_LOCAL_CACHE="off",
                   KILN_STATS_FILE="off", TRITON_CACHE_DIR=f"{tmp}/triton")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--gpu", gpu]
        cmd += ["--dynamic"] if dynamic else []
        t0 = time.perf_counter()
        try:
            done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                  timeout=timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {"model": name, "error": f"timed out after {timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            row: dict[str, Any] = json.loads(line[len(RESULT):])
            row["row_s"] = round(time.perf_counter() - t0, 1)
            return row
    return {"model": name, "error": f"exit {done.returncode}: {done.stderr[-1500:]}"}


def summary(row: dict[str, Any]) -> str:
    if "error" in row:
        return f"{row['model']:<36} ERROR {row['error'].splitlines()[-1][:200]}"
    bad = [g for g in row["graphs"] if "error" in g]
    kernels = sum(g.get("kernels", 0) for g in row["graphs"])
    cubins = sum(g.get("cubins", 0) for g in row["graphs"])
    fallbacks = sorted({op for g in row["graphs"] for op in g.get("fallback_ops", {})})
    text = (f"{row['model']:<36} {len(row['graphs'])} graphs, {len(bad)} failed, "
            f"{kernels} kernels ({cubins} cubins), {row.get('row_s', 0):.0f} s")
    if fallbacks:
        text += f", ATen: {','.join(fallbacks)}"
    for g in bad:
        text += f"\n    {g['name']}: {g['error'].splitlines()[-1][:300]}"
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", help="comma-separated names or suites; default: all")
    p.add_argument("--gpu", default="h100", help="the target (kiln precompile --gpu)")
    p.add_argument("--json", type=Path)
    p.add_argument("--dynamic", action="store_true", help="trace with dynamic=True")
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per model")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(RESULT + json.dumps(child(args.child, args.gpu, args.dynamic)), flush=True)
        return 0
    from bench.suite.models import select

    rows = []
    for spec in select(args.models, "inference"):
        rows.append(run_one(spec.name, args.gpu, args.timeout, args.dynamic))
        print(summary(rows[-1]), flush=True)
        if args.json:
            args.json.write_text(json.dumps({"gpu": args.gpu, "dynamic": args.dynamic,
                                             "rows": rows}, indent=1))
    failed = [r["model"] for r in rows
              if "error" in r or any("error" in g for g in r["graphs"])]
    print(f"{len(rows) - len(failed)} of {len(rows)} models compile for {args.gpu}"
          + (f"; failing: {','.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
