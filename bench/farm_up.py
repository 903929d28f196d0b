"""How long `kiln farm up` takes to be ready: the whole command, from its start to its
exit (when it has printed the farm's address and its gateway answers), over several
runs, each with a fresh cache folder; then how long the first compile through the fresh
farm waits, and `kiln farm down`.

    python3 bench/farm_up.py [--runs 3] [--num-cpus N] [--no-compile] [--json out.json]

Run from the repository root with Kiln installed (`pip install -e .`). Every run is a
new farm (a new Ray head and gateway); nothing else may hold the farm file's folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# One graph compiled through the farm just started: the time a first client waits.
FIRST_COMPILE = """
import sys, time, warnings, torch
import kiln
warnings.simplefilter("error", kiln.KilnFallbackWarning)
from kiln.frontend.core.client import _clients
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
x = torch.randn(4, 32)
start = time.perf_counter()
with torch.no_grad():
    out = torch.compile(model, backend="kiln")(x)
    torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
seconds = time.perf_counter() - start
farm = sum(c.counters.snapshot().get("compiles_farm", 0) for c in _clients.values())
print(f"{seconds:.3f} {farm}")
"""


def _kiln(*argv: str, env: dict[str, str], timeout: float = 600
          ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kiln.frontend.cli.main", *argv], env=env,
                          capture_output=True, text=True, timeout=timeout)


def one_run(num_cpus: int | None, compile_after: bool) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="kiln-farm-up-"))
    env = {**os.environ, "XDG_CACHE_HOME": str(root / "cache"),
           "KILN_STORE": str(root / "store"), "KILN_FARM": "local"}
    env.pop("KILN_FARM_FILE", None)
    argv = ["farm", "up"] + (["--num-cpus", str(num_cpus)] if num_cpus else [])
    start = time.perf_counter()
    up = _kiln(*argv, env=env)
    ready_s = time.perf_counter() - start
    result: dict[str, Any] = {"ready_s": round(ready_s, 3), "ok": up.returncode == 0}
    try:
        if up.returncode != 0:
            result["error"] = (up.stderr or up.stdout).strip()[-500:]
            return result
        status = _kiln("farm", "status", "--json", env=env, timeout=120)
        state = json.loads(status.stdout or "{}")
        result["status_up"] = state.get("up", False)
        if not result["status_up"]:
            result["status_reason"] = state.get("reason")
        if compile_after:
            done = subprocess.run([sys.executable, "-c", FIRST_COMPILE], env=env,
                                  capture_output=True, text=True, timeout=600)
            if done.returncode == 0:
                seconds, farm = done.stdout.split()[-2:]
                result.update(first_compile_s=float(seconds), compiled_on_farm=int(farm))
            else:
                result["compile_error"] = done.stderr.strip()[-500:]
    finally:
        _kiln("farm", "down", env=env, timeout=120)
        shutil.rmtree(root, ignore_errors=True)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--num-cpus", type=int)
    parser.add_argument("--no-compile", action="store_true",
                        help="time `farm up` only, not a first compile through the farm")
    parser.add_argument("--json", help="write the runs and their summary here")
    args = parser.parse_args()
    runs = []
    for i in range(args.runs):
        run = one_run(args.num_cpus, not args.no_compile)
        runs.append(run)
        print(f"run {i + 1}: {json.dumps(run, sort_keys=True)}", flush=True)
    ready = [r["ready_s"] for r in runs if r["ok"]]
    summary = {"runs": len(runs), "ok": len(ready), "cpus": os.cpu_count(),
               "ready_median_s": statistics.median(ready) if ready else None,
               "ready_min_s": min(ready, default=None), "ready_max_s": max(ready, default=None)}
    compiles = [r["first_compile_s"] for r in runs if "first_compile_s" in r]
    if compiles:
        summary["first_compile_median_s"] = statistics.median(compiles)
    print(json.dumps(summary, sort_keys=True))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    failed = len(ready) != len(runs) or any(
        "compile_error" in r or r.get("compiled_on_farm") == 0 or not r.get("status_up")
        for r in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
