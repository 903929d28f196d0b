"""The Python wrapper: ``call(args)`` allocates, launches kernels, calls extern kernels,
frees each buffer at its last use, reuses storage, and returns the outputs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from ..ir.extern import ExternKernel, FallbackKernel, MultiOutput, _TensorSlot, fill_template
from ..ir.layout import Layout, MutationLayout
from ..ir.nodes import (
    Buffer,
    ComputedBuffer,
    ConstantBuffer,
    InputBuffer,
    IRNode,
    ReinterpretView,
    TemplateBuffer,
)
from ..memory import MemoryPlan
from ..scheduler import BaseSchedulerNode, ExternKernelSchedulerNode, NopKernelSchedulerNode
from ..virtualized import V
from .common import IndentedBuffer, IndexPrinter
from .kernel_spec import KernelSpec


@dataclass
class WrapperCode:
    """The wrapper's source and the kernels it launches, by name."""

    source: str
    kernels: dict[str, KernelSpec] = field(default_factory=dict)


_PRINTER = IndexPrinter()


def py_size(value: Any) -> str:
    """A size as Python source: a literal, or an expression over ``s0, s1, ...``."""
    return _PRINTER.print(sympy.sympify(value))


def size_str(values: Any) -> str:
    items = [py_size(v) for v in values]
    return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"


def value_str(value: Any) -> str:
    """A Python literal for an extern kernel's constant argument."""
    if isinstance(value, sympy.Expr):
        return py_size(value)
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.device):
        return "DEVICE"
    if isinstance(value, (torch.layout, torch.memory_format)):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return 'float("nan")'
        if math.isinf(value):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        return repr(value)
    if isinstance(value, (list, tuple)):
        inner = ", ".join(value_str(v) for v in value)
        if isinstance(value, list):
            return f"[{inner}]"
        return f"({inner}{',' if len(value) == 1 else ''})"
    if isinstance(value, str):
        return repr(value)
    return repr(value)


class WrapperCodegen:
    """Emit the wrapper for a scheduled graph, one scheduler node at a time."""

    def __init__(self, plan: MemoryPlan, graph_name: str, device_type: str = "cpu") -> None:
        self.plan = plan
        # GPU buffers come from the allocator the call asks for once (``cuda_allocator``):
        # one C call per buffer.
        self.device_alloc = device_type == "cuda"
        self.allocates = False
        self.graph_name = graph_name
        self.lines = IndentedBuffer(1)
        self.kernels: dict[str, KernelSpec] = {}
        self.donors = set(plan.reuse.values())
        self.freed: set[str] = set()
        self.outputs = set(V.graph.get_output_names())
        self.mutated = set(V.graph.mutated_inputs)
        # Views the graph returns (a forward's saved tensors), named where a library call
        # first takes them and returned by that name: one view made per call, not two.
        self.returned_views = {_view_expr(o) for o in V.graph.graph_outputs
                               if isinstance(o, ReinterpretView)}
        self.view_names: dict[str, str] = {}
        # buffer -> the view of it it is allocated as (see ``allocate_as_views``)
        self.allocated_as: dict[str, ReinterpretView] = {}
        # buffer -> (size, stride) of the tensor the wrapper made for it
        self.shapes: dict[str, tuple[str, str]] = {}

    def allocate_as_views(self, nodes: list[BaseSchedulerNode]) -> None:
        """Buffers used as tensors (library-call operands, graph outputs) only through
        views, one of which spans all of their storage from its start (a layer's
        activations flattened for a GEMM, and saved that way for the backward): each is
        allocated in the shape and strides of that view (the one used most), and is that
        view. Kernels take only the pointer, and the other views are made from the
        storage, so nothing else changes: one ``reinterpret_tensor`` call less per view
        use per call of the wrapper. A buffer that takes over a freed one's storage is
        that storage viewed its own way (``allocate``: ``self.shapes``)."""
        views: dict[str, dict[str, list[ReinterpretView]]] = {}
        direct: set[str] = set(self.plan.inplace) | set(self.plan.inplace.values())
        uses: list[Any] = list(V.graph.graph_outputs)
        for node in nodes:
            if isinstance(node, ExternKernelSchedulerNode):
                uses += list(node.node.inputs)
        for use in uses:
            if isinstance(use, ReinterpretView):
                by_expr = views.setdefault(use.get_name(), {})
                by_expr.setdefault(_view_expr(use), []).append(use)
            elif isinstance(use, Buffer):
                direct.add(use.get_name())
        for name, by_expr in views.items():
            buf = V.graph.name_to_buffer.get(name)
            if name in direct or name not in self.plan.allocations or not isinstance(
                    buf, (ComputedBuffer, TemplateBuffer)):
                continue
            fits = [same for same in by_expr.values()
                    if _same_storage(buf.layout, same[0].layout)]
            if fits:
                self.allocated_as[name] = max(fits, key=len)[0]

    def tensor_ref(self, node: IRNode) -> str:
        if isinstance(node, ReinterpretView):
            expr = _view_expr(node)
            if expr == _allocated_expr(self.allocated_as, node.get_name()):
                return node.get_name()
            if expr in self.view_names:
                return self.view_names[expr]
            if expr not in self.returned_views:
                return expr
            name = self.view_names[expr] = f"view{len(self.view_names)}"
            return f"({name} := {expr})"
        assert isinstance(node, Buffer)
        return node.get_name()

    def allocate(self, buf: Buffer) -> None:
        name = buf.get_name()
        layout = buf.layout
        assert isinstance(layout, Layout)
        if isinstance(layout, MutationLayout):
            self.lines.writeline(f"{name} = {layout.target}  # written in place")
            return
        if name in self.plan.inplace:
            self.lines.writeline(f"{name} = {self.plan.inplace[name]}  # written in place")
            return
        view = self.allocated_as.get(name)
        shaped = layout if view is None else view.layout
        self.shapes[name] = want = (size_str(shaped.size), size_str(shaped.stride))
        if name in self.plan.reuse:  # the donor's storage, as this buffer's tensor
            donor = self.plan.reuse[name]
            d_layout = V.graph.name_to_buffer[donor].get_layout()
            if self.shapes.get(donor, (size_str(d_layout.size), size_str(d_layout.stride))) \
                    == want:
                self.lines.writeline(f"{name} = {donor}; del {donor}  # reuse")
            else:
                self.lines.writeline(f"{name} = reinterpret_tensor({donor}, {want[0]}, "
                                     f"{want[1]}, 0); del {donor}  # reuse")
            return
        self.lines.writeline(f"{name} = {self.empty(shaped)}"
                             + ("  # as its one view" if view is not None else ""))

    def empty(self, layout: Layout) -> str:
        """A fresh buffer of ``layout``, as the expression that allocates it."""
        size, stride = size_str(layout.size), size_str(layout.stride)
        if self.device_alloc:
            self.allocates = True
            return f"empty_strided_cuda({size}, {stride}, {layout.dtype})"
        return f"empty_strided({size}, {stride}, device=DEVICE, dtype={layout.dtype})"

    def kernel_call(self, node: BaseSchedulerNode, spec: KernelSpec,
                    arg_buffers: tuple[str, ...],
                    guarded: list[tuple[int, KernelSpec, tuple[str, ...]]] | None = None
                    ) -> None:
        """Launch ``spec``; with ``guarded`` (row bound, kernel, arguments) variants, the
        first whose bound holds for this call's row length runs instead."""
        for name in sorted(node.get_buffer_names() - self.plan.removed_buffers):
            buf = V.graph.name_to_buffer.get(name)
            if isinstance(buf, (ComputedBuffer, TemplateBuffer)):
                self.allocate(buf)
        self.kernels.setdefault(spec.name, spec)
        if not guarded:
            self.lines.writeline(f"{spec.name}.run({', '.join(arg_buffers)})")
            return
        rnumel = spec.size_args[1]
        for k, (bound, variant, args) in enumerate(guarded):
            self.kernels.setdefault(variant.name, variant)
            self.lines.writeline(f"{'if' if k == 0 else 'elif'} {rnumel} <= {bound}:")
            self.lines.writeline(f"    {variant.name}.run({', '.join(args)})")
        self.lines.writeline("else:")
        self.lines.writeline(f"    {spec.name}.run({', '.join(arg_buffers)})")

    def extern_call(self, node: ExternKernelSchedulerNode) -> None:
        buf = node.node
        name = buf.get_name()
        refs = [self.tensor_ref(x) for x in buf.inputs]
        op = _op_ref(buf.op_overload)
        if isinstance(buf, FallbackKernel):
            args = fill_template(buf.args_template, lambda i: _Raw(refs[i]))
            kwargs = fill_template(buf.kwargs_template, lambda i: _Raw(refs[i]))
            rendered = [_render(a) for a in args] + [f"{k}={_render(v)}"
                                                     for k, v in kwargs.items()]
            self.lines.writeline(f"{name} = {op}({', '.join(rendered)})")
            self._coerce_layout(buf, with_dtype=True)
            for out in buf.outputs:
                index = "".join(f"[{i}]" for i in out.indices) if isinstance(out, MultiOutput) \
                    else ""
                self.lines.writeline(f"{out.get_name()} = {name}{index}")
                self._coerce_layout(out, with_dtype=True)
            return
        rendered = refs + [value_str(a) for a in buf.constant_args]
        rendered += [f"{k}={value_str(v)}" for k, v in buf.kwargs.items()]
        if buf.out_variant is not None:  # into storage of its own or a freed buffer's
            self.allocate(buf)
            rendered.append(f"out={name}")
            self.lines.writeline(f"{_op_ref(buf.out_variant)}({', '.join(rendered)})")
            return
        self.lines.writeline(f"{name} = {op}({', '.join(rendered)})")
        if buf.op_overload is torch.ops.aten.convolution.default:
            self._coerce_layout(buf)

    def _coerce_layout(self, buf: Buffer, with_dtype: bool = False) -> None:
        """Library calls choose their outputs' strides at run time (cuDNN picks NHWC);
        the kernels after them were generated for the planned layout. ``with_dtype``
        (fallback ops): the planned dtype too, since a meta kernel can disagree with the
        real one (``_batch_norm_with_update_functional`` on bf16: float32 running stats
        from meta, bfloat16 from the CPU kernel)."""
        layout = buf.layout
        if not isinstance(layout, Layout):
            return
        name = buf.get_name()
        dtype = f", {layout.dtype}" if with_dtype else ""
        self.lines.writeline(f"{name} = as_layout({name}, {size_str(layout.size)}, "
                             f"{size_str(layout.stride)}{dtype})")

    def nop(self, node: NopKernelSchedulerNode) -> None:
        buf = node.node
        if isinstance(buf, ComputedBuffer):
            self.allocate(buf)

    def free(self, node: BaseSchedulerNode) -> None:
        for name in sorted(node.last_usage):
            if name in self.outputs or name in self.freed or name in self.plan.removed_buffers:
                continue
            if name in self.donors or name in self.mutated:
                continue
            buf = _lookup(name)
            if buf is None or isinstance(buf, ConstantBuffer):
                continue  # constants are the module's, bound once at load, never freed
            if isinstance(buf, InputBuffer) or name in self.plan.allocations or isinstance(
                    buf, ExternKernel) or _aliases_intermediate(buf):
                self.lines.writeline(f"del {name}")
                self.freed.add(name)

    def generate(self, input_names: list[str], outputs: list[Any], header: str) -> str:
        code = IndentedBuffer()
        code.writelines(header.splitlines())
        code.writeline("")
        code.writeline("")
        code.writeline("def call(args):")
        with code.indent():
            if input_names:
                code.writeline(f"{', '.join(input_names)}, = args")
            code.writeline("args.clear()")
            if self.allocates:
                code.writeline("empty_strided_cuda = cuda_allocator(DEVICE)")
            for symbol, source in V.graph.symbol_sources.items():
                code.writeline(f"{symbol.name} = {source}")
        code.splice(self.lines)
        with code.indent():
            code.writeline(f"return ({''.join(self._output_ref(o) + ', ' for o in outputs)})")
        return code.getvalue()

    def _output_ref(self, out: Any) -> str:
        if isinstance(out, ReinterpretView):
            if _view_expr(out) == _allocated_expr(self.allocated_as, out.get_name()):
                return out.get_name()
            expr = _view_expr(out)
            return self.view_names.get(expr, expr)
        if isinstance(out, Buffer):
            return self.tensor_ref(out)
        return value_str(out)


def _view_expr(node: ReinterpretView) -> str:
    """The expression that makes ``node``: the same text for the same view.
    ``reinterpret_tensor`` counts its offset from where the tensor it is given starts,
    while a layout's offset counts from its storage's start: a graph input that starts
    inside its storage (``k`` and ``v`` sliced out of one ``qkv`` buffer) has its own
    offset taken off, or the view would start that far past its data."""
    lay = node.layout
    offset = sympy.expand(sympy.sympify(lay.offset) - node.data.get_layout().offset)
    return (f"reinterpret_tensor({node.get_name()}, {size_str(lay.size)}, "
            f"{size_str(lay.stride)}, {py_size(offset)})")


def _allocated_expr(allocated_as: dict[str, ReinterpretView], name: str) -> str | None:
    view = allocated_as.get(name)
    return None if view is None else _view_expr(view)


def _same_storage(buffer: Any, view: Any) -> bool:
    """``view`` (a layout) starts where ``buffer``'s storage starts and spans exactly
    as many elements, with sizes, strides and offset all known numbers."""
    if not (isinstance(buffer, Layout) and isinstance(view, Layout)) or \
            isinstance(buffer, MutationLayout) or buffer.dtype != view.dtype:
        return False
    values = [*buffer.size, *buffer.stride, buffer.offset, *view.size, *view.stride,
              view.offset]
    if not all(sympy.sympify(v).is_Integer for v in values) or int(view.offset) != 0 \
            or int(buffer.offset) != 0:
        return False

    def extent(size: Any, stride: Any) -> int:
        if any(int(n) == 0 for n in size):
            return 0
        return 1 + sum((int(n) - 1) * int(s) for n, s in zip(size, stride))

    return extent(buffer.size, buffer.stride) == extent(view.size, view.stride)


class _Raw:
    def __init__(self, text: str) -> None:
        self.text = text


def _render(value: Any) -> str:
    if isinstance(value, _Raw):
        return value.text
    if isinstance(value, (list, tuple)) and any(isinstance(v, _Raw) for v in value):
        inner = ", ".join(_render(v) for v in value)
        return f"[{inner}]"
    if isinstance(value, _TensorSlot):
        raise AssertionError("unfilled tensor slot")
    return value_str(value)


# Library calls made through torch's generated bindings (``torch.mm(a, b)``,
# ``torch.mm(a, b, out=buf)``) instead of the overload object
# (``torch.ops.aten.mm.default``): the same overload for the arguments the wrapper passes
# (tensors, and the schema's other arguments by position or name; no ``out_dtype``), with
# no generic, schema-driven argument conversion: about 2 µs less host time a call.
_BOUND_OPS = frozenset({"mm", "bmm", "addmm", "baddbmm", "convolution",
                        "_scaled_dot_product_flash_attention",
                        "_scaled_dot_product_efficient_attention",
                        "_scaled_dot_product_cudnn_attention"})


def _op_ref(op: Any) -> str:
    """A reference to an ATen overload: ``torch.mm`` for the bound ones (above),
    ``torch.ops.aten.cumsum.default`` style for the rest."""
    name = op.name()  # e.g. "aten::mm" or "aten::add.Tensor"
    ns, rest = name.split("::")
    overload = op._overloadname
    base = rest.split(".")[0]
    if ns == "aten" and base in _BOUND_OPS and overload in ("default", "out") \
            and hasattr(torch, base):
        return f"torch.{base}"
    return f"torch.ops.{ns}.{base}.{overload}"


def _aliases_intermediate(buf: Buffer) -> bool:
    """A scatter's result: another name for a buffer of the graph that it wrote in place."""
    layout = buf.layout
    return isinstance(layout, MutationLayout) and layout.target in V.graph.name_to_buffer


def _lookup(name: str) -> Buffer | None:
    try:
        return V.graph.get_buffer(name)
    except KeyError:
        return None
