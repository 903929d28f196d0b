"""2-d pooling's Triton kernels (window taps as masked loads) run under Triton's
interpreter against eager: max_pool2d values and indices over every window parameter,
its backward, and avg_pool2d."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.pooling_cases import (
    AVG_POOL_PARAMS,
    FLOATS,
    MAX_POOL_CASES,
    avg_pool_backward_fn,
    avg_pool_fn,
    case_id,
    expand_cases,
)
from tests.triton_interp.helpers import compile_fn, run_compiled

CASES = expand_cases()


@pytest.fixture(autouse=True)
def _seeded() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize("item", CASES, ids=[case_id(c) for c in CASES])
def test_triton_max_pool_matches_eager(item: Any) -> None:
    case, dtype = item
    args = case.inputs(dtype)
    compiled = compile_fn(case.fn, args)
    assert len(compiled.kernels) == 1, [k.name for k in compiled.kernels]
    assert "max_pool2d" not in compiled.wrapper_source
    assert "th.maximum(" in compiled.kernels[0].source
    values, indices = run_compiled(compiled, args)
    ref_values, ref_indices = case.fn(*args)
    torch.testing.assert_close(values, ref_values, rtol=0, atol=0, equal_nan=True)
    assert values.stride() == ref_values.stride()
    assert torch.equal(indices, ref_indices)


def test_triton_values_only_kernel_has_no_index_math() -> None:
    """Inference reads no indices: the kernel stores one output, computes no int64."""
    x = torch.randn(2, 4, 12, 12)
    compiled = compile_fn(lambda x: F.max_pool2d(x, 3, 2, 1), [x])
    (kernel,) = compiled.kernels
    assert kernel.source.count("tl.store(") == 1
    assert "torch.int64" not in compiled.wrapper_source
    torch.testing.assert_close(run_compiled(compiled, [x])[0], F.max_pool2d(x, 3, 2, 1))


BACKWARD = [c for c in MAX_POOL_CASES if c.name in (
    "resnet_stem", "resnet_stem_channels_last", "dilation", "ceil_mode_padded", "rectangular",
    "ties")]


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("case", BACKWARD, ids=lambda c: c.name)
def test_triton_max_pool_backward_matches_eager(case: Any, dtype: torch.dtype) -> None:
    x = case.inputs(dtype)[0]
    k = case.kwargs["kernel_size"]
    stride, padding = case.kwargs.get("stride", ()), case.kwargs.get("padding", 0)
    dilation, ceil = case.kwargs.get("dilation", 1), case.kwargs.get("ceil_mode", False)
    _, idx = torch.ops.aten.max_pool2d_with_indices(x, k, stride, padding, dilation, ceil)
    grad = torch.randn(idx.shape).to(dtype)

    def fn(grad: torch.Tensor, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.max_pool2d_with_indices_backward(
            grad, x, k, stride, padding, dilation, ceil, idx)

    compiled = compile_fn(fn, [grad, x, idx])
    assert "max_pool2d_with_indices_backward" not in compiled.wrapper_source
    assert len(compiled.kernels) == 1
    out = run_compiled(compiled, [grad, x, idx])[0]
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out, fn(grad, x, idx), rtol=tol, atol=tol)
    assert out.stride() == fn(grad, x, idx).stride()


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", list(AVG_POOL_PARAMS))
def test_triton_avg_pool_matches_eager(name: str, dtype: torch.dtype) -> None:
    x = torch.randn(2, 3, 9, 10).to(dtype).contiguous(memory_format=torch.channels_last)
    fn = avg_pool_fn(name)
    compiled = compile_fn(fn, [x])
    assert "avg_pool2d" not in compiled.wrapper_source and len(compiled.kernels) == 1
    out = run_compiled(compiled, [x])[0]
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, fn(x), rtol=tol, atol=tol)
    assert out.stride() == fn(x).stride()


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", list(AVG_POOL_PARAMS))
def test_triton_avg_pool_backward_matches_eager(name: str, dtype: torch.dtype) -> None:
    x = torch.randn(2, 3, 9, 10).to(dtype)
    grad = torch.randn(avg_pool_fn(name)(x).shape).to(dtype)
    fn = avg_pool_backward_fn(name)
    compiled = compile_fn(fn, [grad, x])
    assert "avg_pool2d_backward" not in compiled.wrapper_source and len(compiled.kernels) == 1
    out = run_compiled(compiled, [grad, x])[0]
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, fn(grad, x), rtol=tol, atol=tol)
