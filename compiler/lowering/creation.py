"""Constants as loops: full, zeros, ones, scalar_tensor, arange, iota, and their _like forms."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy
import torch

from ..ir.nodes import Buffer, IRNode, Pointwise, TensorBox
from ..ir.sym import Expr, sympify_tuple
from ..virtualized import V, ops
from .registry import eager_strides, register_lowering

aten = torch.ops.aten
prims = torch.ops.prims


def _device(device: Any) -> torch.device:
    return torch.device(device) if device is not None else V.graph.default_device


def _scalar_dtype(value: Any) -> torch.dtype:
    if isinstance(value, bool):
        return torch.bool
    if isinstance(value, int):
        return torch.int64
    return torch.get_default_dtype()


def full(size: Sequence[Any], fill_value: Any, *, dtype: torch.dtype | None = None,
         layout: Any = None, device: Any = None, pin_memory: Any = None,
         memory_format: Any = None, requires_grad: bool = False) -> TensorBox:
    dtype = dtype or _scalar_dtype(fill_value)
    if isinstance(fill_value, IRNode):
        load = fill_value.make_loader()
        return Pointwise.create(_device(device), dtype,
                                lambda idx: ops.to_dtype(load([]), dtype),
                                sympify_tuple(size))
    value = fill_value
    return Pointwise.create(_device(device), dtype, lambda idx: ops.constant(value, dtype),
                            sympify_tuple(size))


register_lowering(aten.full)(full)


@register_lowering(aten.zeros)
def zeros(size: Sequence[Any], **kwargs: Any) -> TensorBox:
    kwargs.setdefault("dtype", torch.get_default_dtype())
    return full(size, 0, **kwargs)


@register_lowering(aten.ones)
def ones(size: Sequence[Any], **kwargs: Any) -> TensorBox:
    kwargs.setdefault("dtype", torch.get_default_dtype())
    return full(size, 1, **kwargs)


@register_lowering(aten.scalar_tensor)
def scalar_tensor(value: Any, **kwargs: Any) -> TensorBox:
    kwargs.setdefault("dtype", torch.get_default_dtype())
    return full([], value, **kwargs)


def _like(value: Any) -> Any:
    def lowering(x: IRNode, *args: Any, dtype: torch.dtype | None = None, device: Any = None,
                 **kwargs: Any) -> TensorBox:
        fill = args[0] if args else value
        return full(list(x.get_size()), fill, dtype=dtype or x.get_dtype(),
                    device=device or x.get_device())

    return lowering


register_lowering(aten.zeros_like)(_like(0))
register_lowering(aten.ones_like)(_like(1))
register_lowering(aten.full_like)(_like(None))


def _empty(size: Sequence[Any], dtype: torch.dtype, device: Any) -> TensorBox:
    """Uninitialized memory: zeros are a valid value, and fuse. The layout is not free,
    though: an eager op that fills it in memory order (``bernoulli`` in dropout draws its
    random numbers that way) must see eager's strides, so a non-contiguous empty is a
    buffer with the strides of the node's meta."""
    box = full(size, 0, dtype=dtype, device=device)
    stride = eager_strides()
    if stride is not None and len(stride) == len(size) and not _is_contiguous(size, stride):
        box.realize()
        buf = box.storage().data  # type: ignore[union-attr]
        assert isinstance(buf, Buffer)
        buf.freeze_layout(sympify_tuple(stride))
    return box


def _is_contiguous(size: Sequence[Any], stride: Sequence[int]) -> bool:
    expected: Expr = sympy.Integer(1)
    for n, s in reversed(list(zip(size, stride))):
        if n != 1 and sympy.expand(s - expected) != 0:
            return False
        expected = expected * n
    return True


@register_lowering(aten.empty_like)
def empty_like(x: IRNode, *args: Any, dtype: torch.dtype | None = None, device: Any = None,
               **kwargs: Any) -> TensorBox:
    return _empty(list(x.get_size()), dtype or x.get_dtype(), device or x.get_device())


def _new(value: Any) -> Any:
    def lowering(x: IRNode, size: Sequence[Any], *args: Any, dtype: torch.dtype | None = None,
                 device: Any = None, **kwargs: Any) -> TensorBox:
        fill = args[0] if args else value
        return full(size, fill, dtype=dtype or x.get_dtype(), device=device or x.get_device())

    return lowering


register_lowering(aten.new_zeros)(_new(0))
register_lowering(aten.new_ones)(_new(1))
register_lowering(aten.new_full)(_new(None))
register_lowering(aten.new_empty)(lambda x, size, *args, dtype=None, device=None, **kwargs:
                                  _empty(size, dtype or x.get_dtype(),
                                         device or x.get_device()))


@register_lowering(aten.empty, aten.empty_permuted)
def empty(size: Sequence[Any], *args: Any, dtype: torch.dtype | None = None,
          device: Any = None, **kwargs: Any) -> TensorBox:
    return _empty(size, dtype or torch.get_default_dtype(), device)


@register_lowering(aten.empty_strided)
def empty_strided(size: Sequence[Any], stride: Sequence[Any], *, dtype: Any = None,
                  device: Any = None, **kwargs: Any) -> TensorBox:
    return _empty(size, dtype or torch.get_default_dtype(), device)


@register_lowering(aten.arange)
def arange(start: Any, end: Any = None, step: Any = 1, *, dtype: torch.dtype | None = None,
           layout: Any = None, device: Any = None, pin_memory: Any = None) -> TensorBox:
    if end is None:
        start, end = 0, start
    if dtype is None:
        is_int = all(isinstance(v, int) or (isinstance(v, sympy.Expr) and v.is_integer)
                     for v in (start, end, step))
        dtype = torch.int64 if is_int else torch.get_default_dtype()
    if isinstance(end, sympy.Expr) and not end.is_Integer:  # a symbolic length
        if not (isinstance(start, int) and step == 1 and
                V.graph.sizevars.statically_known_geq(end, start)):
            raise NotImplementedError(f"arange({start}, {end}, {step}) with a symbolic size")
        return _iota(sympy.expand(end - start), start, step, dtype, device)
    length = max(0, int(-(-(end - start) // step)))
    return _iota(length, start, step, dtype, device)


def _iota(length: Any, start: Any, step: Any, dtype: torch.dtype, device: Any) -> TensorBox:
    def inner_fn(index: Sequence[Expr]) -> Any:
        if isinstance(start, int) and isinstance(step, int):
            return ops.index_expr(index[0] * step + start, dtype)
        pos = ops.index_expr(index[0], torch.int64)
        value = ops.add(ops.mul(ops.to_dtype(pos, torch.float64), ops.constant(step,
                        torch.float64)), ops.constant(start, torch.float64))
        return ops.to_dtype(value, dtype)

    return Pointwise.create(_device(device), dtype, inner_fn, (sympy.sympify(length),))


@register_lowering(prims.iota)
def iota(length: int, *, start: int, step: int, dtype: torch.dtype, device: Any,
         requires_grad: bool = False) -> TensorBox:
    return _iota(length, start, step, dtype, device)
