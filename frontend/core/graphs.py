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
    """The device of the inputs: a GPU's where any input is on one (a CPU scalar tensor
    beside GPU tensors is eager's "CPU scalar", not a CPU graph), else the CPU."""
    devices = [x.device for x in example_inputs if isinstance(x, torch.Tensor)]
    return next((d for d in devices if d.type == "cuda"), devices[0] if devices
                else torch.device("cpu"))


def graph_device(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> torch.device:
    """The device a graph computes on: its inputs' (``input_device``), or, where no input
    is on a GPU, a GPU any of its values is made on (a graph that builds a mask from sizes
    alone takes no tensor, or CPU tensors only, and makes CUDA tensors)."""
    device = input_device(example_inputs)
    if device.type == "cuda":
        return device
    for node in gm.graph.nodes:
        value = node.meta.get("val", node.meta.get("example_value"))
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, torch.Tensor) and v.device.type == "cuda":
                return v.device
    return device

# Observers of every graph compiled in this process (``kiln precompile``'s progress).
observers: list[Callable[[str, CompileResult], None]] = []

def output_code(compiled: CompiledGraph) -> str:
    """The wrapper and every kernel's source, as ``KILN_LOGS=output_code`` prints them."""
    parts = [compiled.wrapper_source]
    for spec in compiled.kernels:
        parts.append(f"# ---- kernel {spec.name} ({spec.backend}, {spec.kind}) ----\n"
                     f"{spec.source}")
    return "\n".join(parts)
