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

from . import debug
from .codegen.simd import SIMDScheduling
from .graph import GraphLowering
from .memory import MemoryPlan, describe, plan_memory
from .scheduler import Scheduler
from .virtualized import V


@dataclass
class ScheduledGraph:
    """A lowered, fused and memory-planned graph: everything codegen needs."""

    graph: GraphLowering
    scheduler: Scheduler
    memory: MemoryPlan
    timings: dict[str, float] = field(default_factory=dict)
    debug_dir: Path | None = None


def lower_and_schedule(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                       name: str = "graph", options: dict[str, Any] | None = None
                       ) -> ScheduledGraph:
    """FX graph -> loop-level IR -> scheduled, fused nodes -> memory plan."""
    timings: dict[str, float] = {}
    folder = debug.debug_dir(name, options) if debug.debug_enabled(options) else None
    debug.write_debug_file(folder, "fx_graph.txt", gm.print_readable(print_output=False))
    graph = GraphLowering(gm, example_inputs, name)
    with V.set_graph_handler(graph):
        t = time.perf_counter()
        # 1. Lowering: FX nodes -> TensorBoxes of lazy loops; realize() names buffers.
        graph.run()
        # 2. Layouts: every buffer whose strides are still free becomes contiguous.
        graph.finalize_layouts()
        timings["lowering"] = time.perf_counter() - t
        debug.write_debug_file(folder, "ir_pre_fusion.txt", debug.ir_str(graph.buffers))
        t = time.perf_counter()
        # 3. Scheduler nodes: read_writes of each buffer, dependencies, dead nodes removed.
        scheduler = Scheduler(graph.buffers, backend=SIMDScheduling())
        # 4. Fusion: vertical and horizontal, by score, never making a cycle.
        scheduler.fuse_nodes()
        timings["scheduling"] = time.perf_counter() - t
        debug.write_debug_file(folder, "ir_post_fusion.txt", scheduler.debug_str())
        t = time.perf_counter()
        # 5. Memory plan: last uses, in-kernel buffers, reuse, peak estimate.
        memory = plan_memory(scheduler)
        timings["memory_plan"] = time.perf_counter() - t
        debug.write_debug_file(folder, "schedule.txt",
                               scheduler.debug_str() + "\n\n" + describe(memory, scheduler.nodes))
    return ScheduledGraph(graph, scheduler, memory, timings, folder)
