"""Elementwise lowerings: arithmetic, comparisons, logic, math functions, casts, where."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..ir.nodes import IRNode, Pointwise, TensorBox
from ..ir.sym import Expr
from ..virtualized import ops
from .registry import (
    ALWAYS_BOOL,
    BOOL_TO_LONG,
    COMPLEX_TO_FLOAT,
    DEFAULT,
    INT_TO_FLOAT,
    broadcast_all,
    is_tensor,
    make_pointwise,
    promote_dtypes,
    register_late_lowering,
    register_lowering,
    register_pointwise,
    value_loader,
)

aten = torch.ops.aten
prims = torch.ops.prims

# (aten op, ops name, promotion kind)
_UNARY: list[tuple[Any, str, Any]] = [
    (aten.abs, "abs", COMPLEX_TO_FLOAT), (aten.neg, "neg", DEFAULT),
    (aten.exp, "exp", INT_TO_FLOAT), (aten.exp2, "exp2", INT_TO_FLOAT),
    (aten.expm1, "expm1", INT_TO_FLOAT), (aten.log, "log", INT_TO_FLOAT),
    (aten.log1p, "log1p", INT_TO_FLOAT), (aten.log2, "log2", INT_TO_FLOAT),
    (aten.log10, "log10", INT_TO_FLOAT), (aten.sqrt, "sqrt", INT_TO_FLOAT),
    (aten.rsqrt, "rsqrt", INT_TO_FLOAT), (aten.sin, "sin", INT_TO_FLOAT),
    (aten.cos, "cos", INT_TO_FLOAT), (aten.tan, "tan", INT_TO_FLOAT),
    (aten.tanh, "tanh", INT_TO_FLOAT), (aten.sinh, "sinh", INT_TO_FLOAT),
    (aten.cosh, "cosh", INT_TO_FLOAT), (aten.asin, "asin", INT_TO_FLOAT),
    (aten.acos, "acos", INT_TO_FLOAT), (aten.atan, "atan", INT_TO_FLOAT),
    (aten.asinh, "asinh", INT_TO_FLOAT), (aten.acosh, "acosh", INT_TO_FLOAT),
    (aten.atanh, "atanh", INT_TO_FLOAT), (aten.erf, "erf", INT_TO_FLOAT),
    (aten.erfc, "erfc", INT_TO_FLOAT), (aten.erfinv, "erfinv", INT_TO_FLOAT),
    (aten.lgamma, "lgamma", INT_TO_FLOAT), (aten.sigmoid, "sigmoid", INT_TO_FLOAT),
    (aten.relu, "relu", DEFAULT), (aten.reciprocal, "reciprocal", INT_TO_FLOAT),
    (aten.floor, "floor", DEFAULT), (aten.ceil, "ceil", DEFAULT),
    (aten.trunc, "trunc", DEFAULT), (aten.sign, "sign", DEFAULT),
    (aten.sgn, "sign", DEFAULT), (aten.bitwise_not, "bitwise_not", DEFAULT),
    (aten.logical_not, "logical_not", ALWAYS_BOOL), (aten.isnan, "isnan", ALWAYS_BOOL),
    (aten.isinf, "isinf", ALWAYS_BOOL), (aten.signbit, "signbit", ALWAYS_BOOL),
    (aten.square, "square", BOOL_TO_LONG),
]

_BINARY: list[tuple[Any, str, Any]] = [
    (aten.mul, "mul", DEFAULT), (aten.maximum, "maximum", DEFAULT),
    (aten.minimum, "minimum", DEFAULT), (aten.remainder, "remainder", DEFAULT),
    (aten.fmod, "fmod", DEFAULT),
    (aten.eq, "eq", ALWAYS_BOOL), (aten.ne, "ne", ALWAYS_BOOL), (aten.lt, "lt", ALWAYS_BOOL),
    (aten.le, "le", ALWAYS_BOOL), (aten.gt, "gt", ALWAYS_BOOL), (aten.ge, "ge", ALWAYS_BOOL),
    (aten.logical_and, "logical_and", ALWAYS_BOOL), (aten.logical_or, "logical_or", ALWAYS_BOOL),
    (aten.logical_xor, "logical_xor", ALWAYS_BOOL), (aten.bitwise_and, "bitwise_and", DEFAULT),
    (aten.bitwise_or, "bitwise_or", DEFAULT), (aten.bitwise_xor, "bitwise_xor", DEFAULT),
    (aten.bitwise_left_shift, "bitwise_left_shift", DEFAULT),
    (aten.bitwise_right_shift, "bitwise_right_shift", DEFAULT),
    (aten.atan2, "atan2", INT_TO_FLOAT), (aten.copysign, "copysign", INT_TO_FLOAT),
    (aten.hypot, "hypot", INT_TO_FLOAT),
    (aten.nextafter, "nextafter", DEFAULT),
]

for _op, _name, _kind in _UNARY + _BINARY:
    register_pointwise(_op, _name, promotion=_kind)

# prims that decompositions leave behind map onto the same ops.
for _op, _name, _kind in [(prims.sqrt, "sqrt", INT_TO_FLOAT), (prims.exp, "exp", INT_TO_FLOAT),
                          (prims.log, "log", INT_TO_FLOAT), (prims.tanh, "tanh", INT_TO_FLOAT),
                          (prims.erf, "erf", INT_TO_FLOAT), (prims.rsqrt, "rsqrt", INT_TO_FLOAT),
                          (prims.div, "truediv", DEFAULT), (prims.mul, "mul", DEFAULT),
                          (prims.add, "add", DEFAULT), (prims.sub, "sub", DEFAULT)]:
    register_pointwise(_op, _name, promotion=_kind)

# a * b + c in the compute dtype (fp32 for reduced precision), which the kernel compiler
# may contract into one fused multiply-add; core ATen's addcmul decomposition emits it
# (an Adam or AdamW step), and only Inductor's prims module defines the op.
register_late_lowering("prims::fma", make_pointwise(lambda a, b, c: ops.add(ops.mul(a, b), c)))


def _with_alpha(name: str) -> Any:
    base = make_pointwise(lambda a, b: getattr(ops, name)(a, b))
    scaled = make_pointwise(lambda a, b, alpha: getattr(ops, name)(a, ops.mul(b, alpha)))

    def lowering(a: Any, b: Any, *, alpha: Any = None) -> TensorBox:
        if not is_tensor(a) and not is_tensor(b):
            raise TypeError(f"aten.{name} needs a tensor argument")
        if alpha is None or alpha == 1:
            return base(a, b)
        return scaled(a, b, alpha)

    return lowering


register_lowering(aten.add)(_with_alpha("add"))
register_lowering(aten.sub)(_with_alpha("sub"))
register_lowering(aten.rsub)(
    lambda a, b, *, alpha=None: _with_alpha("sub")(b, a, alpha=alpha))

_true_div = make_pointwise(lambda a, b: ops.truediv(a, b), promotion=INT_TO_FLOAT)
_int_floor_div = make_pointwise(lambda a, b: ops.floordiv(a, b))
_int_trunc_div = make_pointwise(lambda a, b: ops.truncdiv(a, b))


def _float_floor_div_fn(a: Any, b: Any) -> Any:
    """ATen's floor division of floats: through fmod, so a quotient that lands a rounding
    error away from an integer floors as eager's does."""
    zero = ops.constant(0.0, torch.float32)
    mod = ops.fmod(a, b)
    div = ops.truediv(ops.sub(a, mod), b)
    fix = ops.logical_and(ops.ne(mod, zero), ops.ne(ops.lt(b, zero), ops.lt(mod, zero)))
    div = ops.where(fix, ops.sub(div, ops.constant(1.0, torch.float32)), div)
    floor = ops.floor(div)
    up = ops.gt(ops.sub(div, floor), ops.constant(0.5, torch.float32))
    return ops.where(up, ops.add(floor, ops.constant(1.0, torch.float32)), floor)


_float_floor_div = make_pointwise(_float_floor_div_fn)


def _floor_div(a: Any, b: Any) -> TensorBox:
    from .registry import promote_dtypes

    if promote_dtypes([a, b], DEFAULT)[1].is_floating_point:
        return _float_floor_div(a, b)
    return _int_floor_div(a, b)


def _trunc_div(a: Any, b: Any) -> TensorBox:
    """Eager rounds a float quotient to its dtype, then truncates it."""
    from .registry import promote_dtypes

    if promote_dtypes([a, b], DEFAULT)[1].is_floating_point:
        return make_pointwise(lambda x: ops.trunc(x))(_true_div(a, b))
    return _int_trunc_div(a, b)


@register_lowering(aten.div)
def div(a: Any, b: Any, *, rounding_mode: str | None = None) -> TensorBox:
    if rounding_mode is None:
        return _true_div(a, b)
    if rounding_mode == "floor":
        return _floor_div(a, b)
    if rounding_mode == "trunc":
        return _trunc_div(a, b)
    raise ValueError(f"aten.div: unknown rounding_mode {rounding_mode!r}")


register_lowering(aten.floor_divide)(_floor_div)


@register_lowering(aten.true_divide)
def true_divide(a: Any, b: Any) -> TensorBox:
    return _true_div(a, b)


_round = make_pointwise(lambda x: ops.round(x))
_round_decimals = make_pointwise(
    lambda x, scale: ops.truediv(ops.round(ops.mul(x, scale)), scale))


@register_lowering(aten.round)
def round_(x: IRNode, *, decimals: int = 0) -> TensorBox:
    if decimals == 0:
        return _round(x)
    return _round_decimals(x, 10.0**decimals)


@register_lowering(aten.where)
def where(cond: Any, a: Any, b: Any) -> TensorBox:
    # The condition is read as bool and the branches in their promoted dtype; make_pointwise
    # cannot express this, since it casts every input to one computation dtype.
    _, dtype = promote_dtypes([a, b], DEFAULT)
    args = broadcast_all([to_dtype(cond, torch.bool) if is_tensor(cond) else cond, a, b])
    loaders = [value_loader(arg, dt) for arg, dt in zip(args, (torch.bool, dtype, dtype))]
    ref = next(arg for arg in args if is_tensor(arg))

    def inner_fn(index: Sequence[Expr]) -> Any:
        c, x, y = (load(index) for load in loaders)
        return ops.where(c, x, y)

    return Pointwise.create(ref.get_device(), dtype, inner_fn, ref.get_size())


def to_dtype(x: IRNode, dtype: torch.dtype, copy: bool = False) -> IRNode:
    src = x.get_dtype()
    if src == dtype and not copy:
        return x
    load = x.make_loader()
    return Pointwise.create(x.get_device(), dtype,
                            lambda idx: ops.to_dtype(load(idx), dtype, src), x.get_size())


@register_lowering(aten._to_copy, prims.convert_element_type)
def to_copy(x: IRNode, dtype: torch.dtype | None = None, *, layout: Any = None,
            device: Any = None, pin_memory: Any = None, non_blocking: bool = False,
            memory_format: Any = None) -> IRNode:
    if device is not None and torch.device(device).type != x.get_device().type:
        from ..ir.extern import make_fallback_call

        kwargs = {"dtype": dtype, "device": device}
        return make_fallback_call(aten._to_copy.default, [x], kwargs)
    return to_dtype(x, dtype or x.get_dtype(), copy=True)


@register_lowering(aten.clone, aten.lift_fresh_copy, aten.alias, aten.copy,
                   aten.contiguous, prims.clone)
def clone(x: IRNode, *args: Any, memory_format: Any = None, **kwargs: Any) -> IRNode:
    if args and is_tensor(args[0]):  # aten.copy(self, src): the result is src in self's dtype
        src = args[0]
        from .registry import expand

        return to_dtype(expand(src, x.get_size()), x.get_dtype(), copy=True)
    return to_dtype(x, x.get_dtype(), copy=True)


def _clamp(x: IRNode, lo: Any, hi: Any) -> TensorBox:
    args = [x] + [v for v in (lo, hi) if v is not None]

    def fn(*vals: Any) -> Any:
        out, rest = vals[0], list(vals[1:])
        if lo is not None:
            out = ops.maximum(out, rest.pop(0))
        if hi is not None:
            out = ops.minimum(out, rest.pop(0))
        return out

    return make_pointwise(fn)(*args)


@register_lowering(aten.clamp)
def clamp(x: IRNode, min: Any = None, max: Any = None) -> TensorBox:
    return _clamp(x, min, max)


@register_lowering(aten.clamp_min)
def clamp_min(x: IRNode, min: Any) -> TensorBox:
    return _clamp(x, min, None)


@register_lowering(aten.clamp_max)
def clamp_max(x: IRNode, max: Any) -> TensorBox:
    return _clamp(x, None, max)


@register_lowering(aten.masked_fill)
def masked_fill(x: IRNode, mask: IRNode, value: Any) -> IRNode:
    value = to_dtype(value, x.get_dtype()) if is_tensor(value) else value
    return to_dtype(where(mask, value, x), x.get_dtype())  # never promotes x


@register_lowering(aten.fill)
def fill(x: IRNode, value: Any) -> TensorBox:
    from .creation import full

    return full(list(x.get_size()), value, dtype=x.get_dtype(), device=x.get_device())


_pow_generic = make_pointwise(lambda a, b: ops.pow(a, b), promotion=BOOL_TO_LONG)


def _pow_by_multiplication(n: int) -> Any:
    """``x ** n`` for a small integer ``n`` as multiplications (pow is a transcendental)."""

    def fn(x: Any) -> Any:
        out = x
        for _ in range(abs(n) - 1):
            out = ops.mul(out, x)
        return ops.reciprocal(out) if n < 0 else out

    return make_pointwise(fn, promotion=BOOL_TO_LONG)


_POW_SPECIAL = {0.5: make_pointwise(lambda x: ops.sqrt(x), promotion=INT_TO_FLOAT),
                -0.5: make_pointwise(lambda x: ops.rsqrt(x), promotion=INT_TO_FLOAT)}


@register_lowering(aten.pow)
def pow_(a: Any, b: Any) -> TensorBox:
    """Strength-reduced for constant exponents: ``x**2`` is ``x*x``, ``x**0.5`` is sqrt."""
    if is_tensor(a) and isinstance(b, (int, float)) and not isinstance(b, bool):
        if b in _POW_SPECIAL and a.get_dtype().is_floating_point:
            return _POW_SPECIAL[b](a)
        small_int = float(b).is_integer() and 1 <= abs(b) <= 8
        if small_int and (b > 0 or a.get_dtype().is_floating_point):
            return _pow_by_multiplication(int(b))(a)
    return _pow_generic(a, b)
