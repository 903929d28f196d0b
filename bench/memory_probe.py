"""Where a backend's GPU memory goes on a suite model (a diagnostic, not a figure): for
each backend, in one process per model, the memory the compiled model holds once it has
run (resident above the weights, and by the frame that allocated it), the peak of two
calls as ``bench/suite/row.py`` takes it (right after the first calls, and again once
background tuning has finished), and, from ``torch.cuda.memory``'s allocation history,
the allocations alive at the peak of those two calls grouped by the frame that made
them.

    python3 bench/memory_probe.py --models hf_vit,timm_resnet50 --json /tmp/mem.json
    python3 bench/memory_probe.py --models hf_bert --mode train --backends kiln

Needs CUDA. Kiln compiles in this process (``KILN_FARM=inprocess`` unless set).
"""

from __future__ import annotations

import argparse
import gc
import json
import linecache
import os
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
RESULT = "MEMORY_PROBE "
MB = 2**20


def _frame_label(frames: list[dict[str, Any]]) -> str:
    """The frame that best names who allocated: the first one in Kiln's code or a
    compiled wrapper, else in torch's Inductor, else the innermost Python frame."""
    def pick(pred: Any) -> str | None:
        for f in frames:
            name = f.get("filename", "")
            if pred(name):
                text = linecache.getline(name, int(f.get("line") or 0)).strip()[:120]
                return f"{Path(name).name}:{f.get('line')} {text or f.get('name')}"
        return None
    return (pick(lambda n: "kiln" in n and "site-packages/torch" not in n)
            or pick(lambda n: "torchinductor" in n or "_inductor" in n)
            or pick(lambda n: n.endswith(".py") and "/torch/" not in n)
            or pick(lambda n: n.endswith(".py")) or "?")


def alive_at_peak(snapshot: dict[str, Any], device: int) -> tuple[float, dict[str, float]]:
    """Replay the allocation trace; at its highest point, the live bytes by frame."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    traces = snapshot.get("device_traces", [])
    for ev in traces[device] if device < len(traces) else []:
        action, addr, size = ev["action"], ev["addr"], ev["size"]
        if action == "alloc":
            live[addr] = (size, _frame_label(ev.get("frames", [])))
            total += size
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action in ("free_requested", "free") and addr in live:
            total -= live.pop(addr)[0]
    groups: dict[str, float] = defaultdict(float)
    for size, label in at_peak.values():
        groups[label] += size / MB
    top = dict(sorted(groups.items(), key=lambda kv: -kv[1])[:15])
    return peak / MB, {k: round(v, 1) for k, v in top.items()}


def held_by_frame(snapshot: dict[str, Any]) -> dict[str, float]:
    """The blocks allocated now (MB), by the frame that allocated them (blocks made
    before the history started recording have no frames: "?")."""
    groups: dict[str, float] = defaultdict(float)
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") == "active_allocated":
                groups[_frame_label(block.get("frames", []))] += block["size"] / MB
    top = sorted(groups.items(), key=lambda kv: -kv[1])[:15]
    return {k: round(v, 1) for k, v in top}


def probe(name: str, mode: str, backends: list[str]) -> dict[str, Any]:
    import torch

    from bench.suite.models import MODELS
    from bench.suite.row import Case, compile_backend, peak_memory_mb

    case = Case(MODELS[name], mode, False, "cuda")
    inputs = case.inputs()
    out: dict[str, Any] = {"model": name, "mode": mode, "backends": {}}
    for backend in backends:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        model = case.copy()
        weights = torch.cuda.memory_allocated() - base
        # recorded from the compile on: what stays allocated after the calls says by whom
        torch.cuda.memory._record_memory_history(max_entries=200000)
        step = case.step(model, None if backend == "eager" else
                         compile_backend(backend, False))
        fig: dict[str, Any] = {"weights_mb": round(weights / MB, 1)}
        t0 = time.perf_counter()
        for _ in range(3):
            step(inputs)
        torch.cuda.synchronize()
        fig["first_calls_s"] = round(time.perf_counter() - t0, 2)
        fig["resident_after_calls_mb"] = round(
            (torch.cuda.memory_allocated() - base - weights) / MB, 1)
        gc.collect()
        fig["held_after_calls_by_frame_mb"] = held_by_frame(torch.cuda.memory._snapshot())
        torch.cuda.memory._record_memory_history(enabled=None)
        fig["peak_as_suite_mb"] = round(peak_memory_mb(step, inputs), 1)
        if backend == "kiln":
            from kiln.frontend.core.client import wait_for_background

            t1 = time.perf_counter()
            fig["tuning_done"] = wait_for_background(300)
            fig["tuning_wait_s"] = round(time.perf_counter() - t1, 2)
            for _ in range(2):
                step(inputs)
            torch.cuda.synchronize()
            fig["peak_after_tuning_mb"] = round(peak_memory_mb(step, inputs), 1)
            fig["resident_after_tuning_mb"] = round(
                (torch.cuda.memory_allocated() - base - weights) / MB, 1)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.memory._record_memory_history(max_entries=200000)
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        for _ in range(2):
            step(inputs)
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        fig["peak_recorded_mb"] = round((torch.cuda.max_memory_allocated() - before) / MB, 1)
        traced_peak, groups = alive_at_peak(snap, torch.cuda.current_device())
        fig["trace_peak_mb"] = round(traced_peak, 1)
        fig["alive_at_peak_by_frame_mb"] = groups
        out["backends"][backend] = fig
        del step, model
    return out


def run_one(name: str, mode: str, backends: str, timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("KILN_FARM", "inprocess")
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--mode", mode,
           "--backends", backends]
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"model": name, "error": f"timed out after {timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])  # type: ignore[no-any-return]
    return {"model": name, "error": f"exit {done.returncode}: {done.stderr[-1500:]}"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="hf_vit,timm_resnet50,hf_bert")
    p.add_argument("--mode", default="inference", choices=("inference", "train"))
    p.add_argument("--backends", default="inductor,kiln")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", type=Path)
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        row = probe(args.child, args.mode, args.backends.split(","))
        print(RESULT + json.dumps(row), flush=True)
        return 0
    rows = []
    for name in args.models.split(","):
        row = run_one(name, args.mode, args.backends, args.timeout)
        rows.append(row)
        print(json.dumps(row, indent=1), flush=True)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
