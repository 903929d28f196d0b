"""What joining a farm costs the client's tracing (a benchmark, not a test; issue 10).

AOTAutograd's own time in GPT-2's cold start through a farm was 1.7 s longer than in
process on the H200 host (1.0 s longer on the CPU machine) while a thread of the client
imported Ray and joined the farm. This measures that cause alone, each case in a fresh
process against the farm that `kiln farm up` started (its farm file):

    alone     AOTAutograd traces a small transformer (Kiln's decompositions, no compile)
    join      Ray's import and the join, on the main thread with nothing else running
    thread    the trace while a thread imports Ray and joins (the default,
              ``KILN_FARM_PROCESS=0``)
    process   the trace while the client's farm process (frontend.farm_process) starts
              and joins (``KILN_FARM_PROCESS=1``; slower to join on the H200 host:
              BENCHMARKS.md, 2026-12-02 01:34)

    kiln farm up && python bench/farm_join.py --reps 3 && kiln farm down

Each line gives the trace's wall seconds (median of ``--reps`` fresh processes) and, for
thread and process, how much longer than alone.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = """
import json, os, sys, threading, time
import torch
from torch._dynamo.backends.common import aot_autograd
from kiln.compiler.decompositions import kiln_decompositions

case = sys.argv[1]
layers = int(sys.argv[2])


class Block(torch.nn.Module):  # a GPT-2 layer's shape: attention and MLP, pre-norm
    def __init__(self, d: int = 256) -> None:
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(d), torch.nn.LayerNorm(d)
        self.qkv, self.proj = torch.nn.Linear(d, 3 * d), torch.nn.Linear(d, d)
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], -1)
        att = torch.softmax(q @ k.transpose(-1, -2) / 16.0, -1)
        x = x + self.proj(att @ v)
        return x + self.down(torch.nn.functional.gelu(self.up(self.ln2(x))))


class Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.Sequential(*[Block() for _ in range(layers)])

    def forward(self, x):
        return (self.blocks(x),)  # AOTAutograd's graphs return tuples


model = Stack()
x = torch.randn(2, 64, 256)


def trace_once():
    graph = torch.fx.symbolic_trace(model)
    compiled = aot_autograd(fw_compiler=lambda g, _: g, decompositions=kiln_decompositions())
    with torch.no_grad():
        compiled(graph, [x])


def join_in_thread():
    from kiln.frontend.farm import LocalFarm, connect_early
    thread = connect_early(LocalFarm())
    return thread

def join_in_process():
    from kiln.frontend.farm import LocalFarm, connect_early
    farm = LocalFarm()
    connect_early(farm)
    return farm

result = {}
if case == "join":
    start = time.perf_counter()
    join_in_thread().join()
    result["seconds"] = time.perf_counter() - start
else:
    helper = None
    if case == "thread":
        helper = join_in_thread()
    elif case == "process":
        helper = join_in_process()
    start = time.perf_counter()
    trace_once()
    result["seconds"] = time.perf_counter() - start
    result["ray_here"] = "ray" in sys.modules
    if isinstance(helper, threading.Thread):
        helper.join()
print(json.dumps(result))
"""


def run_case(case: str, layers: int, extra_env: dict[str, str]) -> dict[str, float]:
    import os

    env = {**os.environ, **extra_env}
    proc = subprocess.run([sys.executable, "-c", CHILD, case, str(layers)], env=env,
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{proc.stderr[-3000:]}")
    out: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layers", type=int, default=12)
    args = p.parse_args(argv)
    from kiln.frontend.farm import probe, read_farm_file

    info = read_farm_file()
    if info is None or probe(str(info["address"])) is not None:
        print("no farm is up: run `kiln farm up` first", file=sys.stderr)
        return 2
    cases = {"alone": {}, "join": {"KILN_FARM_PROCESS": "0"},
             "thread": {"KILN_FARM_PROCESS": "0"}, "process": {"KILN_FARM_PROCESS": "1"}}
    seconds: dict[str, list[float]] = {case: [] for case in cases}
    for _ in range(args.reps):  # interleaved, so that a busy machine hits every case
        for case, env in cases.items():
            seconds[case].append(run_case(case, args.layers, env)["seconds"])
    alone = statistics.median(seconds["alone"])
    print(f"{'case':<10}{'median s':>10}{'vs alone':>10}   runs")
    for case, runs in seconds.items():
        median = statistics.median(runs)
        versus = f"{median - alone:+.2f}" if case in ("thread", "process") else ""
        print(f"{case:<10}{median:>10.2f}{versus:>10}   " + " ".join(f"{r:.2f}" for r in runs))
    print(time.strftime("%H:%M:%S"), f"{args.layers} layers, {args.reps} reps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
