"""Time to full speed: each compiled model called back to back, as a program's loop calls
it, for ``--seconds`` after its first output (issue 31).

For each model and mode, in a fresh process with fresh caches (a cold start), it records:

- ``first_output_s``: from ``torch.compile`` to the first output (every sequence length
  of the dynamic model called once);
- ``steady_ms``: the median call over the last quarter of the loop (per sequence length);
- ``full_speed_s``: from ``torch.compile`` until the first of ``RUN`` calls in a row
  within 10% of steady;
- ``slowest_ms`` / ``slowest_ratio``: the slowest call after the first output, and over
  its steady time; ``slow_calls``: calls over 1.5x steady; ``last_slow_s``: when the
  last of them came (seconds after ``torch.compile``);
- for Kiln, what ``kiln stats`` counts: the switches to tuned kernels and when, and
  tuning's turns on this GPU with the calls they slowed (none with a farm up: the farm
  tunes).

Each call is timed on the host to its end on the GPU (a synchronize after each): what a
latency-sensitive server, a benchmark or ``triton.testing.do_bench`` sees. Modes:

    inductor         torch.compile's default backend
    kiln_inprocess   KILN_FARM=inprocess (no Ray): tuning in this process, in turns
    kiln_default     KILN_FARM unset, no farm up: compiles here at once, tunes in turns
    kiln_farm        a farm up (`kiln farm up`, one per run): the farm's GPU autotuner
                     tunes, never the client
    kiln_second      a second process on kiln_inprocess's store: it must start with the
                     tuned kernels and benchmark nothing

A Kiln row fails on ``KilnFallbackWarning``; every row compares its outputs (the first
and the last calls of each variant) with eager. JSON goes to ``--out`` (and stdout).

    python3 bench/full_speed.py --models vit,decoder --modes inductor,kiln_inprocess
    python3 bench/full_speed.py --device cpu --smoke --modes kiln_inprocess --seconds 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = ("inductor", "kiln_inprocess", "kiln_default", "kiln_farm", "kiln_second")
SLOW = 1.5  # a call over this many times steady is a stall
NEAR = 1.1  # within this of steady is full speed
RUN = 5  # calls in a row within NEAR of steady: full speed reached
TARGET_FULL_SPEED = 0.6  # of Inductor's time to first output


# ---------------------------------------------------------------------------------------
# Figures from one loop's calls (pure: tests/unit/test_full_speed_bench.py).


def steady_by_tag(calls: list[dict[str, Any]]) -> dict[str, float]:
    """Each variant's median over the last quarter of its calls (at least 3)."""
    tags: dict[str, list[float]] = {}
    for call in calls:
        tags.setdefault(call["tag"], []).append(call["ms"])
    return {tag: statistics.median(ms[-max(3, len(ms) // 4):]) for tag, ms in tags.items()}


def figures(calls: list[dict[str, Any]], first_output_s: float) -> dict[str, Any]:
    """The row's figures from the loop's calls (``t``: seconds after ``torch.compile`` at
    the call's end; ``ms``; ``tag``)."""
    if not calls:
        return {"calls": 0}
    steady = steady_by_tag(calls)
    ratios = [c["ms"] / steady[c["tag"]] for c in calls]
    slow = [c for c, r in zip(calls, ratios) if r > SLOW]
    worst = max(range(len(calls)), key=lambda i: ratios[i])
    full = first_output_s
    streak = 0
    for i, r in enumerate(ratios):
        streak = streak + 1 if r <= NEAR else 0
        if streak == RUN:
            start = i - RUN + 1
            full = calls[start - 1]["t"] if start > 0 else first_output_s
            break
    else:
        full = calls[-1]["t"]  # never settled within the run
    return {"calls": len(calls), "steady_ms": steady,
            "full_speed_s": round(full, 4),
            "slowest_ms": round(calls[worst]["ms"], 4),
            "slowest_ratio": round(ratios[worst], 3),
            "slow_calls": len(slow),
            "last_slow_s": round(slow[-1]["t"], 4) if slow else None,
            "slow_ms_total": round(sum(c["ms"] - steady[c["tag"]] for c in slow), 3)}


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets per Kiln row: no call over 1.5x steady after the first
    output; full speed within 0.6x Inductor's first output; a second process that
    benchmarks nothing."""
    inductor = {r["model"]: r for r in rows if r["mode"] == "inductor" and r.get("ok")}
    out = []
    for row in rows:
        if not row["mode"].startswith("kiln") or not row.get("ok"):
            continue
        check: dict[str, Any] = {"model": row["model"], "mode": row["mode"],
                                 "no_stall": row.get("slow_calls", 1) == 0}
        ref = inductor.get(row["model"])
        if ref is not None:
            check["full_speed_vs_inductor_first_output"] = round(
                row["full_speed_s"] / ref["first_output_s"], 3)
            check["full_speed_target"] = (check["full_speed_vs_inductor_first_output"]
                                          <= TARGET_FULL_SPEED)
        if row["mode"] in ("kiln_farm", "kiln_second"):
            check["client_benchmarked_nothing"] = row.get("client_turns", 0) == 0
        if row["mode"] == "kiln_second":
            check["started_tuned"] = row.get("kiln", {}).get("hits_autotuned", 0) > 0
        out.append(check)
    return out


# ---------------------------------------------------------------------------------------
# One row, in a fresh process.


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _check(loop: Any, refs: dict[str, list[Any]], tag: str, got: list[Any]) -> str:
    """What differs from eager's outputs of variant ``tag`` ("" when nothing does)."""
    from coldstart_models import compare

    result = compare([g.detach() for g in got], refs[tag], loop.tol, loop.outputs)
    return "" if result.ok else f"variant {tag}: {result.problem()}"


def measure(model: str, mode: str, device: str, smoke: bool, seconds: float
            ) -> dict[str, Any]:
    import torch
    from full_speed_models import MODELS, param_count

    torch.manual_seed(0)
    loop = MODELS[model](device, smoke)
    refs = {v.tag: [t.detach().clone() for t in v.step(loop.module)] for v in loop.variants}
    _sync(device)
    torch._dynamo.reset()
    kiln = mode.startswith("kiln")
    if kiln:
        from kiln import KilnFallbackWarning

        warnings.simplefilter("error", KilnFallbackWarning)  # a fallback fails the row
    row: dict[str, Any] = {"model": model, "mode": mode, "note": loop.note,
                           "params_m": round(param_count(loop.module), 1)}
    start = time.perf_counter()
    compiled = torch.compile(loop.module, backend="kiln" if kiln else "inductor")
    problems = []
    for variant in loop.variants:  # the first output: every variant once
        problems.append(_check(loop, refs, variant.tag, variant.step(compiled)))
    _sync(device)
    row["first_output_s"] = round(time.perf_counter() - start, 4)
    calls = []
    end = time.perf_counter() + seconds
    i = 0
    while time.perf_counter() < end:
        variant = loop.variants[i % len(loop.variants)]
        began = time.perf_counter()
        variant.step(compiled)
        _sync(device)
        done = time.perf_counter()
        calls.append({"t": done - start, "ms": 1000 * (done - began), "tag": variant.tag})
        i += 1
    for variant in loop.variants:  # the tuned kernels' outputs too
        problems.append(_check(loop, refs, variant.tag, variant.step(compiled)))
    row.update(figures(calls, row["first_output_s"]))
    if kiln:
        row.update(kiln_figures(start))
    problems = [p for p in problems if p]
    row["ok"] = not problems
    if problems:
        row["problem"] = "; ".join(problems)[:2000]
    return row


def kiln_figures(start: float) -> dict[str, Any]:
    """What Kiln counted in this process: switches to tuned kernels (and how long after
    the first output), tuning's turns on this GPU and the calls they slowed."""
    from kiln.frontend.core.client import _clients, _clients_lock, wait_for_background
    from kiln.workers import gpu_share

    wait_for_background(60)  # what tuning is left publishes (the next process starts tuned)
    with _clients_lock:
        clients = list(_clients.values())
    counters: dict[str, Any] = {}
    for client in clients:
        client.count_gpu_share()
        for name, value in client.counters.snapshot().items():
            if isinstance(value, (int, float)):
                counters[name] = counters.get(name, 0) + value
        client.counters.flush()
    share = gpu_share.current()
    stats = share.stats if share is not None else None
    wall_start = time.time() - (time.perf_counter() - start)  # torch.compile, wall clock
    keep = ("graphs", "hits", "hits_autotuned", "compiles_local", "compiles_farm",
            "hot_swaps", "autotune_publishes", "bucket_tunes", "tuned_took_over_after_max_ms",
            "farm_fallbacks")
    return {"kiln": {k: counters.get(k, 0) for k in keep},
            "client_turns": stats.turns if stats else 0,
            "gpu_share": None if stats is None else {
                "gpu": stats.gpu, "turns": stats.turns, "turn_ms": round(stats.turn_ms, 2),
                "calls_timed": stats.calls_timed, "slowed_calls": stats.slowed_calls,
                "slowed_ms": round(stats.slowed_ms, 3),
                "worst_ratio": round(stats.worst_ratio, 3),
                "first_turn_s": round(stats.first_turn - wall_start, 3) if stats.turns
                else None, "last_turn_s": round(stats.last_turn - wall_start, 3)
                if stats.turns else None}}


# ---------------------------------------------------------------------------------------
# The parent: a process per row, caches per row, one farm for the kiln_farm rows.


def base_env(root: Path, tag: str) -> dict[str, str]:
    env = dict(os.environ)
    for name in ("KILN_FARM", "RAY_ADDRESS", "TRITON_INTERPRET"):
        env.pop(name, None)
    fresh = root / tag
    env.update(KILN_STORE=str(fresh / "store"), KILN_LOCAL_CACHE="off",
               KILN_CACHE_DIR=str(fresh / "kiln-cache"),
               TRITON_CACHE_DIR=str(fresh / "triton"),
               TORCHINDUCTOR_CACHE_DIR=str(fresh / "inductor"),
               KILN_STATS_FILE=str(fresh / "stats.json"),
               KILN_FARM_FILE=str(root / "no-farm" / "farm.json"))
    return env


def env_for(root: Path, model: str, mode: str, farm_file: Path | None) -> dict[str, str]:
    if mode == "kiln_second":  # kiln_inprocess's store, a fresh everything else
        env = base_env(root, f"{model}-kiln_second")
        env["KILN_STORE"] = str(root / f"{model}-kiln_inprocess" / "store")
        env["KILN_FARM"] = "inprocess"
        return env
    env = base_env(root, f"{model}-{mode}")
    if mode == "kiln_inprocess":
        env["KILN_FARM"] = "inprocess"
    elif mode == "kiln_farm" and farm_file is not None:
        env.update(KILN_FARM="local", KILN_FARM_FILE=str(farm_file),
                   KILN_STORE=str(root / "farm" / "store"))
    return env


def run_child(args: argparse.Namespace, model: str, mode: str, env: dict[str, str]
              ) -> dict[str, Any]:
    out = Path(tempfile.mkstemp(suffix=".json")[1])
    command = [sys.executable, __file__, "--child", "--models", model, "--modes", mode,
               "--device", args.device, "--seconds", str(args.seconds), "--out", str(out)]
    if args.smoke:
        command.append("--smoke")
    try:
        proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=args.row_timeout)
    except subprocess.TimeoutExpired:
        return {"model": model, "mode": mode, "ok": False,
                "problem": f"over --row-timeout {args.row_timeout} s"}
    try:
        return dict(json.loads(out.read_text()))
    except (OSError, ValueError):
        tail = (proc.stderr or proc.stdout)[-2000:]
        return {"model": model, "mode": mode, "ok": False,
                "problem": f"exit {proc.returncode}: {tail}"}
    finally:
        out.unlink(missing_ok=True)


def farm(root: Path, up: bool) -> tuple[Path | None, str]:
    """`kiln farm up` (or down) for the kiln_farm rows; its farm file, or why not."""
    env = base_env(root, "farm")
    farm_file = root / "farm" / "farm.json"
    env["KILN_FARM_FILE"] = str(farm_file)
    command = [sys.executable, "-m", "kiln.frontend.cli.main", "farm", "up" if up else "down"]
    if up:
        import torch

        command += ["--num-gpus", str(max(1, torch.cuda.device_count()))] \
            if torch.cuda.is_available() else []
    proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode != 0:
        return None, f"kiln farm {'up' if up else 'down'} failed: {proc.stderr[-1500:]}"
    return farm_file, ""


def parent(args: argparse.Namespace) -> int:
    import torch

    root = Path(args.root or tempfile.mkdtemp(prefix="kiln-full-speed-"))
    models, modes = args.models.split(","), [m for m in MODES if m in args.modes.split(",")]
    rows: list[dict[str, Any]] = []
    for mode in modes:
        farm_file, why = (None, "")
        if mode == "kiln_farm":
            farm_file, why = farm(root, up=True)
        try:
            for model in models:
                if mode == "kiln_farm" and farm_file is None:
                    rows.append({"model": model, "mode": mode, "ok": False, "problem": why})
                    continue
                row = run_child(args, model, mode, env_for(root, model, mode, farm_file))
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
        finally:
            if farm_file is not None:
                farm(root, up=False)
    report = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "torch": torch.__version__, "seconds": args.seconds, "smoke": args.smoke,
              "rows": rows, "targets": targets(rows)}
    text = json.dumps(report, indent=1, default=str)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0 if all(r.get("ok") for r in rows) else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="decoder,encoder_train,vit,convnet,dynamic")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--device", default="cuda")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU run)")
    p.add_argument("--seconds", type=float, default=10.0, help="of calls after the first output")
    p.add_argument("--row-timeout", type=float, default=240.0)
    p.add_argument("--root", default="", help="caches and stores (default: a new temp dir)")
    p.add_argument("--out", default="")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not args.child:
        return parent(args)
    try:
        row = measure(args.models, args.modes, args.device, args.smoke, args.seconds)
    except Exception as e:  # the row fails, naming what failed; the sweep goes on
        import traceback

        row = {"model": args.models, "mode": args.modes, "ok": False,
               "problem": f"{type(e).__name__}: {e}"[:1500],
               "traceback": traceback.format_exc()[-3000:]}
    Path(args.out).write_text(json.dumps(row, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
