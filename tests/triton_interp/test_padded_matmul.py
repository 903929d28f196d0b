"""A padded matmul returned as an inference graph's output (GPT-2's lm_head at a small
stand-in shape): values equal eager's, and the output is a view of the padded product
(rows of an aligned width), with no copy kernel. Padding is a GPU decision; here it is
forced on CPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.lowering import extern_ops
from tests.triton_interp.helpers import OPTIONS, assert_close_to_eager, run_compiled

TOL = {torch.float16: {"atol": 1e-2, "rtol": 1e-2}, torch.float32: {"atol": 1e-4, "rtol": 1e-4}}


def _always_pad(a: Any, b: Any) -> int:
    width = int(b.get_size()[-1])
    multiple = 16 // b.get_dtype().itemsize
    return 1 if width % multiple == 0 else multiple


def _lm_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a @ b


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("fn", "shapes", "strides"), [
    (_lm_head, [(2, 24, 64), (1001, 64)], lambda row: (24 * row, row, 1)),
    (_matmul, [(40, 64), (64, 1001)], lambda row: (row, 1)),
])
def test_padded_matmul_output_matches_eager_without_a_copy(
        monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, fn: Callable[..., Any],
        shapes: list[tuple[int, ...]], strides: Callable[[int], tuple[int, ...]]) -> None:
    monkeypatch.setattr(extern_ops, "_row_padding", _always_pad)
    args = [torch.randn(s, dtype=dtype) for s in shapes]
    compiled = compile_graph(trace_aten(fn, args), args, {**OPTIONS, "padded_outputs": True})
    assert [k.name for k in compiled.kernels] == ["triton_poi_fused_ge_logical_and_lt_0"]
    (out,) = run_compiled(compiled, args)
    ref = fn(*args)
    row = -(-1001 // (16 // dtype.itemsize)) * (16 // dtype.itemsize)
    assert out.shape == ref.shape and out.stride() == strides(row)
    assert_close_to_eager(out, ref, lambda: fn(*[a.double() for a in args]), TOL[dtype])
