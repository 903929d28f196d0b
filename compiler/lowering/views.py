"""View lowerings: each remaps indices onto its base and copies nothing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
import torch

from ..ir.extern import realize_input
from ..ir.layout import FixedLayout
from ..ir.nodes import Buffer, IRNode, ReinterpretView, TensorBox, View
from ..ir.sym import Expr, FloorDiv, ModularIndexing, prod, sympify_tuple
from ..virtualized import V
from .registry import eager_strides, expand, register_lowering

aten = torch.ops.aten
prims = torch.ops.prims


def _view(x: IRNode, size: Sequence[Expr], reindex: Any, kind: str) -> TensorBox:
    base = x.data if isinstance(x, TensorBox) else x
    return TensorBox(View(base, tuple(sympify_tuple(size)), reindex, kind))


def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _infer_size(size: Sequence[int], numel: Expr) -> list[Expr]:
    size = list(size)
    if -1 in size:
        i = size.index(-1)
        known = prod(s for j, s in enumerate(size) if j != i)
        quotient = sympy.simplify(numel / known)
        num, den = sympy.fraction(sympy.cancel(quotient))
        # A symbolic size that sympy cannot divide exactly: Dynamo's guards made it exact.
        size[i] = quotient if den == 1 else FloorDiv(numel, known)
    return list(sympify_tuple(size))


def _reshape_groups(old: Sequence[Expr], new: Sequence[Expr]
                    ) -> list[tuple[list[int], list[int]]]:
    """Pair runs of non-1 dims of ``old`` and ``new`` whose sizes multiply to the same."""
    oi = [d for d in range(len(old)) if old[d] != 1]
    nj = [d for d in range(len(new)) if new[d] != 1]
    groups: list[tuple[list[int], list[int]]] = []
    a = b = 0
    while a < len(oi) and b < len(nj):
        gi, gj = [oi[a]], [nj[b]]
        po, pn = old[oi[a]], new[nj[b]]
        a, b = a + 1, b + 1
        while sympy.expand(po - pn) != 0:
            if a >= len(oi) and b >= len(nj):
                if not sympy.expand(po - pn).free_symbols:
                    raise ValueError(f"cannot pair the sizes {tuple(old)} with {tuple(new)}")
                # The last dims of both sides, equal in number of elements at every size
                # Dynamo admits but not provably here: its trace of the view guarded the
                # numels equal (as (s + 1) // 2 * 2 == s for an even s, which the symbol's
                # range does not carry), and every earlier group is provably equal.
                break
            # Which side grows next is a heuristic (hints); the loop checks the pairing.
            hint = V.graph.sizevars.size_hint
            if a < len(oi) and (b >= len(nj) or hint(po) < hint(pn)):
                gi.append(oi[a])
                po, a = po * old[oi[a]], a + 1
            else:
                gj.append(nj[b])
                pn, b = pn * new[nj[b]], b + 1
        groups.append((gi, gj))
    return groups


def reshape_reindex(old: Sequence[Expr], new: Sequence[Expr]) -> Any:
    """Index map from a reshaped view to its base, matching dimension groups by product."""
    groups = _reshape_groups(old, new)

    def reindex(index: Sequence[Expr]) -> list[Expr]:
        out: list[Expr] = [sympy.Integer(0)] * len(old)
        for gi, gj in groups:
            flat: Expr = sympy.Integer(0)
            for d in gj:
                flat = flat * new[d] + index[d]
            stride: Expr = sympy.Integer(1)
            for d in reversed(gi):
                out[d] = FloorDiv(flat, stride) if d == gi[0] else \
                    ModularIndexing(flat, stride, old[d])
                stride = stride * old[d]
        return out

    return reindex


@register_lowering(aten.view, aten.reshape, aten._unsafe_view, prims.reshape)
def view(x: IRNode, size: Sequence[int]) -> IRNode:
    if isinstance(size, torch.dtype):
        from ..ir.extern import make_fallback_call

        return make_fallback_call(aten.view.dtype, [x, size], {})
    old = list(x.get_size())
    new = _infer_size(size, prod(old))
    if old == new:
        return x
    return _view(x, new, reshape_reindex(old, new), "reshape")


@register_lowering(aten.permute, prims.transpose)
def permute(x: IRNode, dims: Sequence[int]) -> TensorBox:
    ndim = len(x.get_size())
    dims = [_norm_dim(d, ndim) for d in dims]
    size = [x.get_size()[d] for d in dims]
    inverse = [dims.index(i) for i in range(ndim)]

    def reindex(index: Sequence[Expr]) -> list[Expr]:
        return [index[inverse[i]] for i in range(ndim)]

    return _view(x, size, reindex, "permute")


@register_lowering(aten.t)
def t(x: IRNode) -> IRNode:
    return permute(x, [1, 0]) if len(x.get_size()) == 2 else x


@register_lowering(aten.transpose)
def transpose(x: IRNode, d0: int, d1: int) -> TensorBox:
    dims = list(range(len(x.get_size())))
    d0, d1 = _norm_dim(d0, len(dims)), _norm_dim(d1, len(dims))
    dims[d0], dims[d1] = dims[d1], dims[d0]
    return permute(x, dims)


@register_lowering(aten.expand, prims.broadcast_in_dim)
def expand_(x: IRNode, size: Sequence[int], *args: Any, implicit: bool = False) -> IRNode:
    if args:  # prims.broadcast_in_dim(x, shape, broadcast_dimensions)
        dims = list(args[0])
        inner = list(sympify_tuple(size))
        shape = [sympy.Integer(1)] * len(inner)
        for k, d in enumerate(dims):
            shape[d] = x.get_size()[k]
        x = view(x, shape)
        return expand(x, inner)
    old = x.get_size()
    new = [old[i - (len(size) - len(old))] if s == -1 else s for i, s in enumerate(size)]
    return expand(x, sympify_tuple(new))


@register_lowering(aten.unsqueeze)
def unsqueeze(x: IRNode, dim: int) -> TensorBox:
    size = list(x.get_size())
    dim = _norm_dim(dim, len(size) + 1)
    new = size[:dim] + [sympy.Integer(1)] + size[dim:]
    return _view(x, new, lambda idx: list(idx[:dim]) + list(idx[dim + 1:]), "unsqueeze")


@register_lowering(aten.squeeze, prims.squeeze)
def squeeze(x: IRNode, dim: int | Sequence[int] | None = None) -> IRNode:
    size = list(x.get_size())
    if not size:  # squeezing a 0-d tensor (dim 0 or -1 names it) changes nothing
        return x
    if dim is None:
        dims = [i for i, s in enumerate(size) if s == 1]
    else:
        dims = [dim] if isinstance(dim, int) else list(dim)
        dims = [_norm_dim(d, len(size)) for d in dims if size[_norm_dim(d, len(size))] == 1]
    if not dims:
        return x
    keep = [i for i in range(len(size)) if i not in dims]

    def reindex(index: Sequence[Expr]) -> list[Expr]:
        out: list[Expr] = [sympy.Integer(0)] * len(size)
        for k, d in enumerate(keep):
            out[d] = index[k]
        return out

    return _view(x, [size[i] for i in keep], reindex, "squeeze")


def _traced_end(dim: int, start: Expr, step: int) -> Expr | None:
    """Where the slice being lowered ends by its traced output (``start`` plus the
    output's length along ``dim``): a slice ``[:s1]`` of a fixed-size table (BERT's
    position ids) traced to length ``s1`` was guarded ``s1 <= size`` by Dynamo, a bound
    the symbol's range does not carry. None where the node or its output is not known."""
    node = V.graph.current_node
    val = node.meta.get("val") if node is not None and \
        node.target is aten.slice.Tensor else None
    shape = getattr(val, "shape", None)  # a FakeTensor, or a SymbolicTensor on a worker
    if step != 1 or not isinstance(shape, (tuple, torch.Size)) or dim >= len(shape):
        return None
    return sympy.expand(start + sympify_tuple([shape[dim]])[0])


def _clamp(value: Any, n: Expr, traced: Expr | None = None) -> Expr:
    """A slice bound in ``[0, n]`` (negative counts from the end), proved for every size
    a graph with dynamic shapes admits, or equal to where the traced slice ends
    (``traced``); ValueError when it cannot be."""
    v = sympy.sympify(value)
    if traced is not None and v.is_nonnegative and sympy.expand(traced - v) == 0:
        return v
    if v.is_Integer and n.is_Integer:
        i, size = int(v), int(n)
        return sympy.Integer(max(0, min(i + size if i < 0 else i, size)))
    known_geq = V.graph.sizevars.statically_known_geq
    if v.is_Integer and int(v) < 0:
        v = sympy.expand(n + v)
    elif v.is_Integer and int(v) >= 2**62:  # "to the end" (INT64_MAX)
        return n
    if known_geq(v, 0) and known_geq(n, v):
        return v
    if known_geq(v, n):
        return n
    raise ValueError(f"slice bound {value} of a dimension of size {n} is not provably in range")


@register_lowering(aten.slice)
def slice_(x: IRNode, dim: int = 0, start: int | None = None, end: int | None = None,
           step: int = 1) -> IRNode:
    size = list(x.get_size())
    dim = _norm_dim(dim, len(size))
    n = sympy.sympify(size[dim])
    start_ = _clamp(0 if start is None else start, n)
    end_ = _clamp(n if end is None else end, n, _traced_end(dim, start_, step))
    if start_ == 0 and sympy.expand(end_ - n) == 0 and step == 1:
        return x
    if n.is_Integer and start_.is_Integer and end_.is_Integer:
        length: Expr = sympy.Integer(max(0, (int(end_) - int(start_) + step - 1) // step))
    elif step == 1 and V.graph.sizevars.statically_known_geq(end_, start_):
        length = sympy.expand(end_ - start_)
    elif step > 1 and V.graph.sizevars.statically_known_geq(end_, start_):
        # every step-th element: ceil((end - start) / step), as eager's size is
        length = FloorDiv(sympy.expand(end_ - start_ + step - 1), step)
    else:
        raise ValueError(f"slice [{start}:{end}:{step}] of a dimension of size {n}")
    new = size[:dim] + [length] + size[dim + 1:]
    start = start_  # type: ignore[assignment]

    def reindex(index: Sequence[Expr]) -> list[Expr]:
        out = list(index)
        out[dim] = index[dim] * step + start
        return out

    return _view(x, new, reindex, "slice")


@register_lowering(aten.select)
def select(x: IRNode, dim: int, index: int) -> TensorBox:
    size = list(x.get_size())
    dim = _norm_dim(dim, len(size))
    position = _clamp(index, sympy.sympify(size[dim]))

    def reindex(idx: Sequence[Expr]) -> list[Expr]:
        return list(idx[:dim]) + [position] + list(idx[dim:])

    return _view(x, size[:dim] + size[dim + 1:], reindex, "select")


@register_lowering(aten.split_with_sizes)
def split_with_sizes(x: IRNode, sizes: Sequence[int], dim: int = 0) -> list[IRNode]:
    out, start = [], 0
    for s in sizes:
        out.append(slice_(x, dim, start, start + s))
        start += s
    return out


@register_lowering(aten.split)
def split(x: IRNode, split_size: int | Sequence[int], dim: int = 0) -> list[IRNode]:
    if not isinstance(split_size, int):
        return split_with_sizes(x, split_size, dim)
    n = int(x.get_size()[_norm_dim(dim, len(x.get_size()))])
    return split_with_sizes(x, [min(split_size, n - s) for s in range(0, n, split_size)], dim)


@register_lowering(aten.unbind)
def unbind(x: IRNode, dim: int = 0) -> list[IRNode]:
    n = int(x.get_size()[_norm_dim(dim, len(x.get_size()))])
    return [select(x, dim, i) for i in range(n)]


@register_lowering(aten.as_strided)
def as_strided(x: IRNode, size: Sequence[int], stride: Sequence[int],
               storage_offset: int | None = None) -> IRNode:
    """A view of the base's storage: realize the base, then reinterpret its strides."""
    _realize_with_eager_strides(x)
    base = realize_input(x)
    buf = base.data if isinstance(base, ReinterpretView) else base
    assert isinstance(buf, Buffer)
    buf.freeze_layout()
    if storage_offset is not None:
        offset: Expr = sympy.Integer(storage_offset)
    elif isinstance(base, ReinterpretView):  # eager keeps the view's own offset
        offset = base.layout.offset
    else:
        offset = buf.get_layout().offset
    layout = FixedLayout(buf.get_device(), buf.get_dtype(), sympify_tuple(size),
                         sympify_tuple(stride), offset)
    return TensorBox(ReinterpretView(buf, layout))


def _realize_with_eager_strides(x: IRNode) -> None:
    """Realize a lazy ``x`` in the memory layout eager gives it.

    ``as_strided`` reads raw storage, so the buffer under it must be laid out as in eager
    (a pointwise op on a transposed input is transposed in memory too).
    """
    if not isinstance(x, TensorBox):
        return
    storage = x.storage()
    if storage is None or storage.is_realized() or x.data is not storage:
        return
    stride = eager_strides(arg=0)
    storage.realize()
    buf = storage.data
    if stride is not None and len(stride) == len(x.get_size()) and isinstance(buf, Buffer):
        buf.freeze_layout(sympify_tuple(stride))


@register_lowering(aten.alias)
def alias(x: IRNode) -> IRNode:
    return x
