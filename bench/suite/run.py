"""The model suite (a benchmark, not a test): real HF transformers, timm and torchvision
models, each row a model in one mode under eager, Inductor and Kiln, in a fresh process
with fresh caches (``bench/suite/row.py`` says what a row measures).

    python3 bench/suite/run.py --mode inference --backends eager,inductor,kiln \\
        --shard 1/6 --json /tmp/out/s1.json
    python3 bench/suite/run.py --tiny --device cpu --models hf_bert,timm_resnet50 \\
        --backends eager,kiln --json /tmp/tiny.json       # CPU, tiny configs
    python3 bench/suite/report.py /tmp/out/s*.json        # merge shards, summary, plot

Rows go round-robin to shards (``--shard i/n``), so each shard gets a mix of sizes.
``--parallel N`` runs N rows at once, each in its own process, spread round-robin over the
host's GPUs (a row's eager, Inductor and Kiln figures still come from one process on one
card; compiles of neighbouring rows share the host's cores). With more rows than GPUs,
rows share a card: the result says ``"gpu_shared": true`` and its times are a survey
(pass, fallbacks, launches, memory), not figures a target is met on.
``--budget S`` starts no row after S seconds and prints the ``--models`` list of the rows
left.
A row that fails records its error and the run goes on; the JSON is rewritten after
every row, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
MODES = ("inference", "train", "dynamic")
ROW_RESULT = "SUITE_ROW "


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", help="comma-separated names or suites (hf, timm, "
                   "torchvision); default: all")
    p.add_argument("--mode", choices=MODES, default="inference")
    p.add_argument("--backends", default="eager,inductor,kiln")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--shard", default="1/1", help="i/n: the i-th of n shards")
    p.add_argument("--tiny", action="store_true", help="tiny configs (CPU CI)")
    p.add_argument("--device", default=None, help="cuda (default if present) or cpu")
    p.add_argument("--row-timeout", type=float, default=900.0, help="seconds per row")
    p.add_argument("--reps", type=int, default=None, help="timed calls per backend")
    p.add_argument("--parallel", type=int, default=1,
                   help="rows at once, round-robin over the GPUs (CUDA_VISIBLE_DEVICES)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds: start no row after this; the rows left are listed")
    p.add_argument("--interleave", action="store_true",
                   help="alternate the suites (hf, timm, torchvision) in the row order, so a "
                   "run cut short by --budget covers each")
    p.add_argument("--commit", help="the commit to record (default: git's HEAD here; a "
                   "copy of the tree whose .git is older than its files needs it)")
    p.add_argument("--list", action="store_true", help="print the rows and exit")
    p.add_argument("--child", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def shard_of(rows: list[Any], shard: str) -> list[Any]:
    i, n = (int(x) for x in shard.split("/"))
    if not 1 <= i <= n:
        raise SystemExit(f"--shard {shard}: want i/n with 1 <= i <= n")
    return rows[i - 1::n]


def interleaved(rows: list[Any]) -> list[Any]:
    """The rows with their suites taken in turn, each suite's in its own order."""
    queues: dict[str, list[Any]] = {}
    for row in rows:
        queues.setdefault(row.suite, []).append(row)
    out: list[Any] = []
    while any(queues.values()):
        for queue in queues.values():
            if queue:
                out.append(queue.pop(0))
    return out


def options(args: argparse.Namespace, device: str) -> dict[str, Any]:
    cuda = device.startswith("cuda")
    return {"reps": args.reps or (40 if cuda else 3), "blocks": 4 if cuda else 1,
            "settle_cap_s": 15.0 if cuda else 0.0, "settle_calls": 10 if cuda else 2}


def child(args: argparse.Namespace) -> int:
    """One row, in this process; prints its result on one line."""
    import torch

    from bench.suite.models import MODELS
    from bench.suite.row import error_text, run_row

    device = args.device
    spec = MODELS[args.child]
    row: dict[str, Any] = {"model": spec.name, "suite": spec.suite, "mode": args.mode,
                           "tiny": args.tiny, "device": device,
                           "dtype": str(spec.dtype).removeprefix("torch."),
                           "optimizer": spec.optimizer if args.mode == "train" else None,
                           "torch": torch.__version__}
    if device.startswith("cuda"):
        row["card"] = torch.cuda.get_device_name()
    t0 = time.perf_counter()
    try:
        row.update(run_row(spec, args.mode, args.backends.split(","), args.tiny, device,
                           options(args, device)))
    except Exception as exc:
        row["error"] = error_text(exc)
    row["row_s"] = round(time.perf_counter() - t0, 2)
    print(ROW_RESULT + json.dumps(row), flush=True)
    return 0


def fresh_env(folder: Path) -> dict[str, str]:
    """Empty caches for every compiler: Inductor's, Triton's and Kiln's."""
    env = dict(os.environ)
    for var, sub in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"),
                     ("KILN_STORE", "kiln-store"), ("KILN_CACHE_DIR", "kiln-cache")):
        (folder / sub).mkdir(mode=0o700)
        env[var] = str(folder / sub)
    env["KILN_LOCAL_CACHE"] = "off"
    env["KILN_STATS_FILE"] = "off"
    env.setdefault("KILN_FARM", "inprocess")
    return env


def run_one(name: str, args: argparse.Namespace, device: str,
            gpu: int | None = None) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--mode",
           args.mode, "--backends", args.backends, "--device", device]
    cmd += ["--tiny"] if args.tiny else []
    cmd += ["--reps", str(args.reps)] if args.reps else []
    base = {"model": name, "mode": args.mode, "tiny": args.tiny, "device": device}
    with tempfile.TemporaryDirectory(prefix="kiln-suite-") as tmp:
        env = fresh_env(Path(tmp))
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        try:
            done = subprocess.run(cmd, env=env, capture_output=True,
                                  text=True, timeout=args.row_timeout, cwd=ROOT)
        except subprocess.TimeoutExpired:
            return {**base, "error": f"row timed out after {args.row_timeout:.0f} s"}
    for line in done.stdout.splitlines():
        if line.startswith(ROW_RESULT):
            return json.loads(line[len(ROW_RESULT):])
    tail = (done.stderr or done.stdout)[-2000:]
    return {**base, "error": f"row process exited {done.returncode}: {tail}"}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        return child(args)
    from bench.suite.models import select

    rows = shard_of(select(args.models, args.mode), args.shard)
    if args.interleave:
        rows = interleaved(rows)
    if args.list:
        print("\n".join(m.name for m in rows))
        return 0
    result: dict[str, Any] = {"mode": args.mode, "backends": args.backends.split(","),
                              "shard": args.shard, "commit": args.commit or commit(),
                              "tiny": args.tiny,
                              "device": args.device, "rows": []}
    left = run_rows([m.name for m in rows], args, result)
    if left:
        print(f"budget spent; rows not run: --models {','.join(left)}")
    return 0


def run_rows(names: list[str], args: argparse.Namespace, result: dict[str, Any]
             ) -> list[str]:
    """Each row in its own process, ``--parallel`` at once (one GPU each); returns the
    rows the budget left unstarted."""
    start = time.monotonic()
    lock = threading.Lock()
    queue = list(names)
    left: list[str] = []

    def worker(gpu: int | None) -> None:
        while True:
            with lock:
                if not queue:
                    return
                if args.budget is not None and time.monotonic() - start > args.budget:
                    left.extend(queue)
                    queue.clear()
                    return
                name = queue.pop(0)
            row = run_one(name, args, args.device, gpu)
            with lock:
                record(row, args, result)

    gpus: list[int | None] = [None]
    if args.parallel > 1:
        cards = gpu_count(args.device)
        gpus = [i % cards for i in range(args.parallel)] if cards else [None] * args.parallel
        result["gpu_shared"] = bool(cards) and args.parallel > cards
    threads = [threading.Thread(target=worker, args=(g,)) for g in gpus]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return left


def gpu_count(device: str) -> int:
    if not device.startswith("cuda"):
        return 0
    import torch

    return torch.cuda.device_count()


def record(row: dict[str, Any], args: argparse.Namespace, result: dict[str, Any]) -> None:
    result["rows"].append(row)
    if row.get("card"):
        result.setdefault("card", row["card"])
    print(summary_line(row), flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


def summary_line(row: dict[str, Any]) -> str:
    parts = [f"{row['model']:<36}"]
    if "error" in row:
        return parts[0] + " ERROR " + row["error"].splitlines()[-1][:200]
    for name, b in row.get("backends", {}).items():
        state = "ok" if b.get("ok") else "FAIL"
        ms = b.get("steady_ms")
        parts.append(f"{name} {state}" + (f" {ms:.2f}ms" if ms is not None else ""))
        if not b.get("ok"):
            why = b.get("error") or b.get("accuracy") or ""
            parts.append(f"({why.splitlines()[-1][:160] if why else ''})")
    return " | ".join(parts)


if __name__ == "__main__":
    sys.exit(main())
