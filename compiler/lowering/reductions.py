"""Reduction lowerings. A reduction is realized as soon as it is made: inlining it into a
consumer would recompute the whole reduction for every element the consumer reads."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch

from ..dependencies import extract_read_writes, reduction_access_order
from ..ir.nodes import IRNode, Pointwise, Reduction, TensorBox
from ..ir.sym import Expr, prod, unflatten_index
from ..virtualized import V, ops
from .pointwise import to_dtype
from .registry import register_lowering, size_value
from .views import view

aten = torch.ops.aten
prims = torch.ops.prims

_IDENTITY_DTYPE = {"any": torch.bool, "all": torch.bool, "argmax": torch.int64,
                   "argmin": torch.int64}


def _dims(x: IRNode, dim: int | Sequence[int] | None) -> list[int]:
    ndim = len(x.get_size())
    if ndim == 0:  # a 0-d tensor accepts dim 0 or -1 and has nothing to reduce over
        return []
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d + ndim if d < 0 else d for d in dims})


def _result_dtype(x: IRNode, reduction_type: str, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    if reduction_type in _IDENTITY_DTYPE:
        return _IDENTITY_DTYPE[reduction_type]
    src = x.get_dtype()
    if reduction_type in ("sum", "prod") and (src == torch.bool or not src.is_floating_point):
        return torch.int64
    return src


def make_reduction_node(x: IRNode, dims: list[int], reduction_type: str, dtype: torch.dtype,
                        keepdim: bool, output_index: int | None = None,
                        src_dtype: torch.dtype | None = None) -> TensorBox:
    """Build and realize the Reduction of ``x`` over ``dims`` (kept dims become size 1)."""
    size = list(x.get_size())
    ranges, rranges, load = _reduction_ranges(x, dims)
    src = src_dtype or x.get_dtype()

    def inner_fn(index: Sequence[Expr], rindex: Sequence[Expr]) -> Any:
        value = load(index, rindex)
        return ops.to_dtype(value, src, x.get_dtype()) if src != x.get_dtype() else value

    if prod(rranges) == 1:
        # Nothing to reduce (a 0-d input, or size-1 dims): the reduction of one element.
        zeros = [sympy.Integer(0)] * len(dims)
        single = _reduce_one(reduction_type, output_index)
        result: TensorBox = Pointwise.create(
            x.get_device(), dtype, lambda idx: ops.to_dtype(single(inner_fn(idx, zeros), dtype),
                                                            dtype), ranges)
    elif reduction_type in _SPLITTABLE and \
            (split := _split_factor(x, inner_fn, reduction_type, ranges, rranges)).factor > 1:
        result = _split_reduction(x, inner_fn, ranges, rranges, reduction_type, dtype, src,
                                  split)
    else:
        node = Reduction(x.get_device(), dtype, inner_fn, ranges, rranges, reduction_type,
                         src, output_index)
        result = TensorBox.create(node)
        result.realize()
    if keepdim:
        shape = [1 if d in dims else s for d, s in enumerate(size)]
        return view(result, shape)  # type: ignore[return-value]
    return result


# A reduction to few outputs over many elements runs in two stages, so that more than a
# handful of programs share the work.
_SPLITTABLE = {"sum": "sum", "prod": "prod", "max": "max", "min": "min", "any": "any",
               "all": "all"}
SPLIT_MIN_RNUMEL = 65536
SPLIT_MAX_OUTPUTS = 64
# On a GPU: stage one aims at this many programs per SM, each reducing at least
# GPU_MIN_CHUNK elements of a row (GPU_MIN_OUTER_CHUNK rows of a column block).
GPU_PROGRAMS_PER_SM = 2
GPU_MIN_CHUNK = 1024
GPU_MIN_OUTER_CHUNK = 32
GPU_MIN_WORK = 2**18
ROW_PART_MIN_ROWS = 64
# Columns a program of an outer (column) reduction covers (heuristics.py's first config).
OUTER_XBLOCK = 64
DEFAULT_SM_COUNT = 132  # an H100 / H200, when the target does not say


@dataclass(frozen=True)
class Split:
    """How a reduction splits: ``factor`` chunks, with the chunk index the outermost
    dimension of the partials (``outer``, column sums: stage one stays coalesced) or the
    innermost (row sums)."""

    factor: int = 1
    outer: bool = False


def sm_count() -> int:
    target = getattr(V.graph, "target", None) or {}
    return int(target.get("sm_count", DEFAULT_SM_COUNT))


def _split_factor(x: IRNode, inner_fn: Any, reduction_type: str, ranges: Sequence[Expr],
                  rranges: Sequence[Expr]) -> Split:
    """How a reduction splits. A Welford reduction splits on a GPU only (``var_mean_welford``
    combines its chunks; batch norm's training statistics over 64 channels were 64
    programs, or one for channels-last data, walking 1.6M elements each)."""
    gpu = x.get_device().type == "cuda"
    if reduction_type not in _SPLITTABLE and not (gpu and reduction_type == "welford_reduce"):
        return Split()
    numel_expr, rnumel_expr = prod(ranges), prod(rranges)
    if not (numel_expr.is_Integer and rnumel_expr.is_Integer):
        return Split()  # chunks of a symbolic row: not split (one looped reduction instead)
    numel, rnumel = int(numel_expr), int(rnumel_expr)
    if gpu:
        inner, outer = reduction_access_order(extract_read_writes(inner_fn, ranges, rranges),
                                              len(ranges))
        return _gpu_split(numel, rnumel, outer > inner)
    if numel > SPLIT_MAX_OUTPUTS or rnumel < SPLIT_MIN_RNUMEL:
        return Split()
    split = 1
    while split < 1024 and rnumel % (split * 2) == 0 and rnumel // (split * 2) >= 2048:
        split *= 2
    return Split(split)


def _gpu_split(numel: int, rnumel: int, outer: bool) -> Split:
    """Enough programs for the machine: a column sum of 512 columns is 8 programs of 64
    columns unsplit, 256 split 32 ways (bias and layer-norm weight gradients)."""
    programs = -(-numel // OUTER_XBLOCK) if outer else numel
    want = GPU_PROGRAMS_PER_SM * sm_count()
    min_chunk = GPU_MIN_OUTER_CHUNK if outer else GPU_MIN_CHUNK
    if numel * rnumel < GPU_MIN_WORK:
        return Split()
    split = 1
    while (programs * split < want and rnumel % (split * 2) == 0
           and rnumel // (split * 2) >= min_chunk):
        split *= 2
    if outer:
        split = max(split, _row_parts(rnumel))
    return Split(split, outer)


def _row_parts(rows: int) -> int:
    """Parts of a column sum over many rows: one per SM (the largest power of two at most
    the SM count) while each keeps ROW_PART_MIN_ROWS rows, else 1. A row reduction over
    the same rows then takes the first stage into its kernel, one program per part
    (``codegen/triton/row_column.py``): per-part partials cost 8 bytes a column per
    ROW_PART_MIN_ROWS rows, against 2 or more bytes per element read."""
    parts = 1 << (sm_count().bit_length() - 1)
    if rows % parts or rows // parts < ROW_PART_MIN_ROWS:
        return 1
    return parts


def _stage_one(inner_fn: Any, ranges: tuple[Expr, ...], rranges: tuple[Expr, ...],
               split: Split) -> tuple[Any, tuple[Expr, ...], tuple[Expr, ...]]:
    """Stage one of a split reduction: (inner function, ranges, reduced range) of the
    partials, one per (chunk, kept index); ``_part_index`` finds a chunk's partial."""
    chunk = int(prod(rranges)) // split.factor
    n = len(ranges)
    parts = (sympy.Integer(split.factor),)

    def stage1(index: Sequence[Expr], rindex: Sequence[Expr]) -> Any:
        part, kept = (index[0], index[1:]) if split.outer else (index[n], index[:n])
        return inner_fn(kept, unflatten_index(part * chunk + rindex[0], rranges))

    return stage1, parts + ranges if split.outer else ranges + parts, (sympy.Integer(chunk),)


def _part_index(index: Sequence[Expr], part: Expr, split: Split) -> list[Expr]:
    """The partials' index of chunk ``part`` at the kept ``index``."""
    return [part, *index] if split.outer else [*index, part]


def _split_reduction(x: IRNode, inner_fn: Any, ranges: tuple[Expr, ...],
                     rranges: tuple[Expr, ...], reduction_type: str, dtype: torch.dtype,
                     src: torch.dtype, split: Split) -> TensorBox:
    """Reduce ``split.factor`` chunks into a partials buffer, then reduce the partials."""
    acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
    stage1, partial_ranges, chunk = _stage_one(inner_fn, ranges, rranges, split)
    partial = TensorBox.create(Reduction(x.get_device(), acc, stage1, partial_ranges, chunk,
                                         reduction_type, src))
    partial.realize()
    load = partial.make_loader()

    def stage2(index: Sequence[Expr], rindex: Sequence[Expr]) -> Any:
        return load(_part_index(index, rindex[0], split))

    final = TensorBox.create(Reduction(x.get_device(), dtype, stage2, ranges,
                                       (sympy.Integer(split.factor),),
                                       _SPLITTABLE[reduction_type], acc))
    final.realize()
    return final


def _reduce_one(reduction_type: str, output_index: int | None) -> Any:
    """The value of a reduction over a single element ``v``."""
    if reduction_type in ("argmax", "argmin"):
        return lambda v, dtype: ops.constant(0, dtype)
    if reduction_type == "welford_reduce" and output_index:  # m2 is 0, the weight is 1
        return lambda v, dtype: ops.constant(0.0 if output_index == 1 else 1.0, dtype)
    return lambda v, dtype: v


def make_reduction(reduction_type: str) -> Any:
    def lowering(x: IRNode, dim: Any = None, keepdim: bool = False, *,
                 dtype: torch.dtype | None = None) -> TensorBox:
        out_dtype = _result_dtype(x, reduction_type, dtype)
        if reduction_type in ("sum", "prod") and out_dtype != x.get_dtype():
            x = to_dtype(x, out_dtype)
        if reduction_type in ("any", "all"):
            x = to_dtype(x, torch.bool)
        return make_reduction_node(x, _dims(x, dim), reduction_type, out_dtype, keepdim)

    lowering.__name__ = reduction_type
    return lowering


register_lowering(aten.sum)(make_reduction("sum"))
register_lowering(aten.prod)(make_reduction("prod"))
register_lowering(aten.amax)(make_reduction("max"))
register_lowering(aten.amin)(make_reduction("min"))
register_lowering(aten.any)(make_reduction("any"))
register_lowering(aten.all)(make_reduction("all"))
register_lowering(prims.sum)(lambda x, dims, *, output_dtype=None:
                             make_reduction("sum")(x, dims, dtype=output_dtype))


def _arg_reduction(reduction_type: str) -> Any:
    def lowering(x: IRNode, dim: int | None = None, keepdim: bool = False) -> IRNode:
        if dim is None:
            flat = view(x, [-1])
            out = make_reduction_node(flat, [0], reduction_type, torch.int64, False)
            return view(out, [1] * len(x.get_size())) if keepdim else out
        return make_reduction_node(x, _dims(x, dim), reduction_type, torch.int64, keepdim)

    return lowering


register_lowering(aten.argmax)(_arg_reduction("argmax"))
register_lowering(aten.argmin)(_arg_reduction("argmin"))


def _minmax_dim(kind: str) -> Any:
    def lowering(x: IRNode, dim: int, keepdim: bool = False) -> tuple[IRNode, IRNode]:
        values = make_reduction_node(x, _dims(x, dim), kind, x.get_dtype(), keepdim)
        indices = make_reduction_node(x, _dims(x, dim), "arg" + kind, torch.int64, keepdim)
        return values, indices

    return lowering


register_lowering(aten.max.dim)(_minmax_dim("max"))
register_lowering(aten.min.dim)(_minmax_dim("min"))
register_lowering(aten.max.default)(lambda x: make_reduction("max")(x))
register_lowering(aten.min.default)(lambda x: make_reduction("min")(x))


def _float_dtype(x: IRNode, dtype: torch.dtype | None) -> torch.dtype:
    if dtype is not None:
        return dtype
    return x.get_dtype() if x.get_dtype().is_floating_point else torch.get_default_dtype()


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@register_lowering(aten.mean)
def mean(x: IRNode, dim: Any = None, keepdim: bool = False, *,
         dtype: torch.dtype | None = None) -> IRNode:
    out_dtype = _float_dtype(x, dtype)
    dims = _dims(x, dim)
    n = prod(x.get_size()[d] for d in dims)
    acc = _acc_dtype(out_dtype)
    total = make_reduction_node(to_dtype(x, acc), dims, "sum", acc, keepdim)
    load = total.make_loader()
    return Pointwise.create(
        x.get_device(), out_dtype,
        lambda idx: ops.to_dtype(ops.truediv(load(idx), size_value(n, acc)), out_dtype),
        total.get_size())


def var_mean_welford(x: IRNode, dim: Any, correction: float, keepdim: bool
                     ) -> tuple[IRNode, IRNode]:
    """(var, mean) from one Welford reduction; the two outputs fuse into one kernel."""
    out_dtype = _float_dtype(x, None)
    acc = _acc_dtype(out_dtype)
    dims = _dims(x, dim)
    n = prod(x.get_size()[d] for d in dims)
    src = to_dtype(x, acc)
    ranges, rranges, inner_fn = _reduction_ranges(src, dims)
    split = _split_factor(src, inner_fn, "welford_reduce", ranges, rranges)
    if split.factor > 1:
        mean_, m2 = _split_welford(src, dims, acc, keepdim, split)
    else:
        mean_ = make_reduction_node(src, dims, "welford_reduce", acc, keepdim, output_index=0)
        m2 = make_reduction_node(src, dims, "welford_reduce", acc, keepdim, output_index=1)
    load_m2, load_mean = m2.make_loader(), mean_.make_loader()

    def denom() -> Any:
        if n.is_Integer:
            return ops.constant(max(0.0, int(n) - correction), acc)
        zero, corr = ops.constant(0.0, acc), ops.constant(correction, acc)
        return ops.maximum(ops.sub(size_value(n, acc), corr), zero)

    var = Pointwise.create(
        x.get_device(), out_dtype,
        lambda idx: ops.to_dtype(ops.truediv(load_m2(idx), denom()), out_dtype),
        m2.get_size())
    mean_out = Pointwise.create(x.get_device(), out_dtype,
                                lambda idx: ops.to_dtype(load_mean(idx), out_dtype),
                                mean_.get_size()) if out_dtype != acc else mean_
    return var, mean_out


def _reduction_ranges(x: IRNode, dims: list[int]
                      ) -> tuple[tuple[Expr, ...], tuple[Expr, ...], Any]:
    """(kept ranges, reduced ranges, inner_fn) of a reduction of ``x`` over ``dims``: the
    function loads the element at (kept index, reduced index)."""
    size = list(x.get_size())
    kept = [d for d in range(len(size)) if d not in dims]
    loader = x.make_loader()

    def inner_fn(index: Sequence[Expr], rindex: Sequence[Expr]) -> Any:
        full: list[Expr] = [sympy.Integer(0)] * len(size)
        for d, i in zip(kept, index):
            full[d] = i
        for d, r in zip(dims, rindex):
            full[d] = r
        return loader(full)

    return tuple(size[d] for d in kept), tuple(size[d] for d in dims), inner_fn


def _split_welford(x: IRNode, dims: list[int], acc: torch.dtype, keepdim: bool,
                   split: Split) -> tuple[IRNode, IRNode]:
    """(mean, m2) of ``x`` over ``dims`` in two stages. Stage one: a Welford reduction of
    each of ``split.factor`` equal chunks (mean and m2 per chunk, one kernel). Stage two
    combines them as the parallel form of Welford's update does for equal counts ``c``:
    mean = sum(mean_j) / k, then m2 = sum(m2_j + c * (mean_j - mean)^2), each chunk's
    deviation taken from the final mean (no difference of large sums)."""
    ranges, rranges, inner_fn = _reduction_ranges(x, dims)
    device = x.get_device()
    k = split.factor
    chunk = int(prod(rranges)) // k
    parts = (sympy.Integer(k),)
    stage1, partial_ranges, chunk_range = _stage_one(inner_fn, ranges, rranges, split)
    loaders = []
    for output_index in (0, 1):  # mean and m2: one kernel
        box = TensorBox.create(Reduction(device, acc, stage1, partial_ranges, chunk_range,
                                         "welford_reduce", acc, output_index))
        box.realize()
        loaders.append(box.make_loader())

    def partial(which: int, index: Sequence[Expr], part: Expr) -> Any:
        return loaders[which](_part_index(index, part, split))

    def mean_fn(index: Sequence[Expr], rindex: Sequence[Expr]) -> Any:
        return ops.truediv(partial(0, index, rindex[0]), ops.constant(float(k), acc))

    mean = TensorBox.create(Reduction(device, acc, mean_fn, ranges, parts, "sum", acc))
    mean.realize()
    load_total_mean = mean.make_loader()

    def m2_fn(index: Sequence[Expr], rindex: Sequence[Expr]) -> Any:
        delta = ops.sub(partial(0, index, rindex[0]), load_total_mean(index))
        spread = ops.mul(ops.mul(delta, delta), ops.constant(float(chunk), acc))
        return ops.add(partial(1, index, rindex[0]), spread)

    m2 = TensorBox.create(Reduction(device, acc, m2_fn, ranges, parts, "sum", acc))
    m2.realize()
    if keepdim:
        shape = [1 if d in dims else s for d, s in enumerate(x.get_size())]
        return view(mean, shape), view(m2, shape)
    return mean, m2


def _correction(correction: float | None, unbiased: bool | None) -> float:
    if correction is not None:
        return float(correction)
    return 1.0 if unbiased is None or unbiased else 0.0


@register_lowering(aten.var_mean)
def var_mean(x: IRNode, dim: Any = None, unbiased: bool | None = None, keepdim: bool = False,
             *, correction: float | None = None) -> tuple[IRNode, IRNode]:
    if isinstance(dim, bool):  # var_mean(x, unbiased)
        dim, unbiased = None, dim
    return var_mean_welford(x, dim, _correction(correction, unbiased), keepdim)


@register_lowering(aten.var)
def var(x: IRNode, dim: Any = None, unbiased: bool | None = None, keepdim: bool = False,
        *, correction: float | None = None) -> IRNode:
    if isinstance(dim, bool):
        dim, unbiased = None, dim
    return var_mean_welford(x, dim, _correction(correction, unbiased), keepdim)[0]


@register_lowering(prims.var)
def prims_var(x: IRNode, dims: Any, correction: float = 1.0, *,
              output_dtype: torch.dtype | None = None) -> IRNode:
    return var_mean_welford(x, dims, correction, False)[0]


# Kiln has no scan: a cumulative sum of up to this many elements is a masked sum, each
# output summing the elements at or before it (quadratic in the length: HF's position ids
# from an attention mask, over a sequence). Longer scans run ATen's kernel.
CUMSUM_MAX_LENGTH = 1024


@register_lowering(aten.cumsum)
def cumsum(x: IRNode, dim: int, *, dtype: torch.dtype | None = None) -> TensorBox:
    from .fallbacks import EagerInstead

    size = list(x.get_size())
    if not size:
        raise EagerInstead("a 0-d cumulative sum")
    d = dim % len(size)
    length = size[d]
    if not isinstance(length, (int, sympy.Integer)) or int(length) > CUMSUM_MAX_LENGTH:
        raise EagerInstead(f"a cumulative sum over {length} elements (more than "
                           f"{CUMSUM_MAX_LENGTH}, or symbolic)")
    out = _result_dtype(x, "sum", dtype)
    loader = x.make_loader()

    def inner_fn(index: Sequence[Expr], rindex: Sequence[Expr]) -> Any:
        source = list(index)
        source[d] = rindex[0]
        value = ops.to_dtype(loader(source), out)
        before = ops.le(ops.index_expr(rindex[0], torch.int64),
                        ops.index_expr(index[d], torch.int64))
        return ops.where(before, value, ops.constant(0, out))

    node = Reduction(x.get_device(), out, inner_fn, tuple(size), (length,), "sum", out, None)
    result = TensorBox.create(node)
    result.realize()
    return result
