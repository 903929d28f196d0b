"""The README's main job: compile the seed example and show each stage's result.

    python -m kiln.frontend.cli.demo          the compiler's stages on the seed example
    python -m kiln.frontend.cli.demo farm     the whole path: a cold compile (KILN_FARM, by
                                     default Kiln's own default: in process, or on the
                                     farm of `kiln farm up` if one is up), then a second
                                     process that hits the store and compiles nothing
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kiln.compiler import debug
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import lower_and_schedule
from kiln.compiler.interpreter import run_graph
from kiln.compiler.memory import describe


def seed_fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return ((a + b) * c.relu()).sum(dim=-1)


def main() -> None:
    args = [torch.randn(64, 128) for _ in range(3)]
    gm = trace_aten(seed_fn, args)
    print("== ATen FX graph ==")
    print(gm.graph)
    sg = lower_and_schedule(gm, args, name="seed")
    print("== loop-level IR ==")
    print(debug.ir_str(sg.graph.buffers))
    print("== schedule (after fusion) ==")
    print(sg.scheduler.debug_str())
    print("== buffer lifetimes ==")
    print(describe(sg.memory, sg.scheduler.nodes))
    (out,) = run_graph(sg.graph, args)
    torch.testing.assert_close(out, seed_fn(*args))
    print("== IR interpreter matches eager ==")


# ---------------------------------------------------------------------------------------
# The farm demo.


class Block(torch.nn.Module):
    """A small pre-norm MLP block: a layer norm, two matmuls and a softmax gate."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.nn.functional.gelu(self.up(self.norm(x))))
        return x + h * torch.softmax(h, dim=-1)


class TwoBlocks(torch.nn.Module):
    """Two blocks with a graph break between them: two graphs for the farm."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Block(), Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        torch._dynamo.graph_break()
        return self.second(x)


def farm_client() -> None:
    """One process of the farm demo: compile, run, check, print what happened."""
    from kiln.frontend.core.client import _clients
    from kiln.frontend.core.graphs import observers

    keys: list[str] = []

    def report(name: str, result: Any) -> None:
        keys.append(result.key.key)
        print(f"  graph {name:<12} key {result.key.key[:16]}  {result.source:<5} "
              f"{len(result.compiled.kernels):>2} kernels  "
              f"{1000 * result.timings.get('backend_s', 0):8.1f} ms", flush=True)

    observers.append(report)
    torch.manual_seed(0)
    model, x = TwoBlocks().eval(), torch.randn(32, 64)
    start = time.perf_counter()
    with torch.no_grad():
        out = torch.compile(model, backend="kiln")(x)
        torch.testing.assert_close(out, model(x), rtol=1e-4, atol=1e-4)
    counters: dict[str, Any] = {}
    for client in _clients.values():
        counters.update(client.counters.snapshot())
        client.counters.flush()
    ray_started = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    print(json.dumps({"counters": counters, "ray_started": ray_started, "keys": keys,
                      "seconds": time.perf_counter() - start}))


def _run_client(env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "kiln.frontend.cli.demo", "farm-client"], env=env,
                          stdout=subprocess.PIPE, text=True)
    lines = proc.stdout.rstrip().splitlines()
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the demo's client failed ({proc.returncode})")
    for line in lines[:-1]:
        print(line)
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def kiln_command() -> str:
    """How to run `kiln` from any shell, active environment or not: the full path of the
    script beside this Python, else this Python running the CLI's module."""
    beside = Path(sys.executable).parent / "kiln"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return f"{sys.executable} -m kiln.frontend.cli.main"


def demo_farm() -> str:
    """The farm the demo uses: KILN_FARM if set, else Kiln's default."""
    from kiln.frontend.config import SETTINGS

    return os.environ.get("KILN_FARM") or str(SETTINGS["farm"].default)


def farm_demo() -> None:
    root = Path(os.environ.get("KILN_DEMO_DIR") or tempfile.mkdtemp(prefix="kiln-demo-"))
    farm = demo_farm()
    env = {**os.environ, "KILN_STORE": str(root / "store"),
           "XDG_CACHE_HOME": str(root / "cache"), "KILN_FARM": farm}
    print(f"store {env['KILN_STORE']}; farm {farm}" + (
        " (the default: a miss compiles in this process, or on the farm of `kiln farm up` "
        "when one is up; KILN_FARM=embedded starts a Ray here)" if farm == "local" else ""))
    print("== 1. cold start: every graph misses and compiles ==")
    cold = _run_client(env)
    c = cold["counters"]
    print(f"  {c.get('graphs', 0)} graphs: {c.get('compiles_farm', 0)} compiled on a farm, "
          f"{c.get('compiles_local', 0)} in process; {c.get('kernels_compiled', 0)} kernel "
          f"binaries, {cold['seconds']:.1f} s")
    print("== 2. warm start: a second process with the same model and store ==")
    warm = _run_client(env)
    w = warm["counters"]
    print(f"  {w.get('hits', 0)} hits, {w.get('compiles', 0)} compiles, Ray started: "
          f"{warm['ray_started']}, {warm['seconds']:.1f} s")
    if w.get("compiles", 0) or w.get("hits", 0) != w.get("graphs", -1) or warm["ray_started"]:
        raise SystemExit("the second process compiled something: the store missed")
    print("== the second process compiled nothing: every graph came from the store ==")
    kiln = kiln_command()
    print("look inside (any shell; the environment need not be active):")
    print(f"  KILN_STORE={env['KILN_STORE']} {kiln} inspect {warm['keys'][0]}")
    print(f"  XDG_CACHE_HOME={env['XDG_CACHE_HOME']} {kiln} stats")


if __name__ == "__main__":
    command = sys.argv[1] if len(sys.argv) > 1 else ""
    if command == "farm":
        farm_demo()
    elif command == "farm-client":
        farm_client()
    else:
        main()
