"""libdevice for Triton's interpreter (``TRITON_INTERPRET=1``), which cannot call extern
functions: each function applies the NumPy equivalent to the interpreter's arrays.

Generated kernels call ``libdevice.<fn>``; under the interpreter the kernel module's
``libdevice`` name is bound to this module instead, so the source stays the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import triton.language as tl
from triton.runtime.interpreter import TensorHandle


def _wrap(x: Any) -> Any:
    return x.handle.data if isinstance(x, tl.tensor) else np.asarray(x)


def _like(ref: Any, data: np.ndarray) -> Any:
    handle = TensorHandle(data.astype(ref.handle.data.dtype, copy=False), ref.handle.dtype.scalar)
    return tl.tensor(handle, ref.type)


def _unary(fn: Callable[[np.ndarray], np.ndarray]) -> Callable[[Any], Any]:
    def apply(x: Any) -> Any:
        with np.errstate(all="ignore"):
            return _like(x, fn(_wrap(x)))

    return apply


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[[Any, Any], Any]:
    def apply(a: Any, b: Any) -> Any:
        ref = a if isinstance(a, tl.tensor) else b
        with np.errstate(all="ignore"):
            data = fn(*np.broadcast_arrays(_wrap(a), _wrap(b)))
        return _like(ref, np.asarray(data))

    return apply


_erfinv = np.vectorize(lambda v: _erfinv_scalar(float(v)), otypes=[np.float64])
_lgamma = np.vectorize(lambda v: math.lgamma(float(v)) if np.isfinite(v) else np.inf,
                       otypes=[np.float64])
_erf = np.vectorize(lambda v: math.erf(float(v)), otypes=[np.float64])
_erfc = np.vectorize(lambda v: math.erfc(float(v)), otypes=[np.float64])


def _erfinv_scalar(y: float) -> float:
    if y <= -1.0:
        return -math.inf if y == -1.0 else math.nan
    if y >= 1.0:
        return math.inf if y == 1.0 else math.nan
    x = 0.0
    for _ in range(60):  # Newton on erf(x) - y
        x -= (math.erf(x) - y) / (2.0 / math.sqrt(math.pi) * math.exp(-x * x))
    return x


tanh = _unary(np.tanh)
log1p = _unary(np.log1p)
expm1 = _unary(np.expm1)
tan = _unary(np.tan)
sinh = _unary(np.sinh)
cosh = _unary(np.cosh)
asin = _unary(np.arcsin)
acos = _unary(np.arccos)
atan = _unary(np.arctan)
asinh = _unary(np.arcsinh)
acosh = _unary(np.arccosh)
atanh = _unary(np.arctanh)
log10 = _unary(np.log10)
erf = _unary(_erf)
erfc = _unary(_erfc)
erfinv = _unary(_erfinv)
lgamma = _unary(_lgamma)
nearbyint = _unary(np.rint)
trunc = _unary(np.trunc)
atan2 = _binary(np.arctan2)
pow = _binary(np.power)
fmod = _binary(np.fmod)
hypot = _binary(np.hypot)
copysign = _binary(np.copysign)
nextafter = _binary(np.nextafter)


def patch_interpreter_dot() -> None:
    """Triton's interpreter keeps bf16 as raw uint16 bits and multiplies those in
    ``tl.dot``: widen bf16 operands to the fp32 values they stand for (exactly) first."""
    from triton.runtime.interpreter import InterpreterBuilder

    original = InterpreterBuilder.create_dot
    if getattr(original, "_kiln_bf16", False):
        return

    def create_dot(self: Any, a: Any, b: Any, d: Any, *args: Any) -> Any:
        if tl.bfloat16 in (a.dtype, b.dtype):
            a, b = _bf16_to_fp32(a), _bf16_to_fp32(b)
        return original(self, a, b, d, *args)

    create_dot._kiln_bf16 = True  # type: ignore[attr-defined]
    InterpreterBuilder.create_dot = create_dot  # type: ignore[method-assign]


def _bf16_to_fp32(x: Any) -> Any:
    if x.dtype != tl.bfloat16:
        return x
    bits = x.data.astype(np.uint32) << np.uint32(16)
    return TensorHandle(bits.view(np.float32), tl.float32)
