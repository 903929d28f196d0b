"""Inference graphs called with no AOTAutograd runtime wrapper (``inference_direct``):
where AOTAutograd's runtime would only call the one inference graph with grad off, Kiln
hands Dynamo the compiled graph itself (behind ``aot_cache.served_graph``). Everything
else keeps AOTAutograd's runtime, and the program sees what eager gives: outputs that
alias an input are views of it (made by the direct call too), mutated inputs are mutated
(version counters too),
training graphs differentiate, autocast graphs are not cast twice, nested return values
keep their types."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kiln.frontend.core.client import process_counters
from kiln.frontend.core.fallback import KilnFallbackWarning


@pytest.fixture(autouse=True)
def _isolated(kiln_isolated: None) -> None:
    return None


def _compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    torch._dynamo.reset()
    return torch.compile(fn, backend="kiln", dynamic=False)


def _no_fallback() -> Any:
    caught = warnings.catch_warnings()
    caught.__enter__()
    warnings.simplefilter("error", KilnFallbackWarning)
    return caught


def _direct() -> int:
    return int(process_counters().get("inference_direct", 0))


def _nested(x: torch.Tensor, w: torch.Tensor) -> dict[str, Any]:
    h = (x @ w).relu()
    return {"sum": h.sum(-1), "pair": [h * 2, (x + 1).exp()], "max": h.amax(0)}


def _check_same(got: Any, want: Any) -> None:
    assert type(got) is type(want)
    if isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            _check_same(got[k], want[k])
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            _check_same(a, b)
    else:
        assert got.requires_grad == want.requires_grad and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad_on"])
def test_inference_graph_is_called_directly(grad: bool) -> None:
    """Under no_grad, and with grad on but no input requiring it (AOTAutograd still makes
    an inference graph): one direct graph, eager's nested outputs on fresh inputs."""
    fn = _compiled(_nested)
    caught = _no_fallback()
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            x, w = torch.randn(8, 16), torch.randn(16, 32)
            _check_same(fn(x, w), _nested(x, w))
    caught.__exit__(None, None, None)
    assert _direct() == 1


def test_outputs_aliasing_inputs_are_views_called_directly() -> None:
    """Outputs aliasing an input are made views of it again, as AOTAutograd's runtime
    makes them, by the direct call (``served_graph``'s aliases)."""
    def alias(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.view(-1), x[1], x * y

    fn = _compiled(alias)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    with torch.no_grad():
        flat, row, prod = fn(x, y)
    assert _direct() == 1
    assert flat._base is x and row._base is x  # views of the caller's tensor, as eager
    x.mul_(2)  # seen through the views
    torch.testing.assert_close(flat, x.view(-1))
    torch.testing.assert_close(row, x[1])
    torch.testing.assert_close(prod, x / 2 * y)


def test_mutated_inputs_keep_aots_runtime() -> None:
    def bump(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x.add_(y)
        return (x * y).sum(0)

    fn = _compiled(bump)
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    ex = x.clone()
    with torch.no_grad():
        got = fn(x, y)
        want = bump(ex, y)
    assert _direct() == 0
    torch.testing.assert_close(x, ex)  # the caller's tensor was written
    assert x._version == ex._version  # and autograd would know it
    torch.testing.assert_close(got, want)


def test_training_graph_keeps_aots_runtime() -> None:
    w = torch.randn(16, 8, requires_grad=True)
    ref = w.detach().clone().requires_grad_(True)
    fn = _compiled(lambda x, w: (x @ w).tanh().square().mean())
    x = torch.randn(4, 16)
    caught = _no_fallback()
    loss = fn(x, w)
    caught.__exit__(None, None, None)
    loss.backward()
    (x @ ref).tanh().square().mean().backward()
    assert _direct() == 0 and loss.requires_grad
    torch.testing.assert_close(w.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_autocast_graph_called_directly_is_cast_once() -> None:
    """The graph is already cast: the direct call runs it with autocast off, as
    AOTAutograd's runtime does. Else the matmul the program kept in fp32 (autocast
    disabled around it) would be cast to bf16 by the running autocast."""
    def mm(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", enabled=False):
            full = (x @ w).relu() + 1
        return full, x @ w

    fn = _compiled(mm)
    x, w = torch.randn(8, 16), torch.randn(16, 32)
    caught = _no_fallback()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        (full, half), (want_full, want_half) = fn(x, w), mm(x, w)
    caught.__exit__(None, None, None)
    assert _direct() == 1
    assert full.dtype == want_full.dtype == torch.float32
    assert half.dtype == want_half.dtype == torch.bfloat16
    torch.testing.assert_close(full, want_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(half, want_half, rtol=1.6e-2, atol=1e-2)


def test_inference_direct_off_keeps_aots_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_INFERENCE_DIRECT", "0")
    fn = _compiled(_nested)
    x, w = torch.randn(8, 16), torch.randn(16, 32)
    with torch.no_grad():
        _check_same(fn(x, w), _nested(x, w))
    assert _direct() == 0


def _two_outputs(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = (x @ w).relu()
    return h.sum(-1) * 2, h + x.mean()


def _dynamic_calls(options: dict[str, Any]) -> list[tuple[torch.Tensor, ...]]:
    torch._dynamo.reset()
    fn = torch.compile(_two_outputs, backend="kiln", dynamic=True, options=options)
    caught = _no_fallback()
    outs = []
    with torch.no_grad():
        for n, m in ((8, 24), (13, 24), (32, 7), (5, 40)):
            x, w = torch.randn(n, 16), torch.randn(16, m)
            got = fn(x, w)
            _check_same(got, _two_outputs(x, w))
            outs.append(got)
    caught.__exit__(None, None, None)
    return outs


def test_graph_with_symbolic_sizes_is_called_directly() -> None:
    """``dynamic=True``: SymInt inputs and tensors with symbolic sizes, one graph for every
    size, called with no AOT runtime wrapper; each output carries the dimensions that are
    dynamic for Dynamo exactly as AOTAutograd's runtime marks them (a later compiled frame
    that takes it treats them as dynamic)."""
    outs = _dynamic_calls({})
    counters = process_counters()
    assert _direct() == 1 and counters.get("compiles") == 1, counters
    marks = [[getattr(t, "_dynamo_propagated_dynamic_indices", None) for t in out]
             for out in outs]
    assert marks == [[{0}, {0, 1}]] * 4, marks
    aot = _dynamic_calls({"inference_direct": False})
    assert _direct() == 1  # (no second direct graph)
    assert [[getattr(t, "_dynamo_propagated_dynamic_indices", None) for t in out]
            for out in aot] == marks
