"""Small facts about a graph being compiled, and who watches compiles: its tensor
constants, its device, the wrapper and kernels as printed, and the observers told of every
graph compiled in this process (``kiln precompile``'s progress, the AOT cache). The
compile path and regional compilation both use them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from kiln.compiler.compiled_graph import CompiledGraph
    from kiln.frontend.core.client import CompileResult


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

# Observers of every graph compiled in this process (``kiln precompile``'s progress).
observers: list[Callable[[str, CompileResult], None]] = []

def output_code(compiled: CompiledGraph) -> str:
    """The wrapper and every kernel's source, as ``KILN_LOGS=output_code`` prints them."""
    parts = [compiled.wrapper_source]
    for spec in compiled.kernels:
        parts.append(f"# ---- kernel {spec.name} ({spec.backend}, {spec.kind}) ----\n"
                     f"{spec.source}")
    return "\n".join(parts)
