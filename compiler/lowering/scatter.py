"""The scatter family: index_put, scatter, scatter_add, scatter_reduce, index_add,
embedding_dense_backward and as_strided_scatter, as a copy of the target followed by an
in-place ``Scatter``.

Two kernels per scatter: the first writes the whole target (a copy of ``self``, or a fill
for ``new_zeros``), the second walks the *source* and writes each element to an indirect
index of the target, with an atomic add, max or min where indices may repeat. Reduced
floats (fp16, bf16) accumulate into an fp32 target, cast back lazily (the cast fuses into
the readers). Where atomics make the result depend on timing (float sums) and the
program asked for deterministic algorithms, or the reduction has no atomic form (prod,
mean, ``include_self=False``), the op runs as ATen's own kernel instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch

from ..ir.extern import make_fallback_call
from ..ir.layout import MutationLayout, contiguous_strides
from ..ir.nodes import ComputedBuffer, IRNode, Pointwise, Scatter, StorageBox, TensorBox
from ..ir.sym import Expr, ModularIndexing
from ..virtualized import V, ops
from .fallbacks import EagerInstead
from .indexing import _indirect, _norm, advanced_indexer
from .registry import eager_strides, expand, register_lowering, value_loader

aten = torch.ops.aten

_REDUCED = (torch.float16, torch.bfloat16)
# scatter_reduce's reduce names (and scatter's "add") -> the atomic store that does them.
_ATOMIC = {"sum": "atomic_add", "add": "atomic_add", "amax": "atomic_max",
           "amin": "atomic_min"}

IndexMap = Callable[[Sequence[Expr]], Sequence[Expr]]


def deterministic_requested() -> bool:
    """True when atomics, whose float sums depend on timing, must not be used."""
    options = getattr(V.graph, "options", None) or {}
    return bool(options.get("deterministic")) or torch.are_deterministic_algorithms_enabled()


def _accumulator_dtype(dtype: torch.dtype, mode: str | None) -> torch.dtype:
    return torch.float32 if mode is not None and dtype in _REDUCED else dtype


def _needs_fallback(dtype: torch.dtype, mode: str | None) -> bool:
    if mode is None:
        return False
    if dtype == torch.bool or dtype.is_complex:
        return True
    # Integer sums, max and min are exact in any order; float sums are not.
    return mode == "atomic_add" and dtype.is_floating_point and deterministic_requested()


def _fallback(*args: Any, **kwargs: Any) -> Any:
    node = V.graph.current_node
    assert node is not None and isinstance(node.target, torch._ops.OpOverload)
    return make_fallback_call(node.target, args, kwargs)


def _realized_copy(x: IRNode, dtype: torch.dtype,
                   stride: Sequence[Expr] | None = None) -> ComputedBuffer:
    """A fresh buffer holding ``x`` as ``dtype``, contiguous unless ``stride`` is given:
    the scatter's target."""
    load = value_loader(x, dtype)
    box = Pointwise.create(x.get_device(), dtype, load, x.get_size())
    box.realize()
    storage = box.storage()
    assert storage is not None and isinstance(storage.data, ComputedBuffer)
    buf = storage.data
    buf.freeze_layout(stride)
    return buf


def scatter_into(x: IRNode, ranges: Sequence[Expr], to_target: IndexMap,
                 value: Callable[[Sequence[Expr]], Any], value_dtype: torch.dtype,
                 mode: str | None, stride: Sequence[Expr] | None = None) -> TensorBox:
    """Copy ``x`` (laid out with ``stride`` if given), then write ``value(i)`` at
    ``to_target(i)`` for every ``i`` in ``ranges``.

    ``value`` yields values of ``value_dtype``; they are converted to the target's dtype
    (fp32 for reduced floats with an atomic mode). The result reads the scattered target.
    """
    dtype = x.get_dtype()
    acc = _accumulator_dtype(dtype, mode)
    target = _realized_copy(x, acc, stride)
    lay = target.get_layout()

    def inner_fn(index: Sequence[Expr]) -> Any:
        v = value(index)
        return v if value_dtype == acc else ops.to_dtype(v, acc, value_dtype)

    data = Scatter(x.get_device(), acc, inner_fn, tuple(ranges), output_indexer=to_target,
                   scatter_mode=mode)
    layout = MutationLayout(lay.device, acc, lay.size, lay.stride, lay.offset,
                            target=target.get_name())
    buf = ComputedBuffer(name=None, layout=layout, data=data)
    buf.name = V.graph.register_buffer(buf)
    result = TensorBox(StorageBox(buf))
    if acc == dtype:
        return result
    load = result.make_loader()
    return Pointwise.create(x.get_device(), dtype,
                            lambda i: ops.to_dtype(load(i), dtype, acc), x.get_size())


def _source_value(src: Any, dtype: torch.dtype, shape: Sequence[Expr]
                  ) -> tuple[Callable[[Sequence[Expr]], Any], torch.dtype]:
    """A loader of ``src`` (a tensor read at the loop's index, or a scalar) over ``shape``."""
    if isinstance(src, IRNode):
        load = src.make_loader()
        return load, src.get_dtype()
    return value_loader(src, dtype), dtype


# -- index_put -------------------------------------------------------------------------


@register_lowering(aten.index_put, aten._unsafe_index_put)
def index_put(x: IRNode, indices: Sequence[IRNode | None], values: IRNode,
              accumulate: bool = False) -> TensorBox:
    """``x[indices] = values`` (``+=`` with ``accumulate``), out of place."""
    mode = "atomic_add" if accumulate else None
    if _needs_fallback(x.get_dtype(), mode) or any(
            i is not None and i.get_dtype() == torch.bool for i in indices):
        return _fallback(x, indices, values, accumulate)
    out_size, to_target = advanced_indexer(x.get_size(), indices)
    vals = expand(values, out_size)
    return scatter_into(x, out_size, to_target, vals.make_loader(), values.get_dtype(), mode)


# -- as_strided_scatter ------------------------------------------------------------------


@register_lowering(aten.as_strided_scatter)
def as_strided_scatter(x: IRNode, src: IRNode, size: Sequence[int], stride: Sequence[int],
                       storage_offset: int | None = None) -> IRNode:
    """A copy of ``x`` with ``src`` written through ``as_strided(size, stride, offset)`` of
    the copy's storage (what functionalization makes of an in-place write to a strided view
    of a base, e.g. Swin's window partition in the backward).

    Eager's copy has ``x``'s geometry: its strides and its storage offset, the offset the
    strides start from. Where ``x`` is dense (contiguous, or a permutation of it), the copy
    is made in that layout and each element of ``src`` goes to the element of ``x`` whose
    storage position the strides give. A window reaching past ``x``'s elements, or an
    ``x`` with gaps, runs ATen's kernel.
    """
    node = V.graph.current_node
    arg = node.args[0] if node is not None and node.args else None
    meta = arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None
    layout = eager_strides(arg=0)
    if not isinstance(meta, torch.Tensor) or layout is None:
        raise EagerInstead("as_strided_scatter into an input with gaps (or no eager layout)")
    shape = list(x.get_size())
    numel = int(meta.numel())
    base = int(meta.storage_offset())
    start = storage_offset if storage_offset is not None else base
    if any(int(s) < 0 for s in stride) or not base <= start or start + sum(
            (int(n) - 1) * int(s) for n, s in zip(size, stride)) >= base + numel:
        raise EagerInstead("as_strided_scatter window outside its input's elements")
    copy_stride = [sympy.Integer(int(s)) for s in layout]
    row_major = list(contiguous_strides(shape))
    strides = [sympy.Integer(int(s)) for s in stride]
    ranges = [sympy.Integer(int(n)) for n in size]
    load, dtype = _source_value(expand(src, ranges), x.get_dtype(), ranges)

    def position(idx: Sequence[Expr]) -> Expr:  # from x's first element
        return sympy.Integer(start - base) + sum(
            (i * s for i, s in zip(idx, strides)), sympy.Integer(0))

    if all(c == r for c, r, n in zip(copy_stride, row_major, shape) if n != 1):
        from .views import view  # a contiguous copy: scatter into it as one flat row

        out = scatter_into(view(x, [sympy.Integer(numel)]), ranges,
                           lambda i: [position(i)], load, dtype, None)
        return view(out, shape)

    def to_target(idx: Sequence[Expr]) -> list[Expr]:
        p = position(idx)
        return [sympy.Integer(0) if n == 1 else ModularIndexing(p, st, n)
                for st, n in zip(copy_stride, shape)]

    return scatter_into(x, ranges, to_target, load, dtype, None, copy_stride)


# -- scatter, scatter_add, scatter_reduce -------------------------------------------------


def _along_dim(dim: int, index_t: IRNode, size: Sequence[Expr]) -> IndexMap:
    """scatter's map: the loop index with ``dim`` replaced by ``index_t`` there."""
    load = index_t.make_loader()

    def to_target(idx: Sequence[Expr]) -> list[Expr]:
        full = list(idx)
        full[dim] = _indirect(load, idx, size[dim])
        return full

    return to_target


def _scatter(x: IRNode, dim: int, index_t: IRNode, src: Any, mode: str | None) -> TensorBox:
    size = x.get_size()
    dim = _norm(dim, len(size))
    ranges = index_t.get_size()
    if len(ranges) == 0:  # 0-d index: one element
        index_t = expand(index_t, [sympy.Integer(1)] * len(size))
        ranges = index_t.get_size()
    value, vdtype = _source_value(src, x.get_dtype(), ranges)
    return scatter_into(x, ranges, _along_dim(dim, index_t, size), value, vdtype, mode)


@register_lowering(aten.scatter.src, aten.scatter.value)
def scatter(x: IRNode, dim: int, index_t: IRNode, src: Any) -> TensorBox:
    return _scatter(x, dim, index_t, src, None)


@register_lowering(aten.scatter.reduce, aten.scatter.value_reduce)
def scatter_with_reduce(x: IRNode, dim: int, index_t: IRNode, src: Any, *,
                        reduce: str) -> TensorBox:
    mode = _ATOMIC.get(reduce)
    if mode is None or _needs_fallback(x.get_dtype(), mode):
        return _fallback(x, dim, index_t, src, reduce=reduce)
    return _scatter(x, dim, index_t, src, mode)


@register_lowering(aten.scatter_add)
def scatter_add(x: IRNode, dim: int, index_t: IRNode, src: IRNode) -> TensorBox:
    if _needs_fallback(x.get_dtype(), "atomic_add"):
        return _fallback(x, dim, index_t, src)
    return _scatter(x, dim, index_t, src, "atomic_add")


@register_lowering(aten.scatter_reduce.two)
def scatter_reduce(x: IRNode, dim: int, index_t: IRNode, src: IRNode, reduce: str, *,
                   include_self: bool = True) -> TensorBox:
    mode = _ATOMIC.get(reduce)
    if mode is None or not include_self or _needs_fallback(x.get_dtype(), mode):
        return _fallback(x, dim, index_t, src, reduce, include_self=include_self)
    return _scatter(x, dim, index_t, src, mode)


# -- index_add, embedding_dense_backward --------------------------------------------------


@register_lowering(aten.index_add)
def index_add(x: IRNode, dim: int, index_t: IRNode, source: IRNode, *,
              alpha: Any = 1) -> TensorBox:
    """``x.index_add(dim, index, source, alpha)``: source row ``i`` adds into row
    ``index[i]``."""
    if _needs_fallback(x.get_dtype(), "atomic_add"):
        return _fallback(x, dim, index_t, source, alpha=alpha)
    size = x.get_size()
    dim = _norm(dim, len(size))
    load_index = index_t.make_loader()
    scalar_index = len(index_t.get_size()) == 0

    def to_target(idx: Sequence[Expr]) -> list[Expr]:
        full = list(idx)
        full[dim] = _indirect(load_index, [] if scalar_index else [idx[dim]], size[dim])
        return full

    dtype = source.get_dtype()
    compute = torch.float32 if dtype in _REDUCED else dtype
    load = value_loader(source, compute)

    def value(idx: Sequence[Expr]) -> Any:
        v = load(idx)
        return v if alpha == 1 else ops.mul(v, ops.constant(alpha, compute))

    ranges = source.get_size() if source.get_size() else [sympy.Integer(1)] * len(size)
    return scatter_into(x, ranges, to_target, value, compute, "atomic_add")


@register_lowering(aten.embedding_dense_backward)
def embedding_dense_backward(grad: IRNode, indices: IRNode, num_weights: int,
                             padding_idx: int, scale_grad_by_freq: bool) -> TensorBox:
    """The weight gradient of an embedding: grad rows added into rows ``indices``, rows
    equal to ``padding_idx`` left out; accumulated in fp32."""
    if scale_grad_by_freq or _needs_fallback(grad.get_dtype(), "atomic_add"):
        return _fallback(grad, indices, num_weights, padding_idx, scale_grad_by_freq)
    from .creation import full

    dtype = grad.get_dtype()
    compute = torch.float32 if dtype in _REDUCED else dtype
    nidx = len(indices.get_size())
    width = list(grad.get_size()[nidx:])
    zeros = full([num_weights, *width], 0, dtype=compute, device=grad.get_device())
    load_index, load_grad = indices.make_loader(), value_loader(grad, compute)

    def to_target(idx: Sequence[Expr]) -> list[Expr]:
        return [_indirect(load_index, idx[:nidx], sympy.Integer(num_weights)), *idx[nidx:]]

    def value(idx: Sequence[Expr]) -> Any:
        g = load_grad(idx)
        if padding_idx < 0:
            return g
        i = load_index(idx[:nidx])
        pad = ops.eq(i, ops.constant(padding_idx, indices.get_dtype()))
        return ops.where(pad, ops.constant(0, compute), g)

    out = scatter_into(zeros, grad.get_size(), to_target, value, compute, "atomic_add")
    if compute == dtype:
        return out
    load = out.make_loader()
    return Pointwise.create(grad.get_device(), dtype,
                            lambda i: ops.to_dtype(load(i), dtype, compute), out.get_size())
