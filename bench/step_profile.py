"""Where a suite row's step spends its time, Kiln beside Inductor (a GPU diagnostic).

For each model and backend, in one process per model: the suite's step (``bench/suite``,
the same model, inputs and optimizer), compiled, called until Kiln's background tuning is
done, then timed (wall and CUDA events over ``--steps`` calls) and profiled over three
calls. Per backend it reports the step's wall time, the GPU's busy time (the kernels'
sum: a wall time far above it means the host is the limit), launches, and the kernels
that take the most GPU time, with their counts; for Kiln also its graphs and per-op
fallbacks.

    python3 bench/step_profile.py --mode train --models hf_bert,timm_resnet50 \
        --json bench/results/step_profile.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULT = "STEP_PROFILE_ROW "


def _profile(step: Any, inputs: Any, top: int) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    step(inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step(inputs)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            entry = kernels.setdefault(e.name[:120], [0, 0.0])
            entry[0] += 1
            entry[1] += e.device_time / 1e3  # us to ms
    busy = sum(t for _, t in kernels.values()) / 3
    launches = sum(n for n, _ in kernels.values()) / 3
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]
    return {"gpu_busy_ms": round(busy, 3), "launches": launches,
            "top": [[name, n // 3, round(t / 3, 3)] for name, (n, t) in ranked]}


def child(name: str, mode: str, backends: list[str], steps: int, top: int) -> dict[str, Any]:
    import warnings

    import torch

    from bench.suite.models import MODELS
    from bench.suite.row import Case, KilnGraphs, compile_backend

    case = Case(MODELS[name], mode, False, "cuda")
    inputs = case.inputs()
    out: dict[str, Any] = {"model": name, "mode": mode, "backends": {}}
    for backend in backends:
        figures: dict[str, Any] = {}
        graphs = KilnGraphs() if backend == "kiln" else None
        try:
            with warnings.catch_warnings(), graphs or contextlib.nullcontext():
                wrap = None if backend == "eager" else compile_backend(backend, False)
                t0 = time.perf_counter()
                step = case.step(case.copy(), wrap)
                step(inputs)
                torch.cuda.synchronize()
                figures["first_s"] = round(time.perf_counter() - t0, 2)
                for _ in range(5):
                    step(inputs)
                if backend == "kiln":
                    from kiln.frontend.core.client import wait_for_background

                    figures["background_done"] = wait_for_background(600)
                    figures["background_s"] = round(time.perf_counter() - t0, 2)
                for _ in range(5):
                    step(inputs)
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(True), torch.cuda.Event(True)
                wall0 = time.perf_counter()
                start.record()
                for _ in range(steps):
                    step(inputs)
                end.record()
                torch.cuda.synchronize()
                figures["wall_ms"] = round((time.perf_counter() - wall0) * 1e3 / steps, 3)
                figures["cuda_ms"] = round(start.elapsed_time(end) / steps, 3)
                figures.update(_profile(step, inputs, top))
        except Exception as exc:  # a failing backend is a result
            figures["error"] = f"{type(exc).__name__}: {exc}"[-2000:]
        if graphs:
            figures.update(graphs=graphs.graphs, fallback_ops=graphs.fallback_ops)
        out["backends"][backend] = figures
        torch.cuda.empty_cache()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="hf_bert,timm_resnet50")
    p.add_argument("--mode", default="train", choices=("train", "inference"))
    p.add_argument("--backends", default="inductor,kiln")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", type=Path)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    backends = args.backends.split(",")
    if args.child:
        row = child(args.child, args.mode, backends, args.steps, args.top)
        print(RESULT + json.dumps(row), flush=True)
        return
    rows = []
    for name in args.models.split(","):
        cmd = [sys.executable, __file__, "--child", name, "--mode", args.mode,
               "--backends", args.backends, "--steps", str(args.steps), "--top", str(args.top)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
            row = (json.loads(found[-1][len(RESULT):]) if found else
                   {"model": name, "error": (proc.stderr or proc.stdout)[-3000:]})
        except subprocess.TimeoutExpired:
            row = {"model": name, "error": f"timed out after {args.timeout} s"}
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"mode": args.mode, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
