"""What joining a farm costs the client's tracing (a benchmark, not a test; issue 10).

AOTAutograd's own time in GPT-2's cold start through a farm was 1.7 s longer than in
process on the H200 host (1.0 s longer on the CPU machine) while a thread of the client
imported Ray and joined the farm. A client now reaches `kiln farm up`'s farm through its
gateway (workers.serve.gateway: a socket and a handshake, no Ray here). This measures the join
alone, each case in a fresh process against the farm that `kiln farm up` started (its
farm file):

    alone     AOTAutograd traces a small transformer (Kiln's decompositions, no compile)
    connect   the gateway's connect and handshake, on the main thread, nothing else running
    gateway   the trace while the client connects to the gateway (the default,
              ``connect_early`` of ``KILN_FARM=local``)
    ray       the trace while a thread imports Ray and joins the farm's cluster (the
              client's join before the gateway; still how a Ray address is joined)
    process   the trace while a child process (frontend.transports.process,
              ``KILN_FARM_PROCESS=1`` with a Ray address) starts and joins

    kiln farm up && python bench/farm_join.py --reps 3 && kiln farm down

Each line gives the trace's wall seconds (median of ``--reps`` fresh processes) and, for
the overlapped cases, how much longer than alone; ``join s`` is how long the connection
took from its start (the median), and ``ray`` whether the client imported Ray.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

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


def start_join():
    # The case's farm, and the thread connecting it.
    from kiln.frontend.transports.modes import LocalFarm, connect_early
    from kiln.workers.ray_farm import RayFarm
    from kiln.workers.serve.farm_files import read_farm_file

    address = str(read_farm_file()["address"])
    if case in ("connect", "gateway"):
        farm = LocalFarm()
    elif case == "ray":
        farm = RayFarm(address)
    else:
        from kiln.frontend.transports.process import ProcessFarm
        farm = ProcessFarm(address)
    return farm, connect_early(farm)


def ask(farm):
    # One call through the connection: it works.
    try:
        farm.ray_farm().stats() if hasattr(farm, "ray_farm") else farm.stats()
    except Exception as e:
        result["problem"] = f"{type(e).__name__}: {e}"


def watch(thread, begun):
    # A thread noting when the join ended (waiting holds no GIL).
    def note():
        thread.join()
        result["join_s"] = time.perf_counter() - begun
    watcher = threading.Thread(target=note)
    watcher.start()
    return watcher


result = {}
if case == "alone":
    start = time.perf_counter()
    trace_once()
    result["seconds"] = time.perf_counter() - start
else:
    begun = time.perf_counter()
    farm, thread = start_join()
    watcher = watch(thread, begun)
    if case == "connect":
        watcher.join()
        result["seconds"] = result["join_s"]
    else:
        start = time.perf_counter()
        trace_once()
        result["seconds"] = time.perf_counter() - start
        watcher.join()
    ask(farm)
result["ray_here"] = "ray" in sys.modules
print(json.dumps(result))
"""


def run_case(case: str, layers: int) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", CHILD, case, str(layers)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{proc.stderr[-3000:]}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--layers", type=int, default=12)
    args = p.parse_args(argv)
    from kiln.workers.farm_api import probe
    from kiln.workers.serve.farm_files import read_farm_file

    info = read_farm_file()
    if info is None or probe(str(info.get("gateway") or info["address"])) is not None:
        print("no farm is up: run `kiln farm up` first", file=sys.stderr)
        return 2
    cases = ("alone", "connect", "gateway", "ray", "process")
    rows: dict[str, list[dict[str, Any]]] = {case: [] for case in cases}
    for _ in range(args.reps):  # interleaved, so that a busy machine hits every case
        for case in cases:
            rows[case].append(run_case(case, args.layers))
    alone = statistics.median(r["seconds"] for r in rows["alone"])
    print(f"{'case':<10}{'median s':>10}{'vs alone':>10}{'join s':>9}{'ray':>6}   runs")
    for case, runs in rows.items():
        median = statistics.median(r["seconds"] for r in runs)
        versus = f"{median - alone:+.2f}" if case not in ("alone", "connect") else ""
        joins = [r["join_s"] for r in runs if "join_s" in r]
        join = f"{statistics.median(joins):.3f}" if joins else ""
        ray = "yes" if any(r["ray_here"] for r in runs) else "no"
        print(f"{case:<10}{median:>10.2f}{versus:>10}{join:>9}{ray:>6}   "
              + " ".join(f"{r['seconds']:.2f}" for r in runs))
        for problem in {r["problem"] for r in runs if "problem" in r}:
            print(f"  {case}: {problem}")
    print(time.strftime("%H:%M:%S"), f"{args.layers} layers, {args.reps} reps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
