"""Shared helpers for the lowering tests: compile through Kiln's front half, evaluate with
the IR interpreter, and compare with eager under dtype-aware tolerances.

Test modules reach the helpers through fixtures (``check_lowering``, ``assert_same``,
``draw``), since two ``conftest`` modules cannot both be imported by name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import ScheduledGraph, lower_and_schedule
from kiln.compiler.interpreter import run_graph

# (rtol, atol) per dtype for pointwise chains. The interpreter, like the code generators,
# computes reduced-precision values in fp32 and rounds once; eager rounds after every op.
_POINTWISE_TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}
# Reductions sum in another order (and in fp32 for reduced dtypes): a bit looser.
_REDUCTION_TOL: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.float16: (4e-3, 4e-3),
    torch.bfloat16: (3e-2, 3e-2),
}


def tolerance(dtype: torch.dtype, reduction: bool = False) -> tuple[float, float]:
    """(rtol, atol) for comparing ``dtype`` results; exact for integer and bool."""
    table = _REDUCTION_TOL if reduction else _POINTWISE_TOL
    return table.get(dtype, (0.0, 0.0))


def is_dense(t: torch.Tensor) -> bool:
    """Non-overlapping and dense: strides are a permutation of contiguous strides."""
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _strides(t: torch.Tensor) -> list[int]:
    """Strides of the dimensions with more than one element (the others mean nothing)."""
    return [s for s, n in zip(t.stride(), t.shape) if n > 1]


def flatten(value: Any) -> list[Any]:
    if isinstance(value, (list, tuple)):
        return [v for item in value for v in flatten(item)]
    return [value]


def compile_graph(fn: Callable[..., Any], args: Sequence[Any], functionalize: bool = True
                  ) -> ScheduledGraph:
    """Trace ``fn`` to a functional ATen graph (as AOTAutograd would), lower and schedule."""
    gm = trace_aten(fn, args, functionalize=functionalize)
    return lower_and_schedule(gm, args, name=getattr(fn, "__name__", "graph"))


def output_metas(sg: ScheduledGraph) -> list[Any]:
    """The fake tensors the traced graph records for its outputs (AOTAutograd's promise)."""
    out = next(n for n in sg.graph.module.graph.nodes if n.op == "output")
    return [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in flatten(out.args)]


def assert_same(actual: Sequence[Any], expected: Sequence[Any], reduction: bool = False,
                check_stride: bool = True, labels: Sequence[str] | None = None,
                metas: Sequence[Any] | None = None) -> None:
    """Compare outputs one by one: values, dtypes, sizes and (where dense) strides.

    Strides must be eager's; where the graph's own metadata (a fake tensor from ATen's meta
    function) disagrees with eager, the compiler cannot know better and must match that.
    """
    assert len(actual) == len(expected), f"{len(actual)} outputs, eager has {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        where = f"output {i}" + (f" ({labels[i]})" if labels else "")
        if not isinstance(e, torch.Tensor):
            assert a == e, f"{where}: {a!r} != {e!r}"
            continue
        assert isinstance(a, torch.Tensor), f"{where} is a {type(a).__name__}"
        assert a.dtype == e.dtype, f"{where}: dtype {a.dtype}, eager {e.dtype}"
        assert a.shape == e.shape, f"{where}: size {tuple(a.shape)}, eager {tuple(e.shape)}"
        if check_stride and is_dense(e):
            meta = metas[i] if metas is not None else None
            want = _strides(meta) if isinstance(meta, torch.Tensor) else _strides(e)
            assert _strides(a) == want, f"{where}: stride {a.stride()}, eager {e.stride()}" + (
                f", graph meta {meta.stride()}" if isinstance(meta, torch.Tensor) else "")
        rtol, atol = tolerance(e.dtype, reduction)
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m, where=where: f"{where}: {m}")


def fallback_ops(sg: ScheduledGraph) -> list[str]:
    """The ops of the graph that run eagerly (FallbackKernels), as ``aten.flip.default``."""
    from kiln.compiler.ir.extern import FallbackKernel

    return [str(b.op_overload) for b in sg.graph.buffers if isinstance(b, FallbackKernel)]


def check_lowering(fn: Callable[..., Any], *args: Any, reduction: bool = False,
                   check_stride: bool = True, labels: Sequence[str] | None = None,
                   allow_fallback: Sequence[str] = ()) -> ScheduledGraph:
    """Compile ``fn``, run it with the IR interpreter, and assert it matches eager.

    Every op must be lowered: a FallbackKernel (an op run eagerly) fails the check unless
    its op is named in ``allow_fallback`` (``"aten.bernoulli"``, prefixes match).
    """
    # AOTAutograd hands Kiln flat output lists: flatten (values, indices) pairs the same way.
    sg = compile_graph(lambda *a: flatten(fn(*a)), args)
    eager_ops = [op for op in fallback_ops(sg)
                 if not any(op.startswith(allowed) for allowed in allow_fallback)]
    assert not eager_ops, f"not lowered, run eagerly instead: {eager_ops} " \
        f"({sg.graph.fallback_reasons})"
    expected = flatten(fn(*args))
    actual = run_graph(sg.graph, [a for a in args if isinstance(a, torch.Tensor)])
    assert_same(actual, expected, reduction, check_stride, labels, output_metas(sg))
    return sg


# -- random inputs --------------------------------------------------------------------

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int32, torch.int64)


def draw(shape: Sequence[int], dtype: torch.dtype, domain: str = "real") -> torch.Tensor:
    """Fresh random values of ``dtype`` in ``domain``; never an all-zero tensor.

    Domains: ``real`` (normal / ints in [-9, 9]), ``positive`` (log, sqrt, pow bases),
    ``nonzero`` (divisors: magnitude at least 0.5, or 1 for ints), ``unit`` (inside
    (-0.9, 0.9): asin, atanh, erfinv), ``above_one`` (acosh), ``small`` (exponents, shifts:
    [-2, 2] or ints in [0, 3]).
    """
    shape = tuple(shape)
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_floating_point:
        return _draw_float(shape, domain).to(dtype)
    lo = 0 if dtype == torch.uint8 else -9
    if domain == "positive":
        return torch.randint(1, 10, shape, dtype=dtype)
    if domain == "nonzero":
        magnitude = torch.randint(1, 10, shape)
        if lo < 0:
            magnitude = magnitude * (torch.randint(0, 2, shape) * 2 - 1)
        return magnitude.to(dtype)
    if domain == "small":
        return torch.randint(0, 4, shape, dtype=dtype)
    return torch.randint(lo, 10, shape, dtype=dtype)


def _draw_float(shape: tuple[int, ...], domain: str) -> torch.Tensor:
    u = torch.rand(shape)
    if domain == "positive":
        return u * 3 + 0.25
    if domain == "nonzero":
        return (u + 0.5) * torch.where(torch.rand(shape) > 0.5, 1.0, -1.0)
    if domain == "unit":
        return u * 1.8 - 0.9
    if domain == "above_one":
        return u * 3 + 1.1
    if domain == "small":
        return u * 4 - 2
    return torch.randn(shape)


@pytest.fixture(name="check_lowering")
def check_lowering_fixture() -> Callable[..., ScheduledGraph]:
    """``check_lowering(fn, *args, reduction=False, check_stride=True, labels=None,
    allow_fallback=())``."""
    return check_lowering


@pytest.fixture(name="assert_same")
def assert_same_fixture() -> Callable[..., None]:
    """``assert_same(actual, expected, reduction=False, check_stride=True, labels=None)``."""
    return assert_same


@pytest.fixture(name="compile_graph")
def compile_graph_fixture() -> Callable[..., ScheduledGraph]:
    """``compile_graph(fn, args, functionalize=True)`` -> ScheduledGraph."""
    return compile_graph


@pytest.fixture(name="draw")
def draw_fixture() -> Callable[..., torch.Tensor]:
    """``draw(shape, dtype, domain="real")``: fresh random inputs (see ``draw``)."""
    return draw


@pytest.fixture(autouse=True)
def _seeded() -> None:
    """Every test draws fresh random inputs, reproducibly."""
    torch.manual_seed(0)
