"""The README's main job: compile the seed example and show each stage's result."""

from __future__ import annotations

import torch

from compiler import debug
from compiler.decompositions import trace_aten
from compiler.driver import lower_and_schedule
from compiler.interpreter import run_graph
from compiler.memory import describe


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


if __name__ == "__main__":
    main()
