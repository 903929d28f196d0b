"""Indirect loads and data movement: index, gather, embedding, index_select, cat, pad,
slice_scatter and select_scatter, as loops with masked or indirect loads."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
import torch

from ..ir.nodes import IRNode, Pointwise, TensorBox
from ..ir.sym import Expr, FloorDiv, sympify_tuple
from ..virtualized import ops
from .registry import (
    DEFAULT,
    broadcast_shapes,
    expand,
    promote_dtypes,
    register_lowering,
    size_value,
)
from .views import _clamp

aten = torch.ops.aten


def _norm(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _indirect(loader: Any, index: Sequence[Expr], size: Expr) -> sympy.Symbol:
    return ops.indirect_indexing(loader(index), size)


def advanced_indexer(size: Sequence[Expr], indices: Sequence[IRNode | None]
                     ) -> tuple[list[Expr], Any]:
    """The shape of ``x[indices]`` (ATen's advanced-indexing rules) and the map from an
    index of it to the index of ``x`` it reads; index_put scatters along the same map."""
    size = list(size)
    indices = list(indices) + [None] * (len(size) - len(indices))
    adv = [i for i, t in enumerate(indices) if t is not None]
    bshape = list(broadcast_shapes(*[indices[i].get_size() for i in adv]))  # type: ignore
    tensors = {i: expand(indices[i], bshape) for i in adv}  # type: ignore[arg-type]
    loaders = {i: t.make_loader() for i, t in tensors.items()}
    contiguous = adv == list(range(adv[0], adv[-1] + 1))
    before = adv[0] if contiguous else 0
    rest = [d for d in range(len(size)) if d not in adv]
    out_size = ([size[d] for d in rest[:before]] + bshape + [size[d] for d in rest[before:]])
    nb = len(bshape)

    def to_source(idx: Sequence[Expr]) -> list[Expr]:
        bidx = list(idx[before:before + nb])
        plain = list(idx[:before]) + list(idx[before + nb:])
        full: list[Expr] = [sympy.Integer(0)] * len(size)
        for k, d in enumerate(rest):
            full[d] = plain[k]
        for d in adv:
            full[d] = _indirect(loaders[d], bidx, size[d])
        return full

    return out_size, to_source


@register_lowering(aten.index.Tensor)
def index(x: IRNode, indices: Sequence[IRNode | None]) -> TensorBox:
    """``x[indices]`` with ATen's advanced-indexing shape rules."""
    out_size, to_source = advanced_indexer(x.get_size(), indices)
    x_loader = x.make_loader()

    def inner_fn(idx: Sequence[Expr]) -> Any:
        return x_loader(to_source(idx))

    return Pointwise.create(x.get_device(), x.get_dtype(), inner_fn, sympify_tuple(out_size))


@register_lowering(aten.gather)
def gather(x: IRNode, dim: int, index_t: IRNode, sparse_grad: bool = False) -> TensorBox:
    size = list(x.get_size())
    dim = _norm(dim, len(size))
    x_loader, i_loader = x.make_loader(), index_t.make_loader()

    def inner_fn(idx: Sequence[Expr]) -> Any:
        full = list(idx)
        full[dim] = _indirect(i_loader, idx, size[dim])
        return x_loader(full)

    return Pointwise.create(x.get_device(), x.get_dtype(), inner_fn, index_t.get_size())


@register_lowering(aten.embedding)
def embedding(weight: IRNode, indices: IRNode, padding_idx: int = -1,
              scale_grad_by_freq: bool = False, sparse: bool = False) -> TensorBox:
    w_loader, i_loader = weight.make_loader(), indices.make_loader()
    nidx = len(indices.get_size())
    rows = weight.get_size()[0]

    def inner_fn(idx: Sequence[Expr]) -> Any:
        row = _indirect(i_loader, idx[:nidx], rows)
        return w_loader([row, idx[nidx]])

    size = tuple(indices.get_size()) + (weight.get_size()[1],)
    return Pointwise.create(weight.get_device(), weight.get_dtype(), inner_fn, size)


@register_lowering(aten.index_select)
def index_select(x: IRNode, dim: int, index_t: IRNode) -> TensorBox:
    size = list(x.get_size())
    dim = _norm(dim, len(size))
    x_loader, i_loader = x.make_loader(), index_t.make_loader()
    scalar_index = len(index_t.get_size()) == 0  # a 0-d index selects one entry, kept as dim

    def inner_fn(idx: Sequence[Expr]) -> Any:
        full = list(idx)
        full[dim] = _indirect(i_loader, [] if scalar_index else [idx[dim]], size[dim])
        return x_loader(full)

    out = size[:dim] + [index_t.get_size()[0] if index_t.get_size() else 1] + size[dim + 1:]
    return Pointwise.create(x.get_device(), x.get_dtype(), inner_fn, tuple(out))


def _in_range(i: Expr, lo: Expr, hi: Expr) -> Any:
    lo_ok = ops.ge(ops.index_expr(i, torch.int64), size_value(lo, torch.int64))
    hi_ok = ops.lt(ops.index_expr(i, torch.int64), size_value(hi, torch.int64))
    return ops.logical_and(lo_ok, hi_ok)


@register_lowering(aten.cat)
def cat(tensors: Sequence[IRNode], dim: int = 0) -> IRNode:
    tensors = [t for t in tensors if not (len(t.get_size()) == 1 and t.get_size()[0] == 0)]
    if len(tensors) == 1:
        return tensors[0]
    size = list(tensors[0].get_size())
    dim = _norm(dim, len(size))
    starts, total = [], sympy.Integer(0)
    for t in tensors:
        starts.append(total)
        total = total + t.get_size()[dim]
    _, dtype = promote_dtypes(list(tensors), DEFAULT)
    loaders = [t.make_loader() for t in tensors]

    def inner_fn(idx: Sequence[Expr]) -> Any:
        result = None
        for k in reversed(range(len(tensors))):
            shifted = list(idx)
            shifted[dim] = idx[dim] - starts[k]
            load, src = loaders[k], tensors[k].get_dtype()
            value = _masked_load(load, shifted, src, dtype, _in_range(
                idx[dim], starts[k], starts[k] + tensors[k].get_size()[dim]), 0)
            if result is None:
                result = value
            else:
                mask = _in_range(idx[dim], starts[k], starts[k] + tensors[k].get_size()[dim])
                result = ops.where(mask, value, result)
        return result

    size[dim] = total
    return Pointwise.create(tensors[0].get_device(), dtype, inner_fn, tuple(size))


def _masked_load(load: Any, index: Sequence[Expr], src: torch.dtype, dtype: torch.dtype,
                 mask: Any, other: Any) -> Any:
    return ops.masked(mask, lambda: ops.to_dtype(load(index), dtype, src), other)


@register_lowering(aten.constant_pad_nd)
def constant_pad_nd(x: IRNode, pad: Sequence[int], value: float = 0.0) -> TensorBox:
    size = list(x.get_size())
    new = list(size)
    lows: dict[int, int] = {}
    for k in range(len(pad) // 2):
        d = len(size) - 1 - k
        lo, hi = pad[2 * k], pad[2 * k + 1]
        lows[d] = lo
        new[d] = size[d] + lo + hi
    load, dtype = x.make_loader(), x.get_dtype()

    def inner_fn(idx: Sequence[Expr]) -> Any:
        src = [i - lows.get(d, 0) for d, i in enumerate(idx)]
        mask = None
        for d in lows:
            m = _in_range(src[d], 0, size[d])
            mask = m if mask is None else ops.logical_and(mask, m)
        if mask is None:
            return load(src)
        return ops.masked(mask, lambda: load(src), value)

    return Pointwise.create(x.get_device(), dtype, inner_fn, tuple(new))


@register_lowering(aten.slice_scatter)
def slice_scatter(x: IRNode, src: IRNode, dim: int = 0, start: int | None = None,
                  end: int | None = None, step: int = 1) -> TensorBox:
    size = list(x.get_size())
    dim = _norm(dim, len(size))
    n = sympy.sympify(size[dim])
    start = _clamp(0 if start is None else start, n)
    end = _clamp(n if end is None else end, n)
    x_load, s_load, dtype = x.make_loader(), src.make_loader(), x.get_dtype()

    def inner_fn(idx: Sequence[Expr]) -> Any:
        i = ops.index_expr(idx[dim], torch.int64)
        inside = _in_range(idx[dim], start, end)
        if step != 1:
            on_step = ops.eq(ops.remainder(ops.sub(i, size_value(start, torch.int64)),
                                           ops.constant(step, torch.int64)),
                             ops.constant(0, torch.int64))
            inside = ops.logical_and(inside, on_step)
        shifted = list(idx)
        shifted[dim] = FloorDiv(idx[dim] - start, step) if step != 1 else idx[dim] - start
        from_src = ops.masked(inside, lambda: ops.to_dtype(s_load(shifted), dtype), 0)
        return ops.where(inside, from_src, x_load(idx))

    return Pointwise.create(x.get_device(), dtype, inner_fn, tuple(size))


@register_lowering(aten.select_scatter)
def select_scatter(x: IRNode, src: IRNode, dim: int, index: int) -> TensorBox:
    size = list(x.get_size())
    dim = _norm(dim, len(size))
    position = _clamp(index, sympy.sympify(size[dim]))
    x_load, s_load, dtype = x.make_loader(), src.make_loader(), x.get_dtype()

    def inner_fn(idx: Sequence[Expr]) -> Any:
        hit = ops.eq(ops.index_expr(idx[dim], torch.int64), size_value(position, torch.int64))
        from_src = ops.to_dtype(s_load(list(idx[:dim]) + list(idx[dim + 1:])), dtype)
        return ops.where(hit, from_src, x_load(idx))

    return Pointwise.create(x.get_device(), dtype, inner_fn, tuple(size))
