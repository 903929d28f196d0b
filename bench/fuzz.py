"""Fuzz run (not a test): tests/unit/test_fuzz_wire.py's properties at full size, 10,000
examples each by default: bytes sent to the gateway before its handshake, authenticated
frames, and hostile compile requests through the coordinator's and a worker's decoders
(issue 33). Every example has hypothesis's 5 s deadline; the run fails on any crash,
hang or code run, and prints one JSON line: examples per property, seconds, pytest's exit
status.

    python3 bench/fuzz.py [--examples 10000] [--only frames|requests]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = "tests/unit/test_fuzz_wire.py"
SELECT = {"frames": "gateway or frames", "requests": "requests"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=10_000)
    parser.add_argument("--only", choices=sorted(SELECT))
    args = parser.parse_args()
    env = dict(os.environ, KILN_FUZZ_EXAMPLES=str(args.examples),
               KILN_FUZZ_REQUEST_EXAMPLES=str(args.examples),
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "pytest", TESTS, "-q", "-p", "no:cacheprovider",
               "--hypothesis-show-statistics"]
    if args.only:
        command += ["-k", SELECT[args.only]]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, env=env)
    print(json.dumps({"examples_per_property": args.examples, "only": args.only,
                      "seconds": round(time.perf_counter() - start, 1),
                      "pytest_exit": proc.returncode}))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
