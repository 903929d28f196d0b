"""Every elementwise lowering, evaluated by the IR interpreter, against eager.

Records in the style of JAX's op tests: each ``Op`` names a function, the dtypes it
applies to and the input domain of each argument. One test per (op, dtype) compiles a
single graph that applies the op to every input layout (contiguous, broadcast, scalar
tensor, Python scalar, strided, expanded, transposed, offset), so one compile covers all
layouts and a failure names the layout that broke.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)
INT = (torch.int64,)  # unary ops take one path for every integer width
M, N = 5, 7  # odd, distinct sizes: a swapped or merged index cannot pass by accident


@dataclass(frozen=True)
class Op:
    """One lowering under test: ``fn`` over arguments drawn from ``domains``."""

    name: str
    fn: Callable[..., Any]
    dtypes: tuple[torch.dtype, ...]
    domains: tuple[str, ...] = ("real",)
    scalar_ok: bool = True  # the last argument may be a Python scalar

    @property
    def arity(self) -> int:
        return len(self.domains)

    def __str__(self) -> str:
        return self.name


def _ops_params(ops: Sequence[Op]) -> list[Any]:
    return [pytest.param(op, dt, id=f"{op.name}-{str(dt)[6:]}") for op in ops for dt in op.dtypes]


# -- layouts ----------------------------------------------------------------------------

Draw = Callable[..., torch.Tensor]


def _layout(draw: Draw, kind: str, dtype: torch.dtype, domain: str) -> torch.Tensor:
    """An (M, N) tensor (or a broadcastable one) of values in ``domain``, laid out as ``kind``."""
    if kind == "contiguous":
        return draw((M, N), dtype, domain)
    if kind == "transposed":
        return draw((N, M), dtype, domain).t()
    if kind == "strided":  # every other row and every third column of a larger tensor
        return draw((2 * M, 3 * N), dtype, domain)[::2, 1::3]
    if kind == "expanded":
        return draw((M, 1), dtype, domain).expand(M, N)
    if kind == "offset":
        return draw((M + 1, N + 2), dtype, domain)[1:, 2:]
    if kind == "row":
        return draw((1, N), dtype, domain)
    if kind == "col":
        return draw((M, 1), dtype, domain)
    if kind == "vector":
        return draw((N,), dtype, domain)
    if kind == "scalar_tensor":
        return draw((), dtype, domain)
    raise ValueError(kind)


# Per layout case, the layout of each argument; the first argument always has the full size
# except in "col_row", where (M, 1) and (1, N) broadcast against each other.
_BINARY_LAYOUTS: dict[str, tuple[str, str]] = {
    "contiguous": ("contiguous", "contiguous"),
    "broadcast_row": ("contiguous", "row"),
    "broadcast_col_row": ("col", "row"),
    "broadcast_rank": ("transposed", "vector"),
    "scalar_tensor": ("strided", "scalar_tensor"),
    "scalar_tensor_first": ("scalar_tensor", "contiguous"),
    "strided": ("strided", "offset"),
    "expanded": ("expanded", "contiguous"),
    "transposed": ("transposed", "transposed"),
    "mixed": ("transposed", "strided"),
}
_UNARY_LAYOUTS = ("contiguous", "strided", "expanded", "transposed", "offset", "scalar_tensor")
_PY_SCALARS = {"real": -1.5, "positive": 2.5, "nonzero": -2.5, "unit": 0.5, "small": 1.5,
               "above_one": 1.5}


def _py_scalar(dtype: torch.dtype, domain: str) -> Any:
    value = _PY_SCALARS[domain]
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point:
        return value
    return {"real": -3, "positive": 2, "nonzero": -3, "small": 2}.get(domain, 2)


def _layout_cases(op: Op, dtype: torch.dtype, draw: Draw) -> list[tuple[str, list[Any]]]:
    """(label, arguments) for every layout the op is checked on."""
    if op.arity == 1:
        return [(k, [_layout(draw, k, dtype, op.domains[0])]) for k in _UNARY_LAYOUTS]
    cases = []
    for label, (first, other) in _BINARY_LAYOUTS.items():
        kinds = [first] + [other] * (op.arity - 1)
        cases.append((label, [_layout(draw, k, dtype, d) for k, d in zip(kinds, op.domains)]))
    if op.scalar_ok:
        args = [_layout(draw, "contiguous", dtype, d) for d in op.domains[:-1]]
        cases.append(("python_scalar", args + [_py_scalar(dtype, op.domains[-1])]))
    return cases


def _check_op(op: Op, dtype: torch.dtype, draw: Draw, check_lowering: Any) -> None:
    cases = _layout_cases(op, dtype, draw)
    tensors = [a for _, args in cases for a in args if isinstance(a, torch.Tensor)]

    def fn(*inputs: torch.Tensor) -> tuple[Any, ...]:
        it = iter(inputs)
        return tuple(op.fn(*[next(it) if isinstance(a, torch.Tensor) else a for a in args])
                     for _, args in cases)

    check_lowering(fn, *tensors, labels=[label for label, _ in cases])


# -- unary ------------------------------------------------------------------------------

UNARY: list[Op] = [
    Op("abs", torch.abs, FLOATS + INT), Op("neg", torch.neg, FLOATS + INT),
    Op("sign", torch.sign, FLOATS + INT), Op("relu", torch.relu, FLOATS + INT),
    Op("square", torch.square, FLOATS + INT),
    Op("exp", torch.exp, FLOATS + INT), Op("exp2", torch.exp2, FLOATS),
    Op("expm1", torch.expm1, FLOATS), Op("log", torch.log, FLOATS + INT, ("positive",)),
    Op("log1p", torch.log1p, FLOATS, ("positive",)),
    Op("log2", torch.log2, FLOATS, ("positive",)), Op("log10", torch.log10, FLOATS, ("positive",)),
    Op("sqrt", torch.sqrt, FLOATS + INT, ("positive",)),
    Op("rsqrt", torch.rsqrt, FLOATS + INT, ("positive",)),
    Op("reciprocal", torch.reciprocal, FLOATS, ("nonzero",)),
    Op("sin", torch.sin, FLOATS + INT), Op("cos", torch.cos, FLOATS),
    Op("tan", torch.tan, FLOATS, ("unit",)), Op("tanh", torch.tanh, FLOATS + INT),
    Op("sinh", torch.sinh, FLOATS), Op("cosh", torch.cosh, FLOATS),
    Op("asin", torch.asin, FLOATS, ("unit",)), Op("acos", torch.acos, FLOATS, ("unit",)),
    Op("atan", torch.atan, FLOATS), Op("asinh", torch.asinh, FLOATS),
    Op("acosh", torch.acosh, FLOATS, ("above_one",)), Op("atanh", torch.atanh, FLOATS, ("unit",)),
    Op("erf", torch.erf, FLOATS + INT), Op("erfc", torch.erfc, FLOATS),
    Op("erfinv", torch.erfinv, (torch.float32,), ("unit",)),
    Op("sigmoid", torch.sigmoid, FLOATS + INT),
    Op("floor", torch.floor, FLOATS + INT), Op("ceil", torch.ceil, FLOATS + INT),
    Op("round", torch.round, FLOATS + INT), Op("trunc", torch.trunc, FLOATS + INT),
    Op("frac", torch.frac, FLOATS),
    Op("round_decimals", lambda x: torch.round(x * 10, decimals=2), FLOATS),
    Op("round_decimals_negative", lambda x: torch.round(x * 100, decimals=-1), FLOATS),
    Op("logical_not", torch.logical_not, FLOATS + INT + (torch.bool,)),
    Op("bitwise_not", torch.bitwise_not, INTS + (torch.bool, torch.uint8, torch.int8)),
    Op("isnan_of_log", lambda x: torch.isnan(torch.log(x)), FLOATS),
    Op("signbit", torch.signbit, FLOATS),
    # A Python scalar as the first operand (rsub.Scalar, remainder.Scalar_Tensor, ...).
    Op("scalar_pow_base", lambda x: torch.pow(1.5, x), FLOATS + INT, ("small",)),
    Op("scalar_minus", lambda x: 2 - x, FLOATS + INT),
    Op("scalar_div", lambda x: 3 / x, FLOATS + INT, ("nonzero",)),
    Op("scalar_floordiv", lambda x: 10 // x, FLOATS + INT, ("nonzero",)),
    Op("scalar_remainder", lambda x: 7 % x, FLOATS + INT, ("nonzero",)),
    Op("gelu", F.gelu, FLOATS), Op("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), FLOATS),
    Op("silu", F.silu, FLOATS), Op("hardtanh", F.hardtanh, FLOATS),
    Op("leaky_relu", lambda x: F.leaky_relu(x, 0.2), FLOATS), Op("elu", F.elu, FLOATS),
    Op("hardswish", F.hardswish, FLOATS), Op("hardsigmoid", F.hardsigmoid, FLOATS),
    Op("softplus", F.softplus, FLOATS), Op("mish", F.mish, FLOATS),
]


@pytest.mark.parametrize(("op", "dtype"), _ops_params(UNARY))
def test_unary(op: Op, dtype: torch.dtype, draw: Draw, check_lowering: Any) -> None:
    _check_op(op, dtype, draw, check_lowering)


# -- binary -----------------------------------------------------------------------------

_ARITH = FLOATS + INTS
BINARY: list[Op] = [
    Op("add", torch.add, _ARITH + (torch.int8, torch.uint8), ("real", "real")),
    Op("add_alpha", lambda a, b: torch.add(a, b, alpha=3), _ARITH, ("real", "real")),
    Op("sub", torch.sub, _ARITH, ("real", "real")),
    Op("sub_alpha", lambda a, b: torch.sub(a, b, alpha=2), _ARITH, ("real", "real")),
    Op("rsub", lambda a, b: torch.rsub(a, b, alpha=2), _ARITH, ("real", "real")),
    Op("mul", torch.mul, _ARITH + (torch.bool,), ("real", "real")),
    Op("div", torch.div, _ARITH, ("real", "nonzero")),
    Op("div_floor", lambda a, b: torch.div(a, b, rounding_mode="floor"), _ARITH,
       ("real", "nonzero")),
    Op("div_trunc", lambda a, b: torch.div(a, b, rounding_mode="trunc"), _ARITH,
       ("real", "nonzero")),
    Op("true_divide", torch.true_divide, INTS, ("real", "nonzero")),
    Op("floor_divide", torch.floor_divide, _ARITH, ("real", "nonzero")),
    Op("remainder", torch.remainder, _ARITH, ("real", "nonzero")),
    Op("fmod", torch.fmod, _ARITH, ("real", "nonzero")),
    Op("pow", torch.pow, FLOATS, ("positive", "small")),
    Op("pow_int", torch.pow, INTS, ("real", "small")),
    Op("maximum", torch.maximum, _ARITH, ("real", "real"), scalar_ok=False),
    Op("minimum", torch.minimum, _ARITH, ("real", "real"), scalar_ok=False),
    Op("atan2", torch.atan2, FLOATS, ("real", "nonzero"), scalar_ok=False),
    Op("copysign", torch.copysign, FLOATS, ("real", "nonzero")),
    Op("hypot", torch.hypot, (torch.float32,), ("real", "real"), scalar_ok=False),
    Op("nextafter", torch.nextafter, (torch.float32,), ("real", "real"), scalar_ok=False),
    Op("xlogy", torch.xlogy, (torch.float32,), ("positive", "positive")),
    Op("bitwise_and", torch.bitwise_and, INTS + (torch.bool, torch.uint8), ("real", "real")),
    Op("bitwise_or", torch.bitwise_or, INTS + (torch.bool, torch.uint8), ("real", "real")),
    Op("bitwise_xor", torch.bitwise_xor, INTS + (torch.bool, torch.uint8), ("real", "real")),
    Op("bitwise_left_shift", torch.bitwise_left_shift, INTS, ("real", "small")),
    Op("bitwise_right_shift", torch.bitwise_right_shift, INTS, ("real", "small")),
    Op("logical_and", torch.logical_and, FLOATS + INTS + (torch.bool,), ("real", "real"),
       scalar_ok=False),
    Op("logical_or", torch.logical_or, (torch.float32, torch.int64, torch.bool),
       ("real", "real"), scalar_ok=False),
    Op("logical_xor", torch.logical_xor, (torch.float16, torch.int32, torch.bool),
       ("real", "real"), scalar_ok=False),
] + [Op(name, getattr(torch, name), _ARITH + (torch.bool,), ("real", "real"))
     for name in ("eq", "ne", "lt", "le", "gt", "ge")]


@pytest.mark.parametrize(("op", "dtype"), _ops_params(BINARY))
def test_binary(op: Op, dtype: torch.dtype, draw: Draw, check_lowering: Any) -> None:
    _check_op(op, dtype, draw, check_lowering)


# -- ternary: where, clamp, lerp, addcmul, addcdiv ------------------------------------------


def _where(c: torch.Tensor, a: Any, b: Any) -> torch.Tensor:
    return torch.where(c > 0, a, b)


TERNARY: list[Op] = [
    Op("where", _where, FLOATS + INTS + (torch.bool,), ("real", "real", "real")),
    Op("clamp_tensor", lambda x, lo, hi: torch.clamp(x, lo, lo + hi.abs()), FLOATS + INTS,
       ("real", "real", "real"), scalar_ok=False),
    Op("lerp", lambda a, b, w: torch.lerp(a, b, w), FLOATS, ("real", "real", "unit")),
    Op("addcmul", lambda a, b, c: torch.addcmul(a, b, c, value=0.5), FLOATS,
       ("real", "real", "real"), scalar_ok=False),
    Op("addcdiv", lambda a, b, c: torch.addcdiv(a, b, c, value=2), FLOATS,
       ("real", "real", "nonzero"), scalar_ok=False),
]


@pytest.mark.parametrize(("op", "dtype"), _ops_params(TERNARY))
def test_ternary(op: Op, dtype: torch.dtype, draw: Draw, check_lowering: Any) -> None:
    _check_op(op, dtype, draw, check_lowering)


CLAMPS: list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]] = [
    ("clamp", lambda x: torch.clamp(x, -2, 3)),
    ("clamp_float_bounds", lambda x: torch.clamp(x, -0.5, 0.75)),  # promotes ints to float
    ("clamp_min", lambda x: torch.clamp_min(x, 1)),
    ("clamp_max", lambda x: torch.clamp_max(x, -1)),
    ("clamp_only_min", lambda x: torch.clamp(x, min=0)),
    ("clamp_only_max", lambda x: torch.clamp(x, max=0)),
    ("clamp_min_tensor", lambda x: torch.clamp_min(x, x[:, :1])),
    ("clamp_max_tensor_0d", lambda x: torch.clamp_max(x, x[0, 0])),
]


@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_clamp_scalar_and_tensor_bounds(dtype: torch.dtype, draw: Draw,
                                        check_lowering: Any) -> None:
    inputs = [draw((M, N), dtype), draw((N, M), dtype).t(), draw((2 * M, N), dtype)[::2]]

    def fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> list[torch.Tensor]:
        return [clamp(x) for _, clamp in CLAMPS for x in (a, b, c)]

    labels = [f"{name} {layout}" for name, _ in CLAMPS for layout in ("c", "t", "strided")]
    check_lowering(fn, *inputs, labels=labels)


# -- type promotion across dtypes -----------------------------------------------------------

MIXED: list[tuple[str, torch.dtype, torch.dtype]] = [
    ("int32_float16", torch.int32, torch.float16), ("int64_float32", torch.int64, torch.float32),
    ("bool_int32", torch.bool, torch.int32), ("bool_bfloat16", torch.bool, torch.bfloat16),
    ("float16_bfloat16", torch.float16, torch.bfloat16), ("int8_uint8", torch.int8, torch.uint8),
    ("float16_float32", torch.float16, torch.float32), ("int32_int64", torch.int32, torch.int64),
]
_PROMOTING = [
    ("add", torch.add), ("mul", torch.mul), ("div", lambda a, b: a / (b * b + 1)),
    ("maximum", torch.maximum), ("lt", torch.lt), ("where", lambda a, b: torch.where(a > 0, a, b)),
]


@pytest.mark.parametrize(("pair", "da", "db"), MIXED, ids=[m[0] for m in MIXED])
def test_type_promotion(pair: str, da: torch.dtype, db: torch.dtype, draw: Draw,
                        check_lowering: Any) -> None:
    """Mixed dtypes, with dimensioned tensors, 0-d tensors and Python scalars."""
    a, b = draw((M, N), da), draw((M, N), db)
    a0, b0 = draw((), da), draw((), db)

    def fn(a: torch.Tensor, b: torch.Tensor, a0: torch.Tensor, b0: torch.Tensor) -> list[Any]:
        outs = []
        for _, op in _PROMOTING:
            outs += [op(a, b), op(b, a), op(a, b0), op(b, a0), op(a0, b0)]
        return outs + [a + 2.5, b * 3, a + True, a0 + 1.5]

    labels = [f"{name} {form}" for name, _ in _PROMOTING
              for form in ("a,b", "b,a", "a,0d b", "b,0d a", "0d,0d")]
    check_lowering(fn, a, b, a0, b0, labels=labels + ["+float", "*int", "+bool", "0d+float"])


# -- casts --------------------------------------------------------------------------------

CAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
               torch.int8, torch.uint8, torch.bool)


@pytest.mark.parametrize("src", CAST_DTYPES, ids=[str(d)[6:] for d in CAST_DTYPES])
def test_casts(src: torch.dtype, draw: Draw, check_lowering: Any) -> None:
    """``.to`` and ``_to_copy`` from ``src`` to every dtype, on three layouts."""
    # Values that every target represents (casting 300.0 to uint8 is undefined behaviour).
    base = draw((M, N), torch.float32).abs() * 4 + 1 if src != torch.bool else draw((M, N), src)
    x = base.to(src)
    inputs = [x, x.t().contiguous().t(), draw((2 * M, N), torch.float32)[::2].abs().to(src)]

    def fn(*xs: torch.Tensor) -> list[torch.Tensor]:
        outs = [t.to(d) for t in xs for d in CAST_DTYPES]
        return outs + [xs[0].to(torch.float32) * 2, (xs[0] > 3).to(src)]

    check_lowering(fn, *inputs, labels=[f"{i} to {d}" for i in range(3) for d in CAST_DTYPES]
                   + ["to float then mul", "bool to src"])


def test_cast_chain_rounds_through_reduced_precision(check_lowering: Any) -> None:
    """fp32 -> fp16 -> fp32 must round, not pass the fp32 value through unchanged."""
    x = torch.tensor([1.0 + 2**-12, 3.14159265, 65504.0, 1e-5]) + torch.rand(4) * 1e-3
    check_lowering(lambda t: (t.half().float() - t, t.bfloat16().float() - t), x)
