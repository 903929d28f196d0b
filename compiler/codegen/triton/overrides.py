"""Triton overrides of the ops protocol: each op becomes a Triton expression string.

Values are ``CSEVariable``s that remember the dtype they hold in the kernel; fp16 and
bf16 data are upcast to fp32 when loaded, so math runs in fp32.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..common import CSEVariable

_TL_DTYPES = {
    torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
    torch.float64: "tl.float64", torch.int64: "tl.int64", torch.int32: "tl.int32",
    torch.int16: "tl.int16", torch.int8: "tl.int8", torch.uint8: "tl.uint8",
    torch.bool: "tl.int1",
}

SIGNATURE_DTYPES = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
    torch.float64: "fp64", torch.int64: "i64", torch.int32: "i32", torch.int16: "i16",
    torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
}


def triton_type(dtype: torch.dtype) -> str:
    if dtype not in _TL_DTYPES:
        raise NotImplementedError(f"Triton codegen has no type for {dtype}")
    return _TL_DTYPES[dtype]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def literal(value: Any, dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "True" if value else "False"
    if dtype.is_floating_point:
        v = float(value)
        if math.isnan(v):
            return 'float("nan")'
        if math.isinf(v):
            return 'float("inf")' if v > 0 else 'float("-inf")'
        return repr(v)
    if isinstance(value, float) and math.isinf(value):
        info = torch.iinfo(dtype)
        value = info.max if value > 0 else info.min
    return str(int(value))


def promote(*values: Any) -> torch.dtype:
    dtypes = [v.dtype for v in values if isinstance(v, CSEVariable)]
    if not dtypes:
        return torch.float32
    out = dtypes[0]
    for d in dtypes[1:]:
        out = torch.promote_types(out, d)
    return out


# Unary ops by the Triton expression they render to ({x} is the argument).
UNARY_TEMPLATES = {
    "abs": "tl.abs({x})", "neg": "-{x}", "exp": "tl.exp({x})", "exp2": "tl.exp2({x})",
    "expm1": "libdevice.expm1({x})", "log": "tl.log({x})", "log1p": "libdevice.log1p({x})",
    "log2": "tl.log2({x})", "log10": "libdevice.log10({x})", "sqrt": "tl.sqrt({x})",
    "rsqrt": "tl.rsqrt({x})", "sin": "tl.sin({x})", "cos": "tl.cos({x})",
    "tan": "libdevice.tan({x})", "tanh": "libdevice.tanh({x})", "sinh": "libdevice.sinh({x})",
    "cosh": "libdevice.cosh({x})", "asin": "libdevice.asin({x})",
    "acos": "libdevice.acos({x})", "atan": "libdevice.atan({x})",
    "asinh": "libdevice.asinh({x})", "acosh": "libdevice.acosh({x})",
    "atanh": "libdevice.atanh({x})", "erf": "tl.erf({x})", "erfc": "libdevice.erfc({x})",
    "erfinv": "libdevice.erfinv({x})", "lgamma": "libdevice.lgamma({x})",
    "sigmoid": "tl.sigmoid({x})", "floor": "tl.floor({x})", "ceil": "tl.ceil({x})",
    "round": "libdevice.nearbyint({x})", "trunc": "libdevice.trunc({x})",
    "reciprocal": "(1.0 / {x})", "square": "({x} * {x})", "bitwise_not": "~{x}",
    "isnan": "({x} != {x})", "isinf": '(tl.abs({x}) == float("inf"))',
    "isfinite": '(tl.abs({x}) < float("inf"))',
    "signbit": "(({x} < 0) | (({x} == 0) & ((1.0 / {x}) < 0)))",
}

BINARY_TEMPLATES = {
    "add": "{a} + {b}", "sub": "{a} - {b}", "mul": "{a} * {b}", "truediv": "{a} / {b}",
    "eq": "{a} == {b}", "ne": "{a} != {b}", "lt": "{a} < {b}", "le": "{a} <= {b}",
    "gt": "{a} > {b}", "ge": "{a} >= {b}", "logical_and": "({a} != 0) & ({b} != 0)",
    "logical_or": "({a} != 0) | ({b} != 0)", "logical_xor": "({a} != 0) ^ ({b} != 0)",
    "bitwise_and": "{a} & {b}",
    "bitwise_or": "{a} | {b}", "bitwise_xor": "{a} ^ {b}",
    "bitwise_left_shift": "{a} << {b}", "bitwise_right_shift": "{a} >> {b}",
    "atan2": "libdevice.atan2({a}, {b})", "pow": "libdevice.pow({a}, {b})",
    "hypot": "libdevice.hypot({a}, {b})", "copysign": "libdevice.copysign({a}, {b})",
    "nextafter": "libdevice.nextafter({a}, {b})",
}

BOOL_RESULT = {"eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor",
               "logical_not", "isnan", "isinf", "isfinite", "signbit"}
