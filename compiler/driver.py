"""The compiler's driver: every pass, in order, one comment each.

Reading ``lower_and_schedule`` tells the whole front half of the pipeline; the code
generators continue from the ``ScheduledGraph`` it returns.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import debug, trace
from .codegen.cpp.build import DEFAULT_ISA
from .codegen.simd import SIMDScheduling
from .codegen.triton.row_column import TritonScheduling
from .compiled_graph import CompiledGraph
from .errors import KilnCompileError
from .graph import GraphLowering
from .ir.template import GemmSelection, record_gemm_choices
from .kernel_compile import compile_kernel
from .memory import MemoryPlan, describe, plan_memory
from .runtime.kernel_files import write_source
from .scheduler import Scheduler
from .sizevars import SizeVars, SymbolRange, size_symbol
from .virtualized import V

DEFAULT_TARGETS: dict[str, dict[str, Any]] = {
    "cuda": {"kind": "cuda", "backend": "cuda", "arch": 90, "warp_size": 32, "sm_count": 132},
    "cpu": {"kind": "cpu", "isa": DEFAULT_ISA}}


@dataclass
class ScheduledGraph:
    """A lowered, fused and memory-planned graph: everything codegen needs."""

    graph: GraphLowering
    scheduler: Scheduler
    memory: MemoryPlan
    timings: dict[str, float] = field(default_factory=dict)
    debug_dir: Path | None = None


def lower_and_schedule(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                       name: str = "graph", options: dict[str, Any] | None = None,
                       target: dict[str, Any] | None = None,
                       symbols: Sequence[SymbolRange] = ()) -> ScheduledGraph:
    """FX graph -> loop-level IR -> scheduled, fused nodes -> memory plan.

    ``symbols`` are the ranges of the size symbols ``s0, s1, ...`` of a graph with
    dynamic shapes (its inputs' sizes are sympy expressions over them)."""
    timings: dict[str, float] = {}
    folder = debug.debug_dir(name, options) if debug.debug_enabled(options) else None
    debug.write_debug_file(folder, "fx_graph.txt",
                           lambda: gm.print_readable(print_output=False))
    sizevars = SizeVars({size_symbol(i): r for i, r in enumerate(symbols)})
    graph = GraphLowering(gm, example_inputs, name, options, target, sizevars)
    # Matmuls: extern calls, or (max-autotune) the template configs chosen for them.
    graph.gemm_selection = gemm_selection(graph, options or {}, target)
    with V.set_graph_handler(graph):
        t = time.perf_counter()
        with trace.span("lowering", cat="compiler", graph=name):
            # 1. Lowering: FX nodes -> TensorBoxes of lazy loops; realize() names buffers.
            graph.run()
            # 2. Layouts: every buffer whose strides are still free becomes contiguous.
            graph.finalize_layouts()
        timings["lowering"] = time.perf_counter() - t
        debug.write_debug_file(folder, "ir_pre_fusion.txt",
                               lambda: debug.ir_str(graph.buffers))
        t = time.perf_counter()
        with trace.span("scheduling and fusion", cat="compiler", graph=name):
            # 3. Scheduler nodes: read_writes of each buffer, dependencies, dead nodes out.
            scheduler = Scheduler(graph.buffers, backend=scheduling_backend(graph))
            # 4. Fusion: vertical and horizontal, by score, never making a cycle.
            scheduler.fuse_nodes()
        timings["scheduling"] = time.perf_counter() - t
        debug.write_debug_file(folder, "ir_post_fusion.txt", scheduler.debug_str)
        t = time.perf_counter()
        with trace.span("memory plan", cat="compiler", graph=name):
            # 5. Memory plan: last uses, in-kernel buffers, reuse, peak estimate.
            memory = plan_memory(scheduler)
        timings["memory_plan"] = time.perf_counter() - t
        debug.write_debug_file(folder, "schedule.txt", lambda: scheduler.debug_str() + "\n\n"
                               + describe(memory, scheduler.nodes))
    return ScheduledGraph(graph, scheduler, memory, timings, folder)


def scheduling_backend(graph: GraphLowering) -> SIMDScheduling:
    """The fusion rules of the graph's kernels: GPU graphs add row-column kernels and
    sibling reductions (``codegen/triton/row_column.py``)."""
    if graph.default_device.type == "cuda":
        return TritonScheduling()
    return SIMDScheduling()


def gemm_selection(graph: GraphLowering, options: dict[str, Any],
                   target: dict[str, Any] | None) -> GemmSelection:
    from .codegen.graph_codegen import kernel_backend

    device_type = graph.default_device.type
    # Templates are generated for static shapes: a dynamic graph's matmuls are extern calls.
    templates = (kernel_backend(device_type, options) == "triton"
                 and not graph.sizevars.is_dynamic())
    return GemmSelection.from_options(options, templates,
                                      target or DEFAULT_TARGETS.get(device_type))


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                  options: dict[str, Any] | None = None, name: str = "graph",
                  target: dict[str, Any] | None = None,
                  compile_kernels: bool = True,
                  symbols: Sequence[SymbolRange] = ()) -> CompiledGraph:
    """Stages 1 to 6: a graph to wrapper and kernel sources (and, in-process, binaries)."""
    from .codegen.graph_codegen import generate_code

    options = dict(options or {})
    sg = lower_and_schedule(gm, example_inputs, name, options, target, symbols)
    t = time.perf_counter()
    with V.set_graph_handler(sg.graph), trace.span("codegen", cat="compiler", graph=name):
        # 6. Code generation: a kernel per fused node, then the wrapper.
        source, kernels = generate_code(sg, options)
    sg.timings["codegen"] = time.perf_counter() - t
    debug.write_debug_file(sg.debug_dir, "output_code.py", _output_code(source, kernels))
    debug.write_debug_file(sg.debug_dir, "timings.txt",
                           "\n".join(f"{k}: {v * 1e3:.2f} ms" for k, v in sg.timings.items()))
    device_type = sg.graph.default_device.type
    compiled = CompiledGraph(
        name=name, device_type=device_type, wrapper_source=source, kernels=kernels,
        constant_names=list(sg.graph.constants), timings=sg.timings,
        stats={"kernels": len(kernels), "buffers": len(sg.memory.allocations),
               "peak_bytes": sg.memory.peak_bytes,
               "fused_nodes": len(sg.scheduler.nodes),
               # Inputs the wrapper writes in place (CUDA graphs copy them back).
               "mutated_inputs": sorted(sg.graph.graph_input_names.index(n)
                                        for n in sg.graph.mutated_inputs
                                        if n in sg.graph.graph_input_names)},
        lifetimes=describe(sg.memory, sg.scheduler.nodes))
    compiled.stats["buffers"] = len(sg.memory.allocations)
    compiled.stats["fallback_ops"] = fallback_ops(sg.graph)
    record_gemm_choices(compiled, sg.graph.gemm_selection)
    if sg.graph.sizevars.is_dynamic():
        compiled.stats["dynamic"] = dynamic_stats(sg.graph.sizevars)
    if compile_kernels:
        chosen: dict[str, Any] = dict(target or DEFAULT_TARGETS.get(device_type) or {})
        if _can_autotune(options, chosen):
            from .autotune import autotune_graph

            # 7. Kernel compilation and autotuning: every config, measured on this GPU.
            autotune_graph(compiled, chosen)
        else:
            # 7. Kernel compilation for the target, with each kernel's heuristic config.
            compile_all(compiled, chosen)
    _log_output_code(options, compiled)
    return compiled


def fallback_ops(graph: GraphLowering) -> dict[str, int]:
    """How many times each ATen op runs eagerly in the wrapper (a ``FallbackKernel``: no
    lowering, or one that must stay eager), by ``aten.op.overload`` name."""
    from .ir.extern import FallbackKernel

    counts: dict[str, int] = {}
    for buf in graph.buffers:
        if isinstance(buf, FallbackKernel):
            name = str(buf.op_overload)
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items()))


def dynamic_stats(sizevars: SizeVars) -> dict[str, Any]:
    """What an artifact records of its size symbols: their ranges, and the size bucket
    (each symbol's hint, rounded up to a power of two) its kernel configs were chosen for."""
    from .codegen.common import next_power_of_2

    symbols = {s.name: [sizevars.ranges[s].lower, sizevars.ranges[s].upper]
               for s in sizevars.symbols}
    bucket = {s.name: next_power_of_2(sizevars.size_hint(s)) for s in sizevars.symbols}
    return {"symbols": symbols, "bucket": bucket}


def _can_autotune(options: dict[str, Any], target: dict[str, Any]) -> bool:
    """Autotune where asked and where this process has a GPU of the target's arch."""
    if str(options.get("autotune", "0")).lower() not in ("1", "true") or \
            target.get("kind") != "cuda" or not torch.cuda.is_available():
        return False
    major, minor = torch.cuda.get_device_capability()
    return int(target.get("arch", -1)) == major * 10 + minor


def compile_all(compiled: CompiledGraph, target: dict[str, Any]) -> None:
    """Compile every kernel in this process (the ``inprocess`` farm mode)."""
    t = time.perf_counter()
    for spec in compiled.kernels:
        if target.get("kind") == "cuda" and spec.backend != "triton":
            continue
        if target.get("kind") == "cpu" and spec.backend != "cpp":
            continue
        config = compiled.config_for(spec)
        try:
            compiled.binaries[spec.name] = compile_kernel(spec, config, target)
        except KilnCompileError as e:
            raise KilnCompileError(
                f"{e}; kernel source: {write_source(spec.source)} (and in the output code "
                f"of graph {compiled.name}: KILN_LOGS=output_code)", stage="kernel compile",
                graph=compiled.name, kernel=spec.name) from e
        compiled.configs[spec.name] = config
    compiled.timings["kernel_compile"] = time.perf_counter() - t


def _output_code(source: str, kernels: list[Any]) -> str:
    parts = [source]
    for k in kernels:
        parts.append(f"# ---- kernel {k.name} ({k.backend}, {k.kind}) ----\n{k.source}")
    return "\n".join(parts)


def _log_output_code(options: dict[str, Any], compiled: CompiledGraph) -> None:
    import os
    import sys

    logs = str(options.get("logs", os.environ.get("KILN_LOGS", "")))
    if "output_code" in logs.split(","):
        print(f"# ==== kiln output code: graph {compiled.name} ====", file=sys.stderr)
        print(_output_code(compiled.wrapper_source, compiled.kernels), file=sys.stderr)
