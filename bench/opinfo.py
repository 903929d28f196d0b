"""PyTorch's OpInfo database through ``backend="kiln"``: a coverage and correctness run.

Each op's first samples are compiled with Kiln, run, and compared with eager; a graph that
Kiln ran eagerly (``KilnFallbackWarning``) counts as a failure. Prints a summary (every op
that did not pass, with why) and writes JSON.

    python3 bench/opinfo.py --device cpu --dtypes float32 --json opinfo_cpu.json
    KILN_CPU_BACKEND=triton-interpret TRITON_INTERPRET=1 python3 bench/opinfo.py --fast
    KILN_FARM=inprocess python3 bench/opinfo.py --device cuda --jobs 14 \
        --dtypes float32,bfloat16,float16 --json opinfo_h200.json

``--jobs N`` runs N processes, each a round-robin shard of the ops (``--shard I/N``), and
merges their results.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("KILN_FARM", "inprocess")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtypes", default="float32", help="comma-separated dtype names")
    parser.add_argument("--samples", type=int, default=3, help="samples per op")
    parser.add_argument("--fast", action="store_true", help="only the CI subset of ops")
    parser.add_argument("--ops", default="", help="comma-separated op names (OpInfo names)")
    parser.add_argument("--slice", default="", help="START:STOP of the selected ops (op_db "
                        "order), to run the database in parts")
    parser.add_argument("--json", default="", help="write the results here")
    parser.add_argument("--jsonl", default="", help="append each op's result here as it "
                        "comes (a run cut short keeps what it did)")
    parser.add_argument("--shard", default="", help="I/N: every N-th op from the I-th")
    parser.add_argument("--jobs", type=int, default=1, help="processes, each a shard")
    parser.add_argument("--budget", type=float, default=0.0, help="seconds: ops not "
                        "started by then are reported not_reached (a partial run)")
    parser.add_argument("--deadline", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--quiet", action="store_true", help="no line per op")
    args = parser.parse_args(argv)
    if args.budget and not args.deadline:
        args.deadline = time.time() + args.budget
    if args.jobs > 1:
        return run_sharded(args)

    import torch

    from tests.opinfo_harness import format_summary, run_ops

    ops = chosen_ops(args)
    backend = _backend(args)
    report = _report_header(args)
    failed_target = False
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)

        def progress(r: object) -> None:
            if args.jsonl:
                with open(args.jsonl, "a") as f:
                    f.write(json.dumps(asdict(r)) + "\n")  # type: ignore[call-overload]
            if not args.quiet:
                print(f"{r.status:8s} {r.op} ({r.seconds:.1f} s) {r.detail[:200]}",  # type: ignore[attr-defined]
                      flush=True)

        start = time.perf_counter()
        summary = run_ops(ops, args.device, dtype, backend, args.samples, progress,
                          args.deadline or None)
        print(format_summary(summary))
        print(f"({time.perf_counter() - start:.0f} s)")
        report["runs"].append(summary.to_json())  # type: ignore[attr-defined]
        failed_target |= summary.counts().get("wrong", 0) > 0
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if failed_target else 0


def chosen_ops(args: argparse.Namespace) -> list[Any]:
    """The OpInfos the arguments select: names or the CI subset, then slice, then shard."""
    from tests.opinfo_harness import FAST_OPS, select_ops

    names = [n for n in args.ops.split(",") if n] or (list(FAST_OPS) if args.fast else None)
    ops = select_ops(names)
    if args.slice:
        start_s, _, stop_s = args.slice.partition(":")
        ops = ops[int(start_s or 0):int(stop_s) if stop_s else None]
    if args.shard:
        index, _, count = args.shard.partition("/")
        ops = ops[int(index)::int(count)]
    return ops


def _backend(args: argparse.Namespace) -> str:
    return os.environ.get("KILN_CPU_BACKEND", "cpp") if args.device == "cpu" else "triton"


def _report_header(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "torch": torch.__version__, "python": platform.python_version(),
            "host": platform.node(), "samples": args.samples, "jobs": args.jobs, "runs": []}


def run_sharded(args: argparse.Namespace) -> int:
    """``args.jobs`` processes of this script, shard I of N each, their results merged in
    the database's order. A shard that dies leaves its remaining ops ``missing``."""
    from tests.opinfo_harness import OpResult, Summary, format_summary, full_name

    order = [full_name(op) for op in chosen_ops(args)]
    folder = Path(tempfile.mkdtemp(prefix="opinfo_shards_"))
    start = time.perf_counter()
    procs = []
    for i in range(args.jobs):
        cmd = [sys.executable, __file__, "--device", args.device, "--dtypes", args.dtypes,
               "--samples", str(args.samples), "--ops", args.ops, "--slice", args.slice,
               "--shard", f"{i}/{args.jobs}", "--jsonl", str(folder / f"{i}.jsonl"),
               "--deadline", str(args.deadline)]
        cmd += ["--fast"] if args.fast else []
        log = open(folder / f"{i}.log", "w")  # noqa: SIM115 - closed after the wait
        procs.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), log))
    for i, (proc, log) in enumerate(procs):
        rc = proc.wait()
        log.close()
        if rc not in (0, 1):
            tail = (folder / f"{i}.log").read_text(errors="replace")[-2000:]
            print(f"shard {i}/{args.jobs} exited {rc}; its log ends:\n{tail}", flush=True)
    rows = [json.loads(line) for i in range(args.jobs) if (folder / f"{i}.jsonl").exists()
            for line in (folder / f"{i}.jsonl").read_text().splitlines()]
    report = _report_header(args)
    failed_target = False
    for dtype_name in args.dtypes.split(","):
        done = {r["op"]: OpResult(**r) for r in rows if r["dtype"] == dtype_name}
        summary = Summary(args.device, dtype_name, _backend(args), [
            done.get(name) or OpResult(name, dtype_name, "missing", detail="its shard died")
            for name in order])
        print(format_summary(summary))
        report["runs"].append(summary.to_json())
        failed_target |= summary.counts().get("wrong", 0) + summary.counts().get(
            "missing", 0) > 0
    print(f"({time.perf_counter() - start:.0f} s, {args.jobs} processes; logs in {folder})")
    if args.jsonl:
        with open(args.jsonl, "a") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 1 if failed_target else 0


if __name__ == "__main__":
    sys.exit(main())
