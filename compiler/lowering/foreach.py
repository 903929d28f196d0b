"""ATen's ``_foreach_*`` ops lowered element by element.

A compiled optimizer step (``torch.compile(opt.step)``, ``foreach=True`` by default on a
GPU) is a graph of list ops: ``_foreach_mul.Scalar(grads, wd)``, ``_foreach_addcdiv``,
``_foreach_sqrt`` and so on over every parameter. Each is lowered here to one pointwise
node per list element, the base op's own lowering applied to the element's arguments
(list arguments indexed, a scalar or a single tensor shared). The nodes stay lazy, so the
chain of ops that update one parameter (its moments and its new value) fuses into one
kernel that reads each tensor once and writes each result once, where eager's multi-tensor
kernels make a pass over every list per op.

Compound ops (``addcmul``, ``addcdiv``, ``lerp``), which the decompositions split before
lowering when they come alone, are one pointwise function each here, computed in float32
for reduced-precision data as ATen's multi-tensor kernels compute them. An op or overload
not listed (``_foreach_norm``, a tensor of scalars) keeps no lowering and runs eagerly.
"""

from __future__ import annotations

from typing import Any

import torch

from ..virtualized import ops
from .fallbacks import EagerInstead
from .registry import lowerings, make_pointwise, register_lowering

aten = torch.ops.aten

# _foreach_<name> -> the base op whose lowering each element takes.
_BASE = {
    name: getattr(aten, name)
    for name in (
        "add", "sub", "mul", "div", "maximum", "minimum", "clamp_min", "clamp_max", "pow",
        "abs", "neg", "exp", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt",
        "sin", "cos", "tan", "tanh", "sinh", "cosh", "asin", "acos", "atan", "erf", "erfc",
        "sigmoid", "reciprocal", "floor", "ceil", "trunc", "round", "sign", "lgamma",
    )
}


def _addcmul(x: Any, a: Any, b: Any, value: Any) -> Any:
    return ops.add(x, ops.mul(ops.mul(a, b), value))


def _addcdiv(x: Any, a: Any, b: Any, value: Any) -> Any:
    return ops.add(x, ops.mul(ops.truediv(a, b), value))


def _lerp(x: Any, end: Any, weight: Any) -> Any:
    """ATen's two-sided form: exact at both ends (``weight`` 0 gives ``x``, 1 ``end``)."""
    diff = ops.sub(end, x)
    half = ops.constant(0.5, torch.float32)
    small = ops.lt(ops.abs(weight), half)
    return ops.where(small, ops.add(x, ops.mul(weight, diff)),
                     ops.sub(end, ops.mul(diff, ops.sub(ops.constant(1.0, torch.float32),
                                                        weight))))


_COMPOUND = {"addcmul": make_pointwise(_addcmul), "addcdiv": make_pointwise(_addcdiv),
             "lerp": make_pointwise(_lerp)}
# Their scalar argument (``value`` / ``weight``) when a call leaves it out.
_DEFAULT_SCALAR = {"addcmul": 1, "addcdiv": 1}


def _elements(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[list[Any],
                                                                         dict[str, Any]]]:
    """Each element's arguments: list arguments indexed, every other argument shared."""
    lists = [a for a in (*args, *kwargs.values()) if isinstance(a, (list, tuple))]
    if not lists:
        raise EagerInstead("no list argument")
    n = len(lists[0])
    if any(len(a) != n for a in lists):
        raise ValueError(f"foreach lists of different lengths: {[len(a) for a in lists]}")

    def pick(a: Any, i: int) -> Any:
        return a[i] if isinstance(a, (list, tuple)) else a

    return [([pick(a, i) for a in args], {k: pick(v, i) for k, v in kwargs.items()})
            for i in range(n)]


def _compound(name: str) -> Any:
    """One element of ``addcmul``/``addcdiv``/``lerp``: its scalar (``value``/``weight``)
    positional or a keyword, defaulted for ``addcmul`` and ``addcdiv``."""
    fn, arity = _COMPOUND[name], 2 if name == "lerp" else 3

    def element(*args: Any, **kwargs: Any) -> Any:
        scalar = kwargs.get("value", kwargs.get("weight", _DEFAULT_SCALAR.get(name)))
        if len(args) > arity:
            scalar = args[arity]
        if isinstance(scalar, torch.Tensor):
            raise EagerInstead("a host tensor of scalars")
        return fn(*args[:arity], scalar)

    return element


def _element_lowering(name: str) -> Any:
    """The lowering of one element of ``_foreach_<name>``."""
    if name in _COMPOUND:
        return _compound(name)
    if name == "copy":  # (self, src, non_blocking): src in self's dtype
        return lambda dst, src, *_, **__: lowerings[aten.copy.default](dst, src)
    if name == "zero":
        return lambda x: lowerings[aten.fill.Scalar](x, 0)
    base = _BASE[name]
    op = getattr(base, base.overloads()[0])  # every overload of a packet shares a lowering
    # looked up at call time: the base op's module may register after this one
    return lambda *args, **kwargs: lowerings[op](*args, **kwargs)


def _foreach_lowering(name: str) -> Any:
    element = _element_lowering(name)

    def lowering(*args: Any, **kwargs: Any) -> list[Any]:
        return [element(*a, **k) for a, k in _elements(args, kwargs)]

    lowering.__name__ = f"foreach_{name}"
    return lowering


for _name in [*_BASE, *_COMPOUND, "copy", "zero"]:
    _op = getattr(aten, f"_foreach_{_name}", None)
    if _op is None:  # an op this torch does not have
        continue
    # Only the functional overloads: the in-place ones (``_foreach_add_``) are separate
    # packets that functionalization removes from a traced graph.
    _fn = _foreach_lowering(_name)
    _overloads = [getattr(_op, o) for o in _op.overloads()]
    # A tensor of per-element scalars (``_foreach_addcmul.Tensor``: a 1-d tensor read on
    # the host) runs eagerly.
    _overloads = [o for o in _overloads
                  if not (_name in _COMPOUND and o._overloadname == "Tensor")]
    register_lowering(*_overloads)(_fn)
