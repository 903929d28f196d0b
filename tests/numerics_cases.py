"""Numerics cases shared by the backends' tests: a function, inputs per dtype, and the
dtypes it applies to. Inputs are fresh random values (never zeros) in each op's domain."""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
ALL = FLOATS + (torch.int32, torch.int64)


@dataclass(frozen=True)
class Case:
    name: str
    fn: Callable[..., object]
    inputs: Callable[[torch.dtype], list[torch.Tensor]]
    dtypes: tuple[torch.dtype, ...] = FLOATS


def rand(*shape: int, dtype: torch.dtype = torch.float32, low: float = -2.0,
         high: float = 2.0) -> torch.Tensor:
    """Uniform random values in [low, high), never exactly zero; ints in a sane range."""
    if not dtype.is_floating_point:
        if dtype == torch.bool:
            return torch.rand(*shape) > 0.5
        t = torch.randint(int(low) if low < 0 else 1, max(int(high), 2) + 3, shape)
        t = torch.where(t == 0, torch.ones_like(t), t)
        return t.to(dtype)
    t = torch.rand(*shape) * (high - low) + low
    t = torch.where(t.abs() < 1e-3, torch.full_like(t, 0.5), t)
    return t.to(dtype)


def positive(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return rand(*shape, dtype=dtype, low=0.1, high=3.0)


def tolerance(dtype: torch.dtype, reduction: bool = False) -> dict[str, float]:
    """assert_close tolerances by dtype (exact for integers and bools)."""
    if dtype == torch.float16:
        return {"atol": 2e-3 if not reduction else 1e-2, "rtol": 2e-3 if not reduction else 1e-2}
    if dtype == torch.bfloat16:
        return {"atol": 2e-2 if not reduction else 5e-2, "rtol": 2e-2 if not reduction else 5e-2}
    if dtype == torch.float32:
        return {"atol": 1e-5 if not reduction else 1e-4, "rtol": 1.3e-5 if not reduction else 1e-4}
    return {"atol": 0, "rtol": 0}


def _unary(name: str, fn: Callable[..., object], domain: str = "any",
           dtypes: tuple[torch.dtype, ...] = FLOATS) -> Case:
    make = positive if domain == "pos" else rand
    return Case(name, fn, lambda dt: [make(33, 65, dtype=dt)], dtypes)


def _binary(name: str, fn: Callable[..., object], dtypes: tuple[torch.dtype, ...] = ALL,
            rhs_positive: bool = False) -> Case:
    make_rhs = positive if rhs_positive else rand
    return Case(name, fn, lambda dt: [rand(33, 65, dtype=dt), make_rhs(1, 65, dtype=dt)], dtypes)


POINTWISE: list[Case] = [
    _unary("abs", torch.abs, dtypes=ALL), _unary("neg", torch.neg, dtypes=ALL),
    _unary("exp", torch.exp), _unary("expm1", torch.expm1), _unary("log", torch.log, "pos"),
    _unary("log1p", torch.log1p, "pos"), _unary("sqrt", torch.sqrt, "pos"),
    _unary("rsqrt", torch.rsqrt, "pos"), _unary("sin", torch.sin), _unary("cos", torch.cos),
    _unary("tanh", torch.tanh), _unary("erf", torch.erf), _unary("sigmoid", torch.sigmoid),
    _unary("sign", torch.sign, dtypes=ALL), _unary("floor", torch.floor),
    _unary("ceil", torch.ceil), _unary("round", torch.round), _unary("trunc", torch.trunc),
    _unary("relu", torch.relu, dtypes=ALL), _unary("reciprocal", torch.reciprocal, "pos"),
    _unary("pow_scalar", lambda x: torch.pow(x, 3)), _unary("pow_half", lambda x: x ** 0.5, "pos"),
    _unary("clamp", lambda x: torch.clamp(x, -0.5, 0.7), dtypes=FLOATS),
    _unary("isnan_where", lambda x: torch.where(torch.isnan(x.log()), 0.0, x)),
    _unary("logical_not", lambda x: torch.logical_not(x > 0), dtypes=ALL),
    # bf16 is left out: Triton's interpreter rounds bf16 differently from the GPU.
    _unary("cast_int", lambda x: (x * 10).to(torch.int32), dtypes=(torch.float32, torch.float16)),
    _unary("cast_half", lambda x: x.to(torch.float16), dtypes=(torch.float32,)),
    _unary("cast_bool_float", lambda x: (x > 0.25).float() + x, dtypes=FLOATS),
    _binary("add", torch.add), _binary("add_alpha", lambda a, b: torch.add(a, b, alpha=2)),
    _binary("sub", torch.sub), _binary("mul", torch.mul),
    _binary("div", torch.div, dtypes=FLOATS, rhs_positive=True),
    _binary("div_int_true", torch.div, dtypes=(torch.int32, torch.int64), rhs_positive=True),
    _binary("div_floor", lambda a, b: torch.div(a, b, rounding_mode="floor"), rhs_positive=True),
    _binary("div_trunc", lambda a, b: torch.div(a, b, rounding_mode="trunc"), rhs_positive=True),
    _binary("remainder", torch.remainder, rhs_positive=True),
    _binary("fmod", torch.fmod, rhs_positive=True),
    _binary("maximum", torch.maximum), _binary("minimum", torch.minimum),
    _binary("pow", lambda a, b: torch.pow(a.abs() + 0.5, b), dtypes=FLOATS),
    _binary("eq", lambda a, b: a == b), _binary("lt", lambda a, b: a < b),
    _binary("ge", lambda a, b: a >= b), _binary("ne", lambda a, b: a != b),
    _binary("logical_and", lambda a, b: (a > 0) & (b > 0)),
    _binary("logical_xor", lambda a, b: torch.logical_xor(a > 0, b > 0)),
    _binary("bitwise", lambda a, b: (a & b) | (a ^ b), dtypes=(torch.int32, torch.int64)),
    _binary("where", lambda a, b: torch.where(a > b, a, b * 2)),
    _binary("scalar_mix", lambda a, b: a * 0.5 + 3 - b / 1.5, dtypes=FLOATS),
    _binary("atan2", torch.atan2, dtypes=FLOATS),
]

REDUCTIONS: list[Case] = [
    Case("sum_last", lambda x: x.sum(-1), lambda dt: [rand(37, 129, dtype=dt)], ALL),
    Case("sum_first", lambda x: x.sum(0), lambda dt: [rand(37, 129, dtype=dt)]),
    Case("sum_all", lambda x: x.sum(), lambda dt: [rand(37, 129, dtype=dt)]),
    Case("sum_keepdim_mid", lambda x: x.sum(1, keepdim=True),
         lambda dt: [rand(4, 37, 9, dtype=dt)]),
    Case("mean", lambda x: x.mean(-1), lambda dt: [rand(37, 129, dtype=dt)]),
    Case("prod", lambda x: x.prod(-1), lambda dt: [rand(37, 9, dtype=dt, low=0.5, high=1.5)]),
    Case("amax", lambda x: x.amax(-1), lambda dt: [rand(37, 129, dtype=dt)], ALL),
    Case("amin", lambda x: x.amin(0), lambda dt: [rand(37, 129, dtype=dt)], ALL),
    Case("argmax", lambda x: x.argmax(-1), lambda dt: [rand(37, 129, dtype=dt)], ALL),
    Case("argmin_keepdim", lambda x: x.argmin(0, keepdim=True),
         lambda dt: [rand(37, 129, dtype=dt)]),
    Case("argmax_flat", lambda x: x.argmax(), lambda dt: [rand(37, 29, dtype=dt)]),
    Case("any_all", lambda x: (torch.any(x > 1.5, -1), torch.all(x > -1.75, -1)),
         lambda dt: [rand(37, 129, dtype=dt)]),
    Case("var_mean", lambda x: torch.var_mean(x, -1), lambda dt: [rand(37, 129, dtype=dt)]),
    Case("var_biased", lambda x: torch.var(x, 0, correction=0),
         lambda dt: [rand(37, 129, dtype=dt)]),
    Case("sum_looped", lambda x: x.sum(-1), lambda dt: [rand(3, 5000, dtype=dt)]),
    Case("amax_looped", lambda x: x.amax(-1), lambda dt: [rand(3, 5000, dtype=dt)]),
    Case("argmax_looped", lambda x: x.argmax(-1), lambda dt: [rand(3, 5000, dtype=dt)]),
    Case("var_mean_looped", lambda x: torch.var_mean(x, -1), lambda dt: [rand(3, 5000, dtype=dt)]),
]

COMPOSITES: list[Case] = [
    Case("seed", lambda a, b, c: ((a + b) * c.relu()).sum(dim=-1),
         lambda dt: [rand(64, 128, dtype=dt) for _ in range(3)]),
    Case("softmax", lambda x: torch.softmax(x, -1), lambda dt: [rand(33, 100, dtype=dt)]),
    Case("softmax_dim0", lambda x: torch.softmax(x, 0), lambda dt: [rand(33, 100, dtype=dt)]),
    Case("softmax_looped", lambda x: torch.softmax(x, -1), lambda dt: [rand(3, 5000, dtype=dt)]),
    Case("log_softmax", lambda x: F.log_softmax(x, -1), lambda dt: [rand(33, 100, dtype=dt)]),
    Case("layer_norm", lambda x, w, b: F.layer_norm(x, (96,), w, b),
         lambda dt: [rand(33, 96, dtype=dt), rand(96, dtype=dt), rand(96, dtype=dt)]),
    Case("rms_norm", lambda x, w: F.rms_norm(x, (96,), w, eps=1e-6),
         lambda dt: [rand(33, 96, dtype=dt), rand(96, dtype=dt)]),
    Case("gelu", lambda x: F.gelu(x), lambda dt: [rand(33, 65, dtype=dt)]),
    Case("gelu_tanh", lambda x: F.gelu(x, approximate="tanh"), lambda dt: [rand(33, 65, dtype=dt)]),
    Case("silu", lambda x: F.silu(x), lambda dt: [rand(33, 65, dtype=dt)]),
    Case("cross_entropy", lambda x, t: F.cross_entropy(x, t),
         lambda dt: [rand(16, 50, dtype=dt), torch.randint(0, 50, (16,))]),
    Case("gelu_mlp_tail", lambda x, w, b, r: F.gelu(x @ w + b) + r,
         lambda dt: [rand(16, 32, dtype=dt), rand(32, 64, dtype=dt) / 4, rand(64, dtype=dt),
                     rand(16, 64, dtype=dt)]),
]

LAYOUTS: list[Case] = [
    Case("broadcast_3d", lambda a, b, c: a * b + c,
         lambda dt: [rand(4, 1, 33, dtype=dt), rand(7, 33, dtype=dt), rand(1, dtype=dt)], ALL),
    Case("transposed_in", lambda a, b: a.t() + b, lambda dt: [rand(65, 33, dtype=dt),
                                                           rand(33, 65, dtype=dt)], ALL),
    Case("permute_out", lambda a: (a + 1).permute(2, 0, 1), lambda dt: [rand(5, 6, 7, dtype=dt)]),
    Case("strided_slice", lambda a: a[::2, 1::3] * 2, lambda dt: [rand(33, 65, dtype=dt)], ALL),
    Case("expand", lambda a: a.expand(9, 5, 33).exp(), lambda dt: [rand(5, 1, dtype=dt)]),
    Case("reshape_merge_split", lambda a: (a.reshape(6, 35) + 1).reshape(2, 3, 5, 7).sum(2),
         lambda dt: [rand(2, 3, 35, dtype=dt)]),
    Case("select_unsqueeze", lambda a: a[:, 3].unsqueeze(-1) * a,
         lambda dt: [rand(9, 11, dtype=dt)]),
    Case("cat", lambda a, b: torch.cat([a, b * 2], 1), lambda dt: [rand(9, 5, dtype=dt),
                                                                 rand(9, 7, dtype=dt)], ALL),
    Case("pad", lambda a: F.pad(a, (1, 2, 3, 0), value=0.5), lambda dt: [rand(9, 5, dtype=dt)]),
    Case("gather", lambda a, i: torch.gather(a, 1, i),
         lambda dt: [rand(9, 13, dtype=dt), torch.randint(0, 13, (9, 4))], ALL),
    Case("index_neg", lambda a, i: a[i] + 1,
         lambda dt: [rand(9, 13, dtype=dt), torch.randint(-9, 9, (5,))]),
    Case("embedding", lambda w, i: F.embedding(i, w) * 2,
         lambda dt: [rand(20, 16, dtype=dt), torch.randint(0, 20, (3, 7))]),
    Case("noncontig_reduction", lambda a: a.t().sum(-1), lambda dt: [rand(65, 33, dtype=dt)]),
]

FALLBACK: list[Case] = [
    # cumsum is a masked sum (lowering/reductions.py); cumprod still runs ATen's kernel
    Case("cumsum_masked_sum", lambda a: torch.cumsum(a.exp(), 1) * 2,
         lambda dt: [rand(9, 13, dtype=dt)], (torch.float32,)),
    Case("cumprod_fallback", lambda a: torch.cumprod(a.exp() * 0.5, 1) * 2,
         lambda dt: [rand(9, 13, dtype=dt)], (torch.float32,)),
]

ALL_CASES = POINTWISE + REDUCTIONS + COMPOSITES + LAYOUTS + FALLBACK


def expand_cases(cases: list[Case]) -> list[tuple[Case, torch.dtype]]:
    return [(c, dt) for c in cases for dt in c.dtypes]


def case_seed(case: Case) -> int:
    """A seed per case that is the same in every process (``hash`` of a str is not)."""
    return zlib.crc32(case.name.encode()) % 1000


def case_id(item: tuple[Case, torch.dtype]) -> str:
    case, dt = item
    return f"{case.name}-{str(dt).removeprefix('torch.')}"


def is_reduction(case: Case) -> bool:
    return case in REDUCTIONS or case in COMPOSITES
