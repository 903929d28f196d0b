"""Reduction lowerings against eager: every reduction over dtypes, input layouts and dims.

One graph per (reduction, dtype) applies the reduction to each input layout with each
choice of dims (all, one, negative, several, keepdim), so one compile covers them all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)
SHAPE = (3, 4, 5)

Draw = Callable[..., torch.Tensor]


def _inputs(draw: Draw, dtype: torch.dtype, domain: str) -> dict[str, torch.Tensor]:
    """A (3, 4, 5) tensor in several memory layouts."""
    return {
        "contiguous": draw(SHAPE, dtype, domain),
        "permuted": draw(SHAPE[::-1], dtype, domain).permute(2, 1, 0),
        "strided": draw((6, 4, 10), dtype, domain)[::2, :, 1::2],
        "expanded": draw((3, 1, 5), dtype, domain).expand(SHAPE),
    }


# (label, dim, keepdim); dim None reduces everything.
DIMS: list[tuple[str, Any, bool]] = [
    ("all", None, False), ("dim0", 0, False), ("dim-1", -1, False),
    ("dims0,2", (0, 2), False), ("dim1_keepdim", 1, True), ("dims-1,0_keepdim", (-1, 0), True),
]
SINGLE_DIMS = [d for d in DIMS if d[1] is None or isinstance(d[1], int)]


@dataclass(frozen=True)
class Reduction:
    """A reduction ``fn(x, dim, keepdim)``; ``single_dim`` ops take one dim or None."""

    name: str
    fn: Callable[[torch.Tensor, Any, bool], Any]
    dtypes: tuple[torch.dtype, ...]
    domain: str = "real"
    single_dim: bool = False


def _sum(x: torch.Tensor, dim: Any, keepdim: bool) -> torch.Tensor:
    return x.sum() if dim is None else x.sum(dim, keepdim=keepdim)


def _all_dims(dim: Any, x: torch.Tensor) -> Any:
    return list(range(x.dim())) if dim is None else dim


def _var(correction: int) -> Callable[[torch.Tensor, Any, bool], Any]:
    return lambda x, d, k: torch.var(x, _all_dims(d, x), correction=correction, keepdim=k)


def _arg(fn: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor, Any, bool], Any]:
    return lambda x, d, k: fn(x) if d is None else fn(x, d, keepdim=k)


REDUCTIONS: list[Reduction] = [
    Reduction("sum", _sum, FLOATS + INTS + (torch.bool, torch.int8)),
    Reduction("sum_dtype", lambda x, d, k: torch.sum(x, _all_dims(d, x), k, dtype=torch.float32),
              (torch.float16, torch.bfloat16, torch.int32)),
    Reduction("mean", lambda x, d, k: torch.mean(x, _all_dims(d, x), k), FLOATS),
    Reduction("mean_dtype", lambda x, d, k: torch.mean(x, _all_dims(d, x), k,
                                                       dtype=torch.float32),
              (torch.float16, torch.int64)),
    # Factors near one (floats) or of magnitude at most two (ints): no overflow.
    Reduction("prod", lambda x, d, k: torch.prod(x) if d is None else torch.prod(x, d, k),
              FLOATS + INTS, domain="near_one", single_dim=True),
    Reduction("amax", lambda x, d, k: torch.amax(x, _all_dims(d, x), k),
              FLOATS + INTS + (torch.bool,)),
    Reduction("amin", lambda x, d, k: torch.amin(x, _all_dims(d, x), k), FLOATS + INTS),
    Reduction("argmax", _arg(torch.argmax), FLOATS + INTS, single_dim=True),
    Reduction("argmin", _arg(torch.argmin), FLOATS + INTS, single_dim=True),
    Reduction("max_dim", lambda x, d, k: torch.max(x) if d is None else torch.max(x, d, k),
              FLOATS + INTS, single_dim=True),
    Reduction("min_dim", lambda x, d, k: torch.min(x) if d is None else torch.min(x, d, k),
              (torch.float32, torch.int64), single_dim=True),
    Reduction("any", lambda x, d, k: torch.any(x) if d is None else torch.any(x, d, k),
              (torch.float32, torch.int32, torch.bool), single_dim=True),
    Reduction("all", lambda x, d, k: torch.all(x) if d is None else torch.all(x, d, k),
              (torch.float16, torch.int64, torch.bool), single_dim=True),
    Reduction("any_of_compare", lambda x, d, k: torch.any(x > 1, _all_dims(d, x), k),
              (torch.float32, torch.int32)),
    Reduction("var_correction0", _var(0), FLOATS),
    Reduction("var_correction1", _var(1), FLOATS),
    Reduction("var_unbiased_false", lambda x, d, k: torch.var(x, _all_dims(d, x), False, k),
              (torch.float32,)),
    Reduction("std_correction0", lambda x, d, k: torch.std(x, _all_dims(d, x), correction=0,
                                                           keepdim=k), FLOATS),
    Reduction("std_correction1", lambda x, d, k: torch.std(x, _all_dims(d, x), keepdim=k),
              FLOATS),
    Reduction("var_mean", lambda x, d, k: torch.var_mean(x, _all_dims(d, x), correction=1,
                                                         keepdim=k), FLOATS),
    Reduction("var_mean_correction0", lambda x, d, k: torch.var_mean(
        x, _all_dims(d, x), correction=0, keepdim=k), (torch.float32,)),
    Reduction("std_mean", lambda x, d, k: torch.std_mean(x, _all_dims(d, x), correction=0,
                                                         keepdim=k), FLOATS),
    Reduction("logsumexp", lambda x, d, k: torch.logsumexp(x, _all_dims(d, x), k), FLOATS),
    Reduction("sum_of_products", lambda x, d, k: _sum(x * x.abs() + 1, d, k), FLOATS + INTS),
]


def _params() -> list[Any]:
    return [pytest.param(r, dt, id=f"{r.name}-{str(dt)[6:]}") for r in REDUCTIONS
            for dt in r.dtypes]


def _draw(draw: Draw, dtype: torch.dtype, domain: str) -> dict[str, torch.Tensor]:
    if domain != "near_one":
        return _inputs(draw, dtype, domain)
    if dtype.is_floating_point:
        return {k: (v * 0.25 + 1).to(dtype) for k, v in
                _inputs(draw, torch.float32, "unit").items()}
    return {k: v.clamp(-2, 2) for k, v in _inputs(draw, dtype, "nonzero").items()}


@pytest.mark.parametrize(("red", "dtype"), _params())
def test_reduction(red: Reduction, dtype: torch.dtype, draw: Draw,
                   check_lowering: Any) -> None:
    inputs = _draw(draw, dtype, red.domain)
    # Each layout with half of the dim choices, rotating: every choice meets two layouts.
    dims = SINGLE_DIMS if red.single_dim else DIMS
    half = len(dims) // 2
    plan = [(layout, dims[(i * half // 2 + k) % len(dims)])
            for i, layout in enumerate(inputs) for k in range(half)]

    def fn(*xs: torch.Tensor) -> list[Any]:
        by_layout = dict(zip(inputs, xs))
        return [red.fn(by_layout[layout], dim, keepdim) for layout, (_, dim, keepdim) in plan]

    labels = [f"{layout} {label}" for layout, (label, _, _) in plan]
    sg = check_lowering(fn, *inputs.values(), reduction=True,
                        labels=_expand_labels(labels, fn, inputs))
    assert any(b.is_reduction() for b in _computed(sg)), "no Reduction was lowered"


def _expand_labels(labels: list[str], fn: Callable[..., list[Any]],
                   inputs: dict[str, torch.Tensor]) -> list[str]:
    """Labels per flat output: a (values, indices) result gives two."""
    outs = fn(*inputs.values())
    flat = []
    for label, out in zip(labels, outs):
        n = len(out) if isinstance(out, tuple) else 1
        flat += [label] if n == 1 else [f"{label}[{i}]" for i in range(n)]
    return flat


def _computed(sg: Any) -> list[Any]:
    return [b for b in sg.graph.buffers if hasattr(b, "is_reduction")]


def test_reduction_of_a_0d_tensor(draw: Draw, check_lowering: Any) -> None:
    """A 0-d tensor takes dim 0 or -1 and has nothing to reduce."""
    x = draw((), torch.float32)

    def fn(t: torch.Tensor) -> list[torch.Tensor]:
        return [t.sum(-1), t.amax(0, keepdim=True), t.argmax(0), torch.softmax(t, -1),
                t.mean(-1), t.any(0)]

    check_lowering(fn, x, reduction=True)


@pytest.mark.filterwarnings("ignore:var\\(\\)")  # eager warns: no degrees of freedom
def test_reduction_over_size_one_dims(draw: Draw, check_lowering: Any) -> None:
    """Reducing a dim of one element is a pointwise op: argmax is 0, the variance 0 or nan."""
    x = draw((4, 1, 3), torch.float16)

    def fn(t: torch.Tensor) -> list[Any]:
        return [t.sum(1), t.argmax(1), t.argmin(1, keepdim=True), t.max(1), torch.var_mean(
            t, 1, correction=0), torch.var(t, 1), t.prod(1), t.amin(1, keepdim=True)]

    check_lowering(fn, x, reduction=True)


def test_argmax_returns_the_first_of_equal_values(check_lowering: Any) -> None:
    x = torch.tensor([[1, 3, 3, 0], [2, 2, 2, 2], [-1, -5, -5, -1]], dtype=torch.int32)
    check_lowering(lambda t: (t.argmax(1), t.argmin(1), t.argmax(0), t.argmin()), x)


def test_reductions_propagate_nan(check_lowering: Any) -> None:
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    check_lowering(lambda t: (t.amax(1), t.amin(0), t.sum(1), t.max(1)), x, reduction=True)


def test_sum_of_a_wide_fp16_row_accumulates_in_fp32(check_lowering: Any) -> None:
    """4096 fp16 values summed in fp16 would lose about two digits; eager sums in fp32."""
    x = (torch.rand(2, 4096) + 1).half()
    check_lowering(lambda t: (t.sum(1), t.mean(1)), x, reduction=True)
