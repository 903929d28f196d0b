"""Views that remap indices but have no plain strides in torch: flip (negative strides)
and diagonal (a strided view of its base); and ``prims.copy_strided``, a copy laid out
with given strides. Like every view they copy nothing until something realizes them."""

from __future__ import annotations

from collections.abc import Sequence

import sympy
import torch

from ..ir.nodes import Buffer, IRNode, Pointwise, TensorBox, View
from ..ir.sym import Expr, sympify_tuple
from .registry import register_lowering

aten = torch.ops.aten
prims = torch.ops.prims


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + max(ndim, 1) if dim < 0 else dim


@register_lowering(aten.flip, prims.rev)
def flip(x: IRNode, dims: Sequence[int]) -> IRNode:
    size = list(x.get_size())
    flipped = {_norm_dim(d, len(size)) for d in dims}
    flipped = {d for d in flipped if d < len(size) and size[d] != 1}
    if not flipped:
        return x

    def reindex(index: Sequence[Expr]) -> list[Expr]:
        return [size[d] - 1 - index[d] if d in flipped else index[d] for d in range(len(size))]

    base = x.data if isinstance(x, TensorBox) else x
    return TensorBox(View(base, tuple(size), reindex, "flip"))


def diagonal_length(n1: int, n2: int, offset: int) -> int:
    """How many elements the diagonal at ``offset`` of an ``n1 x n2`` matrix has."""
    return max(min(n1, n2 - offset), 0) if offset >= 0 else max(min(n1 + offset, n2), 0)


@register_lowering(aten.diagonal)
def diagonal(x: IRNode, offset: int = 0, dim1: int = 0, dim2: int = 1) -> TensorBox:
    size = list(x.get_size())
    d1, d2 = _norm_dim(dim1, len(size)), _norm_dim(dim2, len(size))
    rest = [d for d in range(len(size)) if d not in (d1, d2)]
    length = diagonal_length(int(size[d1]), int(size[d2]), offset)
    row0, col0 = max(-offset, 0), max(offset, 0)

    def reindex(index: Sequence[Expr]) -> list[Expr]:
        out: list[Expr] = [sympy.Integer(0)] * len(size)
        for k, d in enumerate(rest):
            out[d] = index[k]
        out[d1] = index[-1] + row0
        out[d2] = index[-1] + col0
        return out

    new = [size[d] for d in rest] + [sympy.Integer(length)]
    base = x.data if isinstance(x, TensorBox) else x
    return TensorBox(View(base, tuple(sympify_tuple(new)), reindex, "diagonal"))


@register_lowering(prims.copy_strided)
def copy_strided(x: IRNode, stride: Sequence[int]) -> TensorBox:
    copy = Pointwise.create(x.get_device(), x.get_dtype(), x.make_loader(), x.get_size())
    copy.realize()
    buf = copy.storage().data  # type: ignore[union-attr]
    assert isinstance(buf, Buffer)
    buf.freeze_layout(sympify_tuple(stride))
    return copy
