"""The typed ops protocol: the only way a loop body reaches any handler.

A loop body (``inner_fn``) computes one element by calling ``ops.<name>``. Every handler
(dependency recording, IR interpreter, Triton, C++) implements this protocol. Values are
opaque to the body: a handler decides what they are (a name, a tensor, a source string).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import sympy
import torch

T = TypeVar("T")

# Elementwise ops of one argument, by protocol name.
UNARY_OPS: tuple[str, ...] = (
    "abs", "neg", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "sqrt", "rsqrt",
    "sin", "cos", "tan", "tanh", "sinh", "cosh", "asin", "acos", "atan", "asinh", "acosh",
    "atanh", "erf", "erfc", "erfinv", "lgamma", "sigmoid", "relu", "floor", "ceil", "round",
    "trunc", "sign", "signbit", "reciprocal", "square", "logical_not", "bitwise_not",
    "isnan", "isinf", "isfinite",
)

# Elementwise ops of two arguments, by protocol name.
BINARY_OPS: tuple[str, ...] = (
    "add", "sub", "mul", "truediv", "floordiv", "truncdiv", "remainder", "fmod", "pow", "maximum",
    "minimum", "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or",
    "logical_xor", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_left_shift",
    "bitwise_right_shift", "atan2", "copysign", "hypot", "nextafter",
)

# Ops whose result is boolean whatever their inputs are.
BOOLEAN_OPS: frozenset[str] = frozenset(
    {"eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
     "logical_not", "isnan", "isinf", "isfinite", "signbit"}
)

REDUCTION_TYPES: tuple[str, ...] = (
    "sum", "prod", "max", "min", "argmax", "argmin", "any", "all", "welford_reduce",
    "xor_sum",
)


class OpsHandler(Protocol[T]):
    """What every handler provides. Indices are sympy expressions over loop variables."""

    def load(self, name: str, index: sympy.Expr) -> T: ...

    def store(self, name: str, index: sympy.Expr, value: T, mode: str | None = None) -> None: ...

    def store_reduction(self, name: str, index: sympy.Expr, value: T) -> None: ...

    def reduction(
        self, dtype: torch.dtype, src_dtype: torch.dtype, reduction_type: str, value: T
    ) -> T: ...

    def constant(self, value: bool | int | float, dtype: torch.dtype) -> T: ...

    def index_expr(self, expr: sympy.Expr, dtype: torch.dtype) -> T: ...

    def to_dtype(self, x: T, dtype: torch.dtype, src_dtype: torch.dtype | None = None) -> T: ...

    def to_dtype_bitcast(self, x: T, dtype: torch.dtype, src_dtype: torch.dtype) -> T: ...

    def indirect_indexing(self, x: T, size: sympy.Expr, check: bool = True) -> sympy.Symbol: ...

    def masked(self, mask: T, body: Callable[[], T], other: bool | int | float) -> T: ...

    def where(self, cond: T, a: T, b: T) -> T: ...

    def getitem(self, x: T, i: int) -> T: ...

    # Every name in UNARY_OPS and BINARY_OPS is also part of the protocol; they are
    # declared through ``__getattr__`` so the list above stays the single source.
    def __getattr__(self, name: str) -> Callable[..., T]: ...


class DefaultHandler(Generic[T]):
    """Base for handlers that treat most ops alike: each op calls ``_default``."""

    def _default(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement ops.{name}")

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in UNARY_OPS and name not in BINARY_OPS:
            raise AttributeError(f"ops.{name} is not part of Kiln's ops protocol")

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._default(name, args, kwargs)

        return call
