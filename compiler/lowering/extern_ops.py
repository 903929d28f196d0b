"""Matmul and convolution through the vendor library (ExternKernel), in-place copies into
graph inputs, and ops that must stay eager (random ops keep eager's random stream)."""

from __future__ import annotations

from typing import Any

import torch

from ..ir.extern import ExternKernel, make_fallback_call
from ..ir.nodes import IRNode, Pointwise, TensorBox
from ..virtualized import V, ops
from .pointwise import to_dtype
from .registry import expand, lowerings, register_lowering

aten = torch.ops.aten


@register_lowering(aten.mm)
def mm(a: IRNode, b: IRNode) -> TensorBox:
    return ExternKernel.create(aten.mm.default, [a, b])


@register_lowering(aten.bmm)
def bmm(a: IRNode, b: IRNode) -> TensorBox:
    return ExternKernel.create(aten.bmm.default, [a, b])


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
    # The matmul goes to the library; the bias add stays a loop so it fuses with what follows.
    return _scaled_epilogue(mm(a, b), bias, beta, alpha)


@register_lowering(aten.baddbmm)
def baddbmm(bias: IRNode, a: IRNode, b: IRNode, *, beta: Any = 1, alpha: Any = 1
            ) -> TensorBox:
    return _scaled_epilogue(bmm(a, b), bias, beta, alpha)


@register_lowering(aten.convolution)
def convolution(x: IRNode, weight: IRNode, bias: IRNode | None, stride: Any, padding: Any,
                dilation: Any, transposed: bool, output_padding: Any, groups: int
                ) -> TensorBox:
    consts = (list(stride), list(padding), list(dilation), transposed, list(output_padding),
              groups)
    out = ExternKernel.create(aten.convolution.default, [x, weight], (None,) + consts)
    if bias is None:
        return out
    # Bias as an epilogue over the channel dimension, fusable with what follows.
    ndim = len(out.get_size())
    from .views import view

    b = view(bias, [int(bias.get_size()[0])] + [1] * (ndim - 2))
    return _scaled_epilogue(out, b, 1, 1)


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
