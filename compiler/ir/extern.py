"""Ops that cannot be closures: extern library calls and eager fallbacks.

Both are buffers from the moment they exist (``register_buffer`` runs at construction);
their inputs are realized buffers or strided views of them. The scheduler sees their
reads as ``StarDep``s, and they are fusion barriers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from ..sizevars import SymbolicTensor
from ..virtualized import V
from .layout import FixedLayout, Layout, MultiOutputLayout, contiguous_strides
from .nodes import (
    Buffer,
    IRNode,
    Pointwise,
    ReinterpretView,
    StorageBox,
    TensorBox,
    as_storage_and_layout,
)
from .sym import sympify_tuple


def realize_input(x: IRNode) -> IRNode:
    """A real tensor for an extern kernel: a buffer, a strided view of one, or a copy."""
    if isinstance(x, TensorBox):
        storage = x.storage()
        if storage is not None:
            storage.realize()
        found = as_storage_and_layout(x)
        if found is not None:
            buf, layout = found
            if layout == buf.layout:
                return buf
            return ReinterpretView(buf, layout)
        # Not expressible as strides over a buffer: copy into a fresh buffer.
        copy = TensorBox.create(Pointwise(x.get_device(), x.get_dtype(), x.make_loader(),
                                          x.get_size()))
        copy.realize()
        fresh = copy.storage().data  # type: ignore[union-attr]
        assert isinstance(fresh, Buffer)
        fresh.freeze_layout()
        return fresh  # a fresh buffer is itself (never a view to find again: no recursion)
    if isinstance(x, StorageBox):
        x.realize()
        return x.data
    return x


def meta_tensor(x: IRNode, device: Any = "meta") -> torch.Tensor:
    """A tensor with the size, stride, storage offset and dtype of a realized input, on
    ``device`` (meta by default; a fake device inside a FakeTensorMode)."""
    if isinstance(x, (Buffer, ReinterpretView)):
        lay = x.get_layout() if isinstance(x, Buffer) else x.layout
        offset = int(lay.offset) if isinstance(x, ReinterpretView) else 0
        return strided_empty([int(s) for s in lay.size], [int(s) for s in lay.stride],
                             offset, lay.dtype, device)
    size = [int(s) for s in x.get_size()]
    return torch.empty(size, dtype=x.get_dtype(), device=device)


def strided_empty(size: list[int], stride: list[int], offset: int, dtype: torch.dtype,
                  device: Any) -> torch.Tensor:
    """``empty_strided`` at a storage offset: a view's offset is part of what an op sees,
    and ops that work on storage (``as_strided_scatter``) give outputs at that offset."""
    if not offset:
        return torch.empty_strided(size, stride, dtype=dtype, device=device)
    span = 1 + sum((n - 1) * st for n, st in zip(size, stride)) if all(size) else 0
    return torch.empty(offset + span, dtype=dtype, device=device).as_strided(
        size, stride, offset)


def layout_of(t: Any, device: torch.device) -> FixedLayout:
    """The layout of a (meta, fake or symbolic) tensor."""
    return FixedLayout(device, t.dtype, sympify_tuple(t.shape), sympify_tuple(t.stride()),
                       sympy.sympify(t.storage_offset()))


class _SymbolicOut:
    """The size, stride and dtype of an extern's output in a graph with dynamic shapes."""

    def __init__(self, shape: Sequence[Any], dtype: torch.dtype) -> None:
        self.shape = tuple(sympify_tuple(shape))
        self.dtype = dtype

    def stride(self) -> tuple[Any, ...]:
        return contiguous_strides(self.shape)

    def storage_offset(self) -> int:
        return 0


def _is_symbolic(inputs: Sequence[IRNode], args: Any) -> bool:
    sizes = [s for x in inputs for s in (*x.get_size(), *_strides(x))]
    return any(not sympy.sympify(s).is_Integer for s in sizes) or _has_symbol(args)


def _strides(x: IRNode) -> tuple[Any, ...]:
    if isinstance(x, ReinterpretView):
        return x.layout.stride
    return x.get_layout().stride if isinstance(x, Buffer) else ()


def _has_symbol(value: Any) -> bool:
    if isinstance(value, sympy.Expr):
        return not value.is_Integer
    if isinstance(value, (list, tuple)):
        return any(_has_symbol(v) for v in value)
    if isinstance(value, dict):
        return any(_has_symbol(v) for v in value.values())
    return False


_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default}


def symbolic_output(op: Any, inputs: Sequence[IRNode]) -> Any:
    """What ``op`` returns when its inputs have symbolic sizes (no meta run: a meta tensor
    needs values): matmuls by their rule, the op being lowered from its FX node's meta."""
    if op in _MATMULS or op is torch.ops.aten.addmm.default:  # addmm: (bias, a, b)
        a, b = (inputs[1:] if op is torch.ops.aten.addmm.default else inputs)[:2]
        return _SymbolicOut((*a.get_size()[:-1], b.get_size()[-1]), a.get_dtype())
    node = V.graph.current_node
    if node is not None and node.target is op and "val" in node.meta:
        return node.meta["val"]
    raise NotImplementedError(f"{op} inside another op's lowering with symbolic sizes")


@dataclass(eq=False, repr=False)
class ExternKernel(Buffer):
    """A call into a vendor library through ATen (mm, bmm, addmm, baddbmm, convolution)."""

    inputs: list[IRNode] = field(default_factory=list)
    constant_args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    op_overload: Any = None
    # Where set, the wrapper allocates the output with ``layout`` and calls this ``out=``
    # overload (a matmul whose rows are padded to an aligned stride).
    out_variant: Any = None

    def __post_init__(self) -> None:
        self.name = V.graph.register_buffer(self)

    def input_names(self) -> list[str]:
        return [x.get_name() for x in self.inputs if isinstance(x, (Buffer, ReinterpretView))]

    def kernel_name(self) -> str:
        return str(self.op_overload)

    @classmethod
    def create(cls, op: Any, tensor_args: Sequence[IRNode], constant_args: Sequence[Any] = (),
               kwargs: dict[str, Any] | None = None, out_variant: Any = None,
               pad_rows_to: int = 1) -> TensorBox:
        inputs = [realize_input(x) for x in tensor_args]
        kwargs = kwargs or {}
        if _is_symbolic(inputs, (constant_args, kwargs)):
            out = symbolic_output(op, inputs)
        else:
            out = op(*[meta_tensor(x) for x in inputs], *constant_args, **kwargs)
        device = inputs[0].get_device()
        layout = layout_of(out, device)
        if out_variant is not None:
            layout = padded_rows(layout, pad_rows_to)
        node = cls(name=None, layout=layout, inputs=inputs, constant_args=tuple(constant_args),
                   kwargs=dict(kwargs), op_overload=op, out_variant=out_variant)
        return TensorBox.create(node)


def padded_rows(layout: FixedLayout, multiple: int) -> FixedLayout:
    """A contiguous layout whose rows start every ``multiple`` elements (aligned rows)."""
    size = [sympy.sympify(s) for s in layout.size]  # rows (size[-1]) are static
    row = -(-int(size[-1]) // multiple) * multiple
    stride: list[Any] = [1] * len(size)
    if len(size) >= 2:
        stride[-2] = row
        for d in range(len(size) - 3, -1, -1):
            stride[d] = stride[d + 1] * size[d + 1]
    return FixedLayout(layout.device, layout.dtype, layout.size, sympify_tuple(stride),
                       layout.offset)


@dataclass(eq=False, repr=False)
class FallbackKernel(ExternKernel):
    """Any ATen op with no lowering, run eagerly: correct, but a fusion barrier.

    ``args_template`` is the op's argument structure with each tensor replaced by the
    index of its entry in ``inputs``, so the wrapper can rebuild the call.
    """

    args_template: Any = None
    kwargs_template: Any = None
    outputs: list[Buffer] = field(default_factory=list)
    mutated_inputs: list[str] = field(default_factory=list)
    # Kept even when nothing reads its outputs (an error check under ``with_effects``).
    has_side_effects: bool = False

    def get_mutation_names(self) -> list[str]:
        return list(self.mutated_inputs)


@dataclass(eq=False, repr=False)
class MultiOutput(ExternKernel):
    """One tensor of a multi-output fallback: ``parent`` result at ``indices``."""

    parent: FallbackKernel | None = None
    indices: tuple[int, ...] = ()


class _TensorSlot:
    def __init__(self, i: int) -> None:
        self.i = i

    def __repr__(self) -> str:
        return f"<input {self.i}>"


def _template(value: Any, inputs: list[IRNode]) -> Any:
    """Replace tensors in an argument structure by slots, collecting realized inputs."""
    if isinstance(value, IRNode):
        inputs.append(realize_input(value))
        return _TensorSlot(len(inputs) - 1)
    if isinstance(value, (list, tuple)):
        return type(value)(_template(v, inputs) for v in value)
    return value


def fill_template(value: Any, filler: Any) -> Any:
    if isinstance(value, _TensorSlot):
        return filler(value.i)
    if isinstance(value, (list, tuple)):
        return type(value)(fill_template(v, filler) for v in value)
    if isinstance(value, dict):
        return {k: fill_template(v, filler) for k, v in value.items()}
    return value


def make_fallback_call(op: torch._ops.OpOverload, args: Sequence[Any],
                       kwargs: dict[str, Any], side_effects: bool = False) -> Any:
    """Lower ``op(*args, **kwargs)`` to a FallbackKernel; return TensorBoxes like the op."""
    inputs: list[IRNode] = []
    args_t = _template(list(args), inputs)
    kwargs_t = {k: _template(v, inputs) for k, v in kwargs.items()}
    if _is_symbolic(inputs, (args, kwargs)):
        out = symbolic_output(op, inputs)
    else:
        out = _output_metas(op, args_t, kwargs_t, inputs)
    device = _fallback_device(inputs, kwargs)
    mutated = [_buffer_name(inputs[i]) for i in _mutated_arg_slots(op, args_t, kwargs_t)]
    fields = dict(name=None, inputs=inputs, op_overload=op, args_template=args_t,
                  kwargs_template=kwargs_t, mutated_inputs=mutated,
                  has_side_effects=side_effects)
    if isinstance(out, (torch.Tensor, _SymbolicOut, SymbolicTensor)):
        return TensorBox.create(FallbackKernel(layout=layout_of(out, device), **fields))
    node = FallbackKernel(layout=MultiOutputLayout(device), **fields)
    return _multi_outputs(node, out, (), device)


def _output_metas(op: torch._ops.OpOverload, args_t: Any, kwargs_t: Any,
                  inputs: list[IRNode]) -> Any:
    """The op's outputs as fake tensors on the inputs' device, laid out as the op will
    return them at run time; for an op with no meta kernel (``geqrf``, ``histogram``: no
    real kernel runs while compiling), the FX node's recorded ``val``.

    Meta kernels choose strides per device (cuFFT and MKL lay FFT outputs out
    differently, eigenvectors are row-major on CUDA): a bare meta tensor passes for CUDA
    on any host, and for the CPU under an outer fake mode (Dynamo's, while the backend
    compiles), so the planned layout would differ from the traced one, and the copy to
    the traced layout would be a kernel over values no kernel can type (complex)."""
    from torch._subclasses import fake_tensor as ft

    # No meta kernel, or an output shape that depends on values (a shape error is not
    # this: it stays an error naming the node).
    no_meta = (NotImplementedError, ft.UnsupportedOperatorException,
               ft.DynamicOutputShapeException, ft.DataDependentOutputException)
    try:
        with ft.unset_fake_temporarily(), ft.FakeTensorMode(allow_fallback_kernels=False):
            fakes = [_fake_like(x) for x in inputs]
            return op(*fill_template(args_t, fakes.__getitem__),
                      **fill_template(kwargs_t, fakes.__getitem__))
    except no_meta:
        node = V.graph.current_node if V.has_graph() else None
        val = node.meta.get("val") if node is not None and node.target is op else None
        if val is None:
            raise
        return val


def _fake_like(x: IRNode) -> torch.Tensor:
    """Inside a FakeTensorMode: a fake tensor like realized input ``x``, on its device."""
    return meta_tensor(x, x.get_device())


def _buffer_name(x: IRNode) -> str:
    assert isinstance(x, (Buffer, ReinterpretView)), type(x)
    return x.get_name()


def _multi_outputs(parent: FallbackKernel, out: Any, indices: tuple[int, ...],
                   device: torch.device) -> Any:
    if isinstance(out, (torch.Tensor, _SymbolicOut, SymbolicTensor)):
        mo = MultiOutput(name=None, layout=layout_of(out, device), inputs=[parent],
                         parent=parent, indices=indices)
        parent.outputs.append(mo)
        return TensorBox.create(mo)
    if isinstance(out, (list, tuple)):
        return type(out)(_multi_outputs(parent, o, indices + (i,), device)
                         for i, o in enumerate(out))
    return out


def _fallback_device(inputs: list[IRNode], kwargs: dict[str, Any]) -> torch.device:
    if inputs:
        return inputs[0].get_device()
    dev = kwargs.get("device")
    return torch.device(dev) if dev is not None else V.graph.default_device


def _mutated_arg_slots(op: torch._ops.OpOverload, args_t: Any, kwargs_t: Any) -> list[int]:
    slots: list[int] = []
    schema = op._schema
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args_t[i] if i < len(args_t) else kwargs_t.get(arg.name)
        if isinstance(value, _TensorSlot):
            slots.append(value.i)
    return slots


def layout_matches(layout: Layout, size: Sequence[int], stride: Sequence[int]) -> bool:
    return all(int(a) == b for a, b in zip(layout.size, size)) and all(
        int(a) == b or int(n) == 1 for a, b, n in zip(layout.stride, stride, layout.size))
