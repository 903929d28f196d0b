"""Compile a function with Kiln's Triton backend (run under the interpreter) and compare."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.compiler.compiled_graph import CompiledGraph, load
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph

OPTIONS = {"cpu_backend": "triton-interpret"}


def compile_fn(fn: Callable[..., Any], args: Sequence[torch.Tensor]) -> CompiledGraph:
    gm = trace_aten(fn, list(args))
    return compile_graph(gm, list(args), OPTIONS, name=getattr(fn, "__name__", "fn"))


def run_compiled(compiled: CompiledGraph, args: Sequence[torch.Tensor]) -> tuple[Any, ...]:
    return load(compiled)([a.clone() for a in args])


def assert_matches_eager(fn: Callable[..., Any], args: Sequence[torch.Tensor],
                         tol: dict[str, float]) -> CompiledGraph:
    """Kiln's outputs equal eager's, values and (for dense outputs) strides too."""
    compiled = compile_fn(fn, args)
    outs = run_compiled(compiled, args)
    ref = fn(*args)
    refs = ref if isinstance(ref, tuple) else (ref,)
    assert len(outs) == len(refs)
    for i, (out, r) in enumerate(zip(outs, refs)):
        assert_close_to_eager(out, r, lambda i=i: _fp64_reference(fn, args, i), tol)
        assert out.shape == r.shape
        if r.is_contiguous() or r.dim() <= 1:
            assert out.stride() == r.stride(), (out.stride(), r.stride())
    return compiled


def _fp64_reference(fn: Callable[..., Any], args: Sequence[torch.Tensor], i: int) -> Any:
    wide = [a.double() if a.is_floating_point() else a for a in args]
    ref = fn(*wide)
    return (ref if isinstance(ref, tuple) else (ref,))[i]


def assert_close_to_eager(out: torch.Tensor, ref: torch.Tensor, fp64_ref: Callable[[], Any],
                          tol: dict[str, float]) -> None:
    """Close to eager; for fp16/bf16, alternatively no further from the fp64 truth than
    eager is (both round differently: fused kernels round once, eager once per op)."""
    try:
        torch.testing.assert_close(out, ref, **tol, equal_nan=True)
    except AssertionError:
        if ref.dtype not in (torch.float16, torch.bfloat16):
            raise
        truth = fp64_ref()
        kiln_err = (out.double() - truth).abs()
        eager_err = (ref.double() - truth).abs()
        bound = 2 * eager_err + tol["atol"] + tol["rtol"] * truth.abs()
        assert bool((kiln_err <= bound).all()), f"max excess {(kiln_err - bound).max()}"
