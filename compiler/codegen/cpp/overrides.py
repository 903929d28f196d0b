"""C++ overrides of the ops protocol: each op becomes a C++ expression string.

Values are ``CSEVariable``s that remember the dtype they hold in the kernel. fp16 and
bf16 live in memory as ``uint16_t`` and are widened to ``float`` when loaded, so math
runs in fp32 and is rounded once when stored (as the Triton backend does).
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...errors import KilnCompileError
from ...ir.sym import Expr, FloorDiv, ModularIndexing
from ..common import CSEVariable, IndexPrinter

# The C++ type of each dtype in memory.
_STORAGE_TYPES = {
    torch.float32: "float", torch.float64: "double", torch.float16: "uint16_t",
    torch.bfloat16: "uint16_t", torch.int64: "int64_t", torch.int32: "int32_t",
    torch.int16: "int16_t", torch.int8: "int8_t", torch.uint8: "uint8_t", torch.bool: "bool",
}
REDUCED = (torch.float16, torch.bfloat16)
_WIDEN = {torch.float16: "kiln_f16_to_f32", torch.bfloat16: "kiln_bf16_to_f32"}
_NARROW = {torch.float16: "kiln_f32_to_f16", torch.bfloat16: "kiln_f32_to_bf16"}


def storage_type(dtype: torch.dtype) -> str:
    """The C++ element type of a buffer of ``dtype``."""
    if dtype not in _STORAGE_TYPES:
        raise KilnCompileError(f"the C++ backend has no type for {dtype}", stage="codegen")
    return _STORAGE_TYPES[dtype]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in REDUCED else dtype


def ctype(dtype: torch.dtype) -> str:
    """The C++ type a value of ``dtype`` has inside a kernel."""
    return storage_type(compute_dtype(dtype))


def widen(expr: str, dtype: torch.dtype) -> str:
    """A loaded element of ``dtype`` as its compute type."""
    return f"{_WIDEN[dtype]}({expr})" if dtype in REDUCED else expr


def narrow(expr: str, value_dtype: torch.dtype, dtype: torch.dtype) -> str:
    """A value of ``value_dtype`` converted for storing into a buffer of ``dtype``."""
    if dtype in REDUCED:
        if value_dtype != torch.float32:
            expr = f"static_cast<float>({expr})"
        return f"{_NARROW[dtype]}({expr})"
    return convert(expr, value_dtype, dtype)


def convert(expr: str, src: torch.dtype, dst: torch.dtype) -> str:
    """``expr`` (of compute dtype ``src``) as compute dtype ``dst``, as eager casts."""
    if compute_dtype(src) == compute_dtype(dst) and dst not in REDUCED:
        return expr
    if dst == torch.bool:
        return f"({expr} != 0)"
    if dst in REDUCED:  # round as eager would, then keep computing in fp32
        inner = expr if src == torch.float32 else f"static_cast<float>({expr})"
        return f"{_WIDEN[dst]}({_NARROW[dst]}({inner}))"
    return f"static_cast<{ctype(dst)}>({expr})"


def literal(value: Any, dtype: torch.dtype) -> str:
    """A C++ literal of compute dtype ``dtype`` for a Python scalar."""
    dtype = compute_dtype(dtype)
    if dtype == torch.bool:
        return "true" if value else "false"
    if dtype.is_floating_point:
        return _float_literal(float(value), dtype == torch.float32)
    if isinstance(value, float) and math.isinf(value):
        info = torch.iinfo(dtype)
        value = info.max if value > 0 else info.min
    v = int(value)
    if v == -(2**63):
        return "(-9223372036854775807LL - 1)"
    text = f"{v}LL" if abs(v) > 2**31 - 1 else str(v)
    return text if dtype in (torch.int64, torch.int32) else f"static_cast<{ctype(dtype)}>({text})"


def _float_literal(v: float, single: bool) -> str:
    if math.isnan(v):
        return "__builtin_nanf(\"\")" if single else "__builtin_nan(\"\")"
    if math.isinf(v):
        inf = "__builtin_inff()" if single else "__builtin_inf()"
        return inf if v > 0 else f"(-{inf})"
    text = repr(v)
    if "e" not in text and "." not in text:
        text += ".0"
    if not single:
        return text
    if struct.unpack("f", struct.pack("f", v))[0] == v:
        return text + "f"
    return f"static_cast<float>({text})"  # rounded from double, as eager converts scalars


class CppIndexPrinter(IndexPrinter):
    """Index expressions as C++: ``/`` and ``%`` on non-negative ``int64_t`` values."""

    def print(self, expr: Expr) -> str:
        if isinstance(expr, FloorDiv):
            return f"({self._paren(expr.args[0])} / {self._paren(expr.args[1])})"
        if isinstance(expr, ModularIndexing):
            base, div, mod = expr.args
            inner = self._paren(base) if div == 1 else f"({self._paren(base)} / {self._paren(div)})"
            return f"({inner} % {self._paren(mod)})"
        return super().print(expr)

    def _minmax(self, fn: str, args: list[str]) -> str:
        out = args[0]
        for a in args[1:]:
            op = ">" if fn == "max" else "<"
            out = f"(({out}) {op} ({a}) ? ({out}) : ({a}))"
        return out


# Float ops by template: {x} the argument, {f} the libm suffix ("f" for float), {T} the type.
FLOAT_UNARY = {
    "abs": "fabs{f}({x})", "neg": "(-{x})", "exp": "exp{f}({x})", "exp2": "exp2{f}({x})",
    "expm1": "expm1{f}({x})", "log": "log{f}({x})", "log1p": "log1p{f}({x})",
    "log2": "log2{f}({x})", "log10": "log10{f}({x})", "sqrt": "sqrt{f}({x})",
    "rsqrt": "(({T})1 / sqrt{f}({x}))", "sin": "sin{f}({x})", "cos": "cos{f}({x})",
    "tan": "tan{f}({x})", "tanh": "tanh{f}({x})", "sinh": "sinh{f}({x})",
    "cosh": "cosh{f}({x})", "asin": "asin{f}({x})", "acos": "acos{f}({x})",
    "atan": "atan{f}({x})", "asinh": "asinh{f}({x})", "acosh": "acosh{f}({x})",
    "atanh": "atanh{f}({x})", "erf": "erf{f}({x})", "erfc": "erfc{f}({x})",
    "erfinv": "kiln_erfinv_{f}({x})", "lgamma": "lgamma{f}({x})",
    "sigmoid": "(({T})1 / (({T})1 + exp{f}(-{x})))", "relu": "({x} < 0 ? ({T})0 : {x})",
    "floor": "floor{f}({x})", "ceil": "ceil{f}({x})", "round": "nearbyint{f}({x})",
    "trunc": "trunc{f}({x})", "sign": "(({T})(0 < {x}) - ({T})({x} < 0))",
    "signbit": "(__builtin_signbit({x}) != 0)", "reciprocal": "(({T})1 / {x})",
    "square": "({x} * {x})", "logical_not": "({x} == 0)", "isnan": "({x} != {x})",
    "isinf": "(__builtin_isinf({x}) != 0)", "isfinite": "(__builtin_isfinite({x}) != 0)",
}
INT_UNARY = {
    "abs": "({x} < 0 ? -{x} : {x})", "neg": "(-{x})", "relu": "({x} < 0 ? ({T})0 : {x})",
    "sign": "(({T})(0 < {x}) - ({T})({x} < 0))", "logical_not": "({x} == 0)",
    "bitwise_not": "(~{x})", "square": "({x} * {x})", "floor": "{x}", "ceil": "{x}",
    "round": "{x}", "trunc": "{x}", "isnan": "false", "isinf": "false", "isfinite": "true",
    "signbit": "({x} < 0)",
}
BOOL_UNARY = {"logical_not": "(!{x})", "bitwise_not": "(!{x})", "abs": "{x}"}

COMMON_BINARY = {
    "add": "({a} + {b})", "sub": "({a} - {b})", "mul": "({a} * {b})", "eq": "({a} == {b})",
    "ne": "({a} != {b})", "lt": "({a} < {b})", "le": "({a} <= {b})", "gt": "({a} > {b})",
    "ge": "({a} >= {b})", "logical_and": "({a} && {b})", "logical_or": "({a} || {b})",
    "logical_xor": "(({a} != 0) != ({b} != 0))",
    "maximum": "kiln_maximum<{T}>({a}, {b})", "minimum": "kiln_minimum<{T}>({a}, {b})",
}
FLOAT_BINARY = {
    "truediv": "({a} / {b})", "floordiv": "kiln_floordiv_{f}({a}, {b})",
    "remainder": "kiln_remainder_{f}({a}, {b})", "truncdiv": "trunc{f}({a} / {b})",
    "fmod": "fmod{f}({a}, {b})", "pow": "pow{f}({a}, {b})", "atan2": "atan2{f}({a}, {b})",
    "hypot": "hypot{f}({a}, {b})", "copysign": "copysign{f}({a}, {b})",
    "nextafter": "nextafter{f}({a}, {b})",
}
INT_BINARY = {
    "floordiv": "kiln_floordiv_int<{T}>({a}, {b})",
    "remainder": "kiln_remainder_int<{T}>({a}, {b})",
    "truncdiv": "kiln_truncdiv_int<{T}>({a}, {b})", "fmod": "kiln_fmod_int<{T}>({a}, {b})",
    "pow": "kiln_pow_int<{T}>({a}, {b})", "bitwise_and": "({a} & {b})",
    "bitwise_or": "({a} | {b})", "bitwise_xor": "({a} ^ {b})",
    "bitwise_left_shift": "kiln_shift_left<{T}>({a}, {b})",
    "bitwise_right_shift": "kiln_shift_right<{T}>({a}, {b})",
}
BOOL_RESULT = {"eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
               "logical_not", "isnan", "isinf", "isfinite", "signbit"}


def promote(*values: Any) -> torch.dtype:
    dtypes = [v.dtype for v in values if isinstance(v, CSEVariable)]
    if not dtypes:
        return torch.float32
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


def render_op(name: str, args: Sequence[CSEVariable]) -> tuple[str, torch.dtype]:
    """The C++ expression of elementwise op ``name`` and the dtype of its result."""
    dtype = compute_dtype(promote(*args))
    texts = [str(a) for a in args]
    if len(args) == 1:
        expr, dtype = _unary(name, args[0], dtype)
    else:
        expr, dtype, texts = _binary(name, args, dtype)
        expr = expr.format(a=texts[0], b=texts[1], T=ctype(dtype), f=_suffix(dtype))
        return expr, torch.bool if name in BOOL_RESULT else dtype
    return expr, torch.bool if name in BOOL_RESULT else dtype


def _suffix(dtype: torch.dtype) -> str:
    return "f" if dtype == torch.float32 else ""


def _unary(name: str, x: CSEVariable, dtype: torch.dtype) -> tuple[str, torch.dtype]:
    text = str(x)
    table = BOOL_UNARY if dtype == torch.bool else INT_UNARY
    if not dtype.is_floating_point and name in table:
        return table[name].format(x=text, T=ctype(dtype)), dtype
    if not dtype.is_floating_point:  # a float op on integers computes in float32
        text, dtype = f"static_cast<float>({text})", torch.float32
    if name not in FLOAT_UNARY:
        raise KilnCompileError(f"the C++ backend has no op {name} for {dtype}", stage="codegen")
    return FLOAT_UNARY[name].format(x=text, T=ctype(dtype), f=_suffix(dtype)), dtype


def _binary(name: str, args: Sequence[CSEVariable], dtype: torch.dtype
            ) -> tuple[str, torch.dtype, list[str]]:
    texts = [str(a) for a in args]
    if name in COMMON_BINARY:
        return COMMON_BINARY[name], dtype, texts
    if dtype.is_floating_point and name in FLOAT_BINARY:
        return FLOAT_BINARY[name], dtype, _cast_all(args, dtype)
    if not dtype.is_floating_point and name in INT_BINARY:
        if dtype == torch.bool and name.startswith("bitwise_") and "shift" not in name:
            return INT_BINARY[name], dtype, texts
        return INT_BINARY[name], dtype, _cast_all(args, dtype)
    if name == "truediv" or name in FLOAT_BINARY:  # integers divided as float32
        return FLOAT_BINARY[name], torch.float32, _cast_all(args, torch.float32)
    raise KilnCompileError(f"the C++ backend has no op {name} for {dtype}", stage="codegen")


def _cast_all(args: Sequence[CSEVariable], dtype: torch.dtype) -> list[str]:
    return [convert(str(a), a.dtype, dtype) for a in args]


OpRenderer = Callable[[str, Sequence[CSEVariable]], tuple[str, torch.dtype]]
