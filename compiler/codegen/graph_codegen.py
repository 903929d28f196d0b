"""Code generation for a whole scheduled graph: one kernel per fused node (identical
kernels share one definition), extern calls, and the wrapper that ties them together."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from ..errors import KilnCompileError
from ..memory import buffer_bytes, plan_inplace, plan_memory
from ..scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode
from ..virtualized import V
from .kernel_spec import KernelSpec
from .triton.scheduling import NAME_PLACEHOLDER, UnforwardedBuffers, codegen_triton
from .triton.templates import codegen_template
from .wrapper import WrapperCodegen

WRAPPER_HEADER = """# Kiln wrapper for graph {name}: {kernels} kernel(s), {buffers} buffer(s)
import torch

from kiln.compiler.runtime.wrapper_runtime import (
    align_input,
    as_layout,{cuda_import}
    empty_strided,
    reinterpret_tensor,
)
"""


def kernel_backend(device_type: str, options: dict[str, Any]) -> str:
    if device_type == "cuda":
        return "triton"
    choice = str(options.get("cpu_backend", "cpp"))
    if choice not in ("cpp", "triton-interpret"):
        raise KilnCompileError(f"unknown cpu_backend {choice!r} (cpp or triton-interpret)",
                               stage="codegen")
    return "cpp" if choice == "cpp" else "triton"


class KernelNamer:
    """Gives kernels their names; an identical body reuses the earlier kernel."""

    def __init__(self) -> None:
        self.by_source: dict[str, KernelSpec] = {}

    def name(self, base: str, spec: KernelSpec) -> KernelSpec:
        if spec.source in self.by_source:
            return self.by_source[spec.source]
        name = f"{base}_{len(self.by_source)}"
        arg_bytes = tuple(buffer_bytes(V.graph.get_buffer(b)) for b in spec.arg_buffers)
        named = dataclasses.replace(spec, name=name, arg_bytes=arg_bytes,
                                    source=spec.source.replace(NAME_PLACEHOLDER, name))
        self.by_source[spec.source] = named
        return named


def guarded_variants(sg: Any, kernels: dict[int, tuple[str, KernelSpec]], backend: str
                     ) -> dict[int, list[tuple[int, tuple[str, KernelSpec]]]]:
    """Persistent variants of Triton reductions over symbolic rows (see
    ``persistent_variants``), generated against the final memory plan."""
    if backend != "triton" or not V.graph.sizevars.is_dynamic():
        return {}
    from .triton.scheduling import persistent_variants

    out = {}
    for i in kernels:
        node = sg.scheduler.nodes[i]
        try:
            variants = persistent_variants(node, set(sg.memory.removed_buffers))
        except UnforwardedBuffers:
            continue  # the looped kernel alone
        if variants:
            out[i] = variants
    return out


def codegen_kernels(sg: Any, backend: str) -> dict[int, tuple[str, KernelSpec]]:
    """A kernel for every fused node. A buffer a kernel cannot keep in registers (read
    in a later loop than the one that made it) is stored after all: the memory plan is
    redone with it allocated, and every kernel generated again against that plan."""
    gen: Callable[[Any, set[str]], tuple[str, KernelSpec]] = codegen_triton
    if backend == "cpp":
        from .cpp.scheduling import codegen_cpp

        gen = codegen_cpp
    stored: set[str] = set()
    for _ in range(8):
        kernels: dict[int, tuple[str, KernelSpec]] = {}
        lost: set[str] = set()
        for i, node in enumerate(sg.scheduler.nodes):
            if isinstance(node, (ExternKernelSchedulerNode, NopKernelSchedulerNode)):
                continue
            removed = set(sg.memory.removed_buffers)
            node_gen = codegen_template if node.is_template() else gen
            while True:
                try:
                    kernels[i] = node_gen(node, removed)
                    break
                except UnforwardedBuffers as e:
                    lost |= e.names
                    removed -= e.names
        if not lost:
            return kernels
        stored |= lost
        sg.memory = plan_memory(sg.scheduler, stored=stored)
    raise KilnCompileError("kernels need buffers that cannot be kept in registers",
                           stage="codegen", graph=sg.graph.name)


def generate_code(sg: Any, options: dict[str, Any]) -> tuple[str, list[KernelSpec]]:
    """The wrapper source and the kernels of a ScheduledGraph."""
    graph, scheduler = sg.graph, sg.scheduler
    device_type = graph.default_device.type
    backend = kernel_backend(device_type, options)
    namer = KernelNamer()
    with V.set_graph_handler(graph):
        kernels = codegen_kernels(sg, backend)
        variants = guarded_variants(sg, kernels, backend)
        if backend == "cpp":  # fresh CPU allocations cost page faults: write in place
            plan_inplace(sg.memory, scheduler)
        wrapper = WrapperCodegen(sg.memory, graph.name, device_type)
        wrapper.allocate_as_views(scheduler.nodes)
        for i, node in enumerate(scheduler.nodes):
            if isinstance(node, ExternKernelSchedulerNode):
                wrapper.extern_call(node)
            elif isinstance(node, NopKernelSchedulerNode):
                wrapper.nop(node)
            else:
                base, spec = kernels[i]
                # Identical kernels share one definition; each call passes its own buffers.
                guarded = [(bound, namer.name(vbase, vspec), vspec.arg_buffers +
                            vspec.size_args) for bound, (vbase, vspec) in variants.get(i, [])]
                wrapper.kernel_call(node, namer.name(base, spec),
                                    spec.arg_buffers + spec.size_args, guarded)
            wrapper.free(node)
        inputs = list(graph.graph_input_names)
        header = WRAPPER_HEADER.format(name=graph.name, kernels=len(namer.by_source),
                                       buffers=len(sg.memory.allocations),
                                       cuda_import="\n    cuda_allocator,"
                                       if device_type == "cuda" else "")
        source = wrapper.generate(inputs, graph.graph_outputs, header)
    if device_type == "cuda":
        source = _align_inputs(source, wrapper, inputs)
    return source, list(namer.by_source.values())


def _align_inputs(source: str, wrapper: WrapperCodegen, inputs: list[str]) -> str:
    """Triton binaries assume 16-byte aligned pointers: copy misaligned inputs first. One
    test of all their addresses together per call (a graph's parameters are inputs too:
    one Python call each would cost more than the test)."""
    used = {b for spec in wrapper.kernels.values() for b in spec.arg_buffers}
    names = [n for n in inputs if n in used and n not in wrapper.mutated]
    if not names:
        return source
    pointers = " | ".join(f"{n}.data_ptr()" for n in names)
    lines = [f"    if ({pointers}) % 16:"] + [f"        {n} = align_input({n})" for n in names]
    marker = "    args.clear()\n"
    return source.replace(marker, marker + "\n".join(lines) + "\n", 1)
