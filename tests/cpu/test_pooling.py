"""2-d pooling lowered as window loops (compiler/lowering/pooling.py), against eager on
CPU through the IR interpreter and through C++ kernels: max_pool2d values and indices,
its backward, avg_pool2d; the producer inlined into the window; windows too large to
unroll run ATen's kernel."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kiln.compiler.compiled_graph import load
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph, lower_and_schedule
from kiln.compiler.ir.extern import FallbackKernel
from tests.pooling_cases import (
    AVG_POOL_PARAMS,
    FLOATS,
    MAX_POOL_CASES,
    avg_pool_backward_fn,
    avg_pool_fn,
    case_id,
    expand_cases,
)

CASES = expand_cases()


def _assert_pool_matches(out: Any, ref: Any, dtype: torch.dtype) -> None:
    values, indices = out
    ref_values, ref_indices = ref
    torch.testing.assert_close(values, ref_values, rtol=0, atol=0, equal_nan=True)
    assert values.stride() == ref_values.stride(), (values.stride(), ref_values.stride())
    assert torch.equal(indices, ref_indices), (indices != ref_indices).nonzero()[:5]


@pytest.mark.parametrize("item", CASES, ids=[case_id(c) for c in CASES])
def test_max_pool_interpreter_matches_eager(item: Any, check_lowering: Any) -> None:
    case, dtype = item
    args = case.inputs(dtype)
    sg = check_lowering(case.fn, *args)
    assert sg.scheduler.kernel_count() == 1, sg.scheduler.debug_str()


@pytest.mark.parametrize("item", CASES, ids=[case_id(c) for c in CASES])
def test_max_pool_cpp_matches_eager(item: Any) -> None:
    case, dtype = item
    args = case.inputs(dtype)
    compiled = compile_graph(trace_aten(case.fn, args), args, {}, name=case.name)
    assert not [b for b in compiled.kernels if "max_pool" in b.name]
    assert "max_pool2d" not in compiled.wrapper_source
    _assert_pool_matches(load(compiled)([a.clone() for a in args]), case.fn(*args), dtype)


def test_inference_computes_no_indices() -> None:
    """Values only: one kernel, one buffer, no int64 anywhere."""
    x = torch.randn(2, 4, 12, 12)
    fn = lambda x: F.max_pool2d(x.relu() * 2, 3, 2, 1)  # noqa: E731
    compiled = compile_graph(trace_aten(fn, [x]), [x], {})
    assert len(compiled.kernels) == 1
    assert "1 kernel(s), 1 buffer(s)" in compiled.wrapper_source.splitlines()[0]
    assert "torch.int64" not in compiled.wrapper_source
    assert "kiln_maximum" in compiled.kernels[0].source
    torch.testing.assert_close(load(compiled)([x.clone()])[0], fn(x))


def test_batch_norm_relu_producer_is_inlined() -> None:
    """The stem's batch norm and relu run inside the pooling kernel: one kernel, no
    buffer of the unpooled size."""
    x, mean, var, w, b = torch.randn(2, 8, 16, 16), torch.randn(8), torch.rand(8) + 0.5, \
        torch.randn(8), torch.randn(8)

    def fn(x: torch.Tensor, *p: torch.Tensor) -> torch.Tensor:
        y = F.batch_norm(x, p[0], p[1], p[2], p[3], False, 0.1, 1e-5).relu()
        return F.max_pool2d(y, 3, 2, 1)

    args = [x, mean, var, w, b]
    sg = lower_and_schedule(trace_aten(fn, args), args)
    assert sg.scheduler.kernel_count() == 1, sg.scheduler.debug_str()
    assert [list(buf.get_size()) for buf in sg.graph.buffers] == [[2, 8, 8, 8]]
    compiled = compile_graph(trace_aten(fn, args), args, {})
    torch.testing.assert_close(load(compiled)([a.clone() for a in args])[0], fn(*args),
                               rtol=1e-5, atol=1e-5)


def test_expensive_producer_is_realized_first() -> None:
    """A producer reading many buffers is computed once, not once per tap."""
    xs = [torch.randn(2, 3, 10, 10) for _ in range(8)]

    def fn(*xs: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(sum(xs[1:], xs[0]), 3, 2, 1)  # type: ignore[arg-type]

    sg = lower_and_schedule(trace_aten(fn, xs), xs)
    assert [list(buf.get_size()) for buf in sg.graph.buffers] == [[2, 3, 10, 10],
                                                                 [2, 3, 5, 5]]
    compiled = compile_graph(trace_aten(fn, xs), xs, {})
    torch.testing.assert_close(load(compiled)([a.clone() for a in xs])[0], fn(*xs))


def test_large_window_falls_back_with_reason(caplog: pytest.LogCaptureFixture) -> None:
    x = torch.randn(1, 2, 12, 12)
    fn = lambda x: F.max_pool2d(x, 7, 1, 3)  # noqa: E731
    with caplog.at_level(logging.DEBUG, logger="kiln.graph"):  # the graph's fallback
        sg = lower_and_schedule(trace_aten(fn, [x]), [x])
    fallbacks = [b for b in sg.graph.buffers if isinstance(b, FallbackKernel)]
    assert [str(b.op_overload) for b in fallbacks] == ["aten.max_pool2d_with_indices.default"]
    assert "7x7 window has more than 25 taps" in caplog.text
    assert any("more than 25 taps" in r for r in sg.graph.fallback_reasons.values())
    compiled = compile_graph(trace_aten(fn, [x]), [x], {})
    torch.testing.assert_close(load(compiled)([x.clone()])[0], fn(x))


ARGUMENT_FORMS = {
    "empty_stride_is_kernel": lambda x: torch.ops.aten.max_pool2d_with_indices(x, [2, 2], []),
    "one_value_for_both": lambda x: torch.ops.aten.max_pool2d_with_indices(x, [3], [2], [1]),
    "avg_empty_stride": lambda x: torch.ops.aten.avg_pool2d(x, [2, 2], []),
}


@pytest.mark.parametrize("name", list(ARGUMENT_FORMS))
def test_argument_forms_as_aten_takes_them(name: str, check_lowering: Any) -> None:
    check_lowering(ARGUMENT_FORMS[name], torch.randn(2, 3, 8, 8))


def test_dynamic_batch_recompiles_once_and_matches_eager() -> None:
    """A new batch size makes Dynamo mark the batch symbolic: the window lowering passes
    it through (height and width stay static), no graph falls back to eager."""
    import warnings

    from kiln.frontend.core.fallback import KilnFallbackWarning

    torch._dynamo.reset()
    fn = lambda x: F.max_pool2d(x.relu(), 3, 2, 1) + 1  # noqa: E731
    compiled = torch.compile(fn, backend="kiln")
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        for n in (2, 3, 5):
            x = torch.randn(n, 4, 10, 10)
            torch.testing.assert_close(compiled(x), fn(x))


# -- the backward ---------------------------------------------------------------------

BACKWARD_CASES = [c for c in MAX_POOL_CASES if c.name in (
    "resnet_stem", "resnet_stem_channels_last", "k2_s2", "dilation", "ceil_mode_padded",
    "rectangular", "ties", "three_d_input")]


def _backward_fn(case: Any) -> Callable[..., torch.Tensor]:
    def fn(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        kw = dict(case.kwargs)
        k = kw.pop("kernel_size")
        stride, padding = kw.pop("stride", ()), kw.pop("padding", 0)
        dilation, ceil = kw.pop("dilation", 1), kw.pop("ceil_mode", False)
        _, idx = torch.ops.aten.max_pool2d_with_indices(x, k, stride, padding, dilation, ceil)
        return torch.ops.aten.max_pool2d_with_indices_backward(
            grad, x, k, stride, padding, dilation, ceil, idx)

    return fn


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("case", BACKWARD_CASES, ids=lambda c: c.name)
def test_max_pool_backward_matches_eager(case: Any, dtype: torch.dtype,
                                         check_lowering: Any) -> None:
    x = case.inputs(dtype)[0]
    out_shape = case.fn(x)[0].shape
    grad = torch.randn(out_shape).to(dtype)
    fn = _backward_fn(case)
    sg = check_lowering(fn, grad, x)
    assert sg.scheduler.kernel_count() <= 2, sg.scheduler.debug_str()
    compiled = compile_graph(trace_aten(fn, [grad, x]), [grad, x], {})
    out = load(compiled)([grad.clone(), x.clone()])[0]
    torch.testing.assert_close(out, fn(grad, x), rtol=1e-2, atol=1e-2)


def test_max_pool_training_step_matches_eager() -> None:
    """Forward and backward through AOTAutograd's joint graph: every gradient matches."""
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    x = torch.randn(2, 3, 12, 12, requires_grad=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return F.max_pool2d(conv(x).relu(), 3, 2, 1).square().sum()

    compiled = torch.compile(fn, backend="kiln")
    import warnings

    from kiln.frontend.core.fallback import KilnFallbackWarning

    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        loss = compiled(x)
        loss.backward()
    got = [x.grad.clone(), conv.weight.grad.clone()]  # type: ignore[union-attr]
    x.grad, conv.weight.grad = None, None
    ref = fn(x)
    ref.backward()
    torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, [x.grad, conv.weight.grad], rtol=1e-4, atol=1e-4)


# -- avg_pool2d -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", list(AVG_POOL_PARAMS))
@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "nhwc"])
def test_avg_pool_matches_eager(name: str, dtype: torch.dtype, channels_last: bool,
                                check_lowering: Any) -> None:
    x = torch.randn(2, 3, 9, 10).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    fn = avg_pool_fn(name)
    check_lowering(fn, x)
    compiled = compile_graph(trace_aten(fn, [x]), [x], {})
    assert "avg_pool2d" not in compiled.wrapper_source
    out = load(compiled)([x.clone()])[0]
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, fn(x), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
@pytest.mark.parametrize("name", list(AVG_POOL_PARAMS))
def test_avg_pool_backward_matches_eager(name: str, dtype: torch.dtype,
                                         check_lowering: Any) -> None:
    x = torch.randn(2, 3, 9, 10).to(dtype)
    grad = torch.randn(avg_pool_fn(name)(x).shape).to(dtype)
    fn = avg_pool_backward_fn(name)
    check_lowering(fn, grad, x)
    compiled = compile_graph(trace_aten(fn, [grad, x]), [grad, x], {})
    assert "avg_pool2d_backward" not in compiled.wrapper_source
    out = load(compiled)([grad.clone(), x.clone()])[0]
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(out, fn(grad, x), rtol=tol, atol=tol)


# -- ResNet-18 --------------------------------------------------------------------------

def _resnet18_standin() -> torch.nn.Module:
    """bench/coldstart_models.py's ResNet-18 stand-in (torchvision's layout), narrow."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from coldstart_models import resnet18_standin

    return resnet18_standin(8, 10)


def test_resnet18_inference_matches_eager() -> None:
    """The stem's max pool is lowered (no ATen pooling call in any wrapper), the graph
    does not fall back, and the logits equal eager's."""
    from tests.models import compile_checked

    torch._dynamo.reset()
    model = _resnet18_standin().eval()
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        compile_checked(model, x)


def test_resnet18_training_step_matches_eager() -> None:
    """Forward and backward (the max pool's backward lowered too): loss and every
    gradient equal eager's."""
    from tests.models import assert_training_step_matches

    model = _resnet18_standin().train()
    # Weight gradients reach 100 here and sum thousands of products in another order
    # than eager's: absolute differences of 1e-2 are 1e-4 of their scale.
    assert_training_step_matches(model, torch.randn(2, 3, 32, 32),
                                 {"rtol": 1e-3, "atol": 3e-2})
