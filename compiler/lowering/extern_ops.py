"""Matmul and convolution through the vendor library (ExternKernel), in-place copies into
graph inputs, and ops that must stay eager (random ops keep eager's random stream)."""

from __future__ import annotations

from typing import Any

import sympy
import torch

from ..ir.extern import ExternKernel, make_fallback_call
from ..ir.nodes import IRNode, Pointwise, TensorBox
from ..virtualized import V, ops
from .gemm import tuned_matmul
from .pointwise import to_dtype
from .registry import expand, lowerings, register_lowering

aten = torch.ops.aten


# GPU matmuls whose output rows are not 16-byte aligned fall onto slow library kernels
# (GPT-2's vocabulary of 50257): such outputs get padded rows.
PAD_MIN_ELEMENTS = 2**20


def _row_padding(a: IRNode, b: IRNode) -> int:
    dtype = b.get_dtype()
    if a.get_device().type != "cuda" or not dtype.is_floating_point:
        return 1
    multiple = max(1, 16 // dtype.itemsize)
    width = sympy.sympify(b.get_size()[-1])
    if not width.is_Integer:  # a symbolic width is not padded
        return 1
    n, m = int(width), V.graph.sizevars.size_hint(a.get_size()[-2])
    if n % multiple == 0 or n * m < PAD_MIN_ELEMENTS:
        return 1
    return multiple


def _padded_matmul(op: Any, a: IRNode, b: IRNode) -> TensorBox:
    """``op(a, b)`` with ``b``'s columns zero-padded to an aligned count, and the result
    sliced back: library kernels for unaligned widths are several times slower."""
    from .indexing import constant_pad_nd
    from .views import slice_

    pad = _row_padding(a, b)
    if pad == 1:
        return ExternKernel.create(op, [a, b])
    n = int(b.get_size()[-1])
    padded = constant_pad_nd(b, [0, -(-n // pad) * pad - n])
    _keep_stride_order(padded, b)  # a transposed weight stays transposed: a plain copy
    out = ExternKernel.create(op, [a, padded])
    return slice_(out, -1, 0, n)  # type: ignore[return-value]


def _keep_stride_order(x: TensorBox, like: IRNode) -> None:
    from ..ir.layout import stride_order, strides_for_order
    from ..ir.nodes import Buffer, as_storage_and_layout

    found = as_storage_and_layout(like) if isinstance(like, TensorBox) else None
    if found is None:
        return
    x.realize()
    buf = x.storage().data  # type: ignore[union-attr]
    assert isinstance(buf, Buffer)
    buf.freeze_layout(strides_for_order(buf.get_size(), stride_order(found[1].stride)))


@register_lowering(aten.mm)
def mm(a: IRNode, b: IRNode, a_arg: int = 0, b_arg: int = 1) -> TensorBox:
    # max-autotune: a Triton template where the graph's selection chose one.
    tuned = tuned_matmul("mm", a, b, a_arg, b_arg)
    return tuned if tuned is not None else _padded_matmul(aten.mm.default, a, b)


@register_lowering(aten.bmm)
def bmm(a: IRNode, b: IRNode, a_arg: int = 0, b_arg: int = 1) -> TensorBox:
    tuned = tuned_matmul("bmm", a, b, a_arg, b_arg)
    return tuned if tuned is not None else _padded_matmul(aten.bmm.default, a, b)


def _scaled_epilogue(product: IRNode, bias: IRNode, beta: Any, alpha: Any) -> TensorBox:
    """``beta * bias + alpha * product`` as a pointwise epilogue that can fuse onward."""
    bias = to_dtype(expand(bias, product.get_size()), product.get_dtype())
    p_load, b_load = product.make_loader(), bias.make_loader()
    dtype = product.get_dtype()

    def inner_fn(idx: Any) -> Any:
        p, b = p_load(idx), b_load(idx)
        if alpha != 1:
            p = ops.mul(p, ops.constant(alpha, dtype))
        if beta != 1:
            b = ops.mul(b, ops.constant(beta, dtype))
        return ops.add(p, b) if beta != 0 else p

    return Pointwise.create(product.get_device(), dtype, inner_fn, product.get_size())


@register_lowering(aten.addmm)
def addmm(bias: IRNode, a: IRNode, b: IRNode, *, beta: Any = 1, alpha: Any = 1) -> TensorBox:
    # A row bias goes into the library call (cuBLASLt adds it in the matmul's epilogue:
    # no extra pass over the output); other forms are a matmul plus a pointwise epilogue
    # that fuses with what follows.
    library_bias = beta == 1 and alpha == 1 and len(bias.get_size()) == 1 and \
        a.get_device().type == "cuda" and V.graph.sizevars.statically_known_equals(
            bias.get_size()[0], b.get_size()[-1])
    tuned = tuned_matmul("mm", a, b, 1, 2, library_epilogue=library_bias)
    if tuned is not None:  # max-autotune chose the template: the bias fuses into its store
        return _scaled_epilogue(tuned, bias, beta, alpha)
    if library_bias:
        return _padded_addmm(bias, a, b)
    return _scaled_epilogue(mm(a, b, 1, 2), bias, beta, alpha)


def _padded_addmm(bias: IRNode, a: IRNode, b: IRNode) -> TensorBox:
    """``addmm(bias, a, b)`` as one library call (the bias added in its epilogue), with
    ``b``'s columns and ``bias`` zero-padded where rows would be unaligned (an LM head over
    a vocabulary of 30522): the output is written once, as a view of the padded rows, not
    a padded product and then a second, biased copy of it."""
    from .indexing import constant_pad_nd
    from .views import slice_

    pad = _row_padding(a, b)
    if pad == 1:
        return ExternKernel.create(aten.addmm.default, [bias, a, b])
    n = int(b.get_size()[-1])
    extra = -(-n // pad) * pad - n
    padded = constant_pad_nd(b, [0, extra])
    _keep_stride_order(padded, b)
    out = ExternKernel.create(aten.addmm.default, [constant_pad_nd(bias, [0, extra]), a, padded])
    return slice_(out, -1, 0, n)  # type: ignore[return-value]


@register_lowering(aten.baddbmm)
def baddbmm(bias: IRNode, a: IRNode, b: IRNode, *, beta: Any = 1, alpha: Any = 1
            ) -> TensorBox:
    return _scaled_epilogue(bmm(a, b, 1, 2), bias, beta, alpha)


@register_lowering(aten.convolution)
def convolution(x: IRNode, weight: IRNode, bias: IRNode | None, stride: Any, padding: Any,
                dilation: Any, transposed: bool, output_padding: Any, groups: int
                ) -> TensorBox:
    consts = (list(stride), list(padding), list(dilation), transposed, list(output_padding),
              groups)
    if _wants_channels_last(x):
        # cuDNN works in NHWC: giving it channels-last tensors saves a conversion each way.
        x, weight = require_channels_last(x), require_channels_last(weight)
    out = ExternKernel.create(aten.convolution.default, [x, weight], (None,) + consts)
    if _wants_channels_last(x):
        _plan_channels_last(out)
    if bias is None:
        return out
    # Bias as an epilogue over the channel dimension, fusable with what follows.
    ndim = len(out.get_size())
    from .views import view

    b = view(bias, [bias.get_size()[0]] + [1] * (ndim - 2))
    return _scaled_epilogue(out, b, 1, 1)


def _wants_channels_last(x: IRNode) -> bool:
    return x.get_device().type == "cuda" and len(x.get_size()) == 4 and \
        x.get_dtype() in (torch.float16, torch.bfloat16, torch.float32)


def _plan_channels_last(out: TensorBox) -> None:
    """cuDNN returns NHWC for NHWC inputs (the meta kernel says NCHW): plan for that."""
    from ..ir.layout import FixedLayout, strides_for_order
    from ..ir.nodes import CHANNELS_LAST_ORDER, Buffer

    buf = out.storage().data  # type: ignore[union-attr]
    assert isinstance(buf, Buffer)
    lay = buf.get_layout()
    if any(s == 1 for s in lay.size[1:]):
        return
    buf.layout = FixedLayout(lay.device, lay.dtype, lay.size,
                             strides_for_order(lay.size, CHANNELS_LAST_ORDER), lay.offset)


def require_channels_last(x: IRNode) -> IRNode:
    """``x`` laid out channels-last: a lazy or flexible buffer is simply laid out so, a
    fixed one (a graph input) is copied."""
    from ..ir.layout import strides_for_order
    from ..ir.nodes import CHANNELS_LAST_ORDER, Buffer, is_channels_last

    if any(s == 1 for s in x.get_size()[1:]):
        return x
    storage = x.storage() if isinstance(x, TensorBox) else None
    if storage is not None and isinstance(x, TensorBox) and x.data is storage:
        storage.realize()
        buf = storage.data
        assert isinstance(buf, Buffer)
        if buf.is_flexible():
            buf.freeze_layout(strides_for_order(buf.get_size(), CHANNELS_LAST_ORDER))
            return x
        if is_channels_last(buf.get_stride(), buf.get_size()):
            return x
    copy = Pointwise.create(x.get_device(), x.get_dtype(), x.make_loader(), x.get_size())
    copy.realize()
    buf = copy.storage().data  # type: ignore[union-attr]
    assert isinstance(buf, Buffer)
    buf.freeze_layout(strides_for_order(buf.get_size(), CHANNELS_LAST_ORDER))
    return copy


@register_lowering(aten.copy_)
def copy_(dst: IRNode, src: IRNode, non_blocking: bool = False) -> IRNode:
    """Write ``src`` into the graph input ``dst`` in place (AOTAutograd's input mutations)."""
    return V.graph.mutate_input(dst, expand(to_dtype(src, dst.get_dtype()), dst.get_size()))


# Random ops run eagerly so that the random stream stays exactly eager's.
_FORCED_FALLBACKS = [
    aten.native_dropout, aten.bernoulli, aten.rand, aten.randn, aten.rand_like,
    aten.randn_like, aten.randint, aten.randperm, aten.normal, aten.uniform,
    aten.multinomial, aten.exponential,
]


def _make_fallback(op: Any) -> None:
    for name in op.overloads():
        overload = getattr(op, name)
        lowerings[overload] = lambda *a, _op=overload, **k: make_fallback_call(_op, a, k)


for _op in _FORCED_FALLBACKS:
    _make_fallback(_op)
