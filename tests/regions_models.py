"""A model of identical residual blocks, for the regional-compilation tests (CPU and
farm): an input projection, ``layers`` pre-norm MLP blocks, a head. Each block's ATen
forward graph has ``BLOCK_NODES`` nodes, and one value (the residual stream) is live
between blocks."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

BLOCK_NODES = 19  # ATen nodes of one block's inference graph (checked by a test)


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class Stack(nn.Module):
    def __init__(self, d: int = 16, layers: int = 6, d_in: int = 8, d_out: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def aten_graph(model: nn.Module, x: torch.Tensor) -> tuple[torch.fx.GraphModule, list[Any]]:
    """The inference ATen graph of ``model`` with its parameters as inputs (as
    AOTAutograd gives it), and its example inputs."""
    from kiln.compiler.decompositions import trace_aten

    params = dict(model.named_parameters())

    def forward(x: torch.Tensor, *flat: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, dict(zip(params, flat)), (x,))

    args = [x, *params.values()]
    with torch.no_grad():
        return trace_aten(forward, args), args


def fail_second_region_compile(monkeypatch: Any) -> None:
    """The second region compile of the test raises a compile fault (a lowering of
    aten.addmm), the others compile: a region that fails, beside regions that do not."""
    import threading

    from kiln.compiler.errors import KilnCompileError
    from kiln.workers import pipeline

    real = pipeline.compile_sources
    calls = {"n": 0}
    lock = threading.Lock()

    def second_fails(request_bytes: bytes, key: str, **kwargs: Any) -> Any:
        with lock:
            calls["n"] += 1
            fail = calls["n"] == 2
        if fail:
            raise KilnCompileError("injected fault", stage="lowering", op="aten.addmm")
        return real(request_bytes, key, **kwargs)

    monkeypatch.setattr(pipeline, "compile_sources", second_fails)
