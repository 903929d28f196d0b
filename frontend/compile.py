"""Compile an ATen graph for the client: in this process for now, then load it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from compiler.compiled_graph import load
from compiler.driver import compile_graph

from .config import KilnConfig


def graph_constants(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """Tensor constants of ``gm`` by the names the compiler gives them (in node order)."""
    out: dict[str, torch.Tensor] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value: Any = gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        if isinstance(value, torch.Tensor):
            out[f"_tensor_constant{len(out)}"] = value
    return out


def input_device(example_inputs: Sequence[Any]) -> torch.device:
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            return x.device
    return torch.device("cpu")


def compile_and_load(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                     config: KilnConfig, name: str) -> Callable[..., Any]:
    options = {**config.compiler_options(), **config.debug_options()}
    compiled = compile_graph(gm, example_inputs, options, name=name)
    return load(compiled, graph_constants(gm), input_device(example_inputs))
