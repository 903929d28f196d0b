"""A view the wrapper hands a library call and also returns (a forward's saved tensor: a
transposed weight, a flattened activation) is made once per call: named where the call
takes it, returned by that name. Gradients match eager."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kiln import KilnFallbackWarning
from kiln.compiler.compiled_graph import CompiledGraph


@pytest.fixture(autouse=True)
def _isolated(kiln_isolated: None) -> None:
    """Every test compiles in this process against a fresh store."""


@pytest.fixture
def compiled_graphs() -> Iterator[dict[str, CompiledGraph]]:
    """The graphs Kiln compiles during the test, by name (``forward_0``, ...)."""
    from kiln.frontend.core import compile as kiln_compile

    seen: dict[str, CompiledGraph] = {}

    def observe(name: str, result: Any) -> None:
        seen[name] = result.compiled

    kiln_compile.observers.append(observe)
    yield seen
    kiln_compile.observers.remove(observe)


def _views(source: str) -> list[str]:
    return re.findall(r"reinterpret_tensor\([^()]*(?:\([^()]*\)[^()]*)*\)", source)


def test_saved_views_are_made_once_and_gradients_match_eager(
        compiled_graphs: dict[str, CompiledGraph]) -> None:
    torch.manual_seed(0)
    w1, w2 = torch.randn(32, 16, requires_grad=True), torch.randn(8, 32, requires_grad=True)
    b1 = torch.randn(32, requires_grad=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.linear(x.flatten(0, 1), w1, b1))
        loss = F.linear(h, w2).square().mean()
        loss.backward()
        return loss

    compiled = torch.compile(step, backend="kiln", dynamic=False)
    for _ in range(2):  # a second call: the names are made afresh each call
        x = torch.randn(4, 6, 16)
        for p in (w1, w2, b1):
            p.grad = None
        with warnings.catch_warnings():
            warnings.simplefilter("error", KilnFallbackWarning)
            loss = compiled(x)
        grads = [p.grad.clone() for p in (w1, w2, b1)]  # type: ignore[union-attr]
        for p in (w1, w2, b1):
            p.grad = None
        torch.testing.assert_close(loss, step(x))
        for got, p in zip(grads, (w1, w2, b1)):
            torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-5)
    forward = [g for name, g in compiled_graphs.items() if name.startswith("forward")]
    assert len(forward) == 1, list(compiled_graphs)
    source = forward[0].wrapper_source
    views = _views(source)
    assert views and len(views) == len(set(views)), source  # each view made once
    returned = source[source.rindex("return ("):]
    named = re.findall(r"\((view\d+) := reinterpret_tensor\(", source)
    assert named and all(name in returned for name in named), source


def test_buffer_used_only_through_a_view_is_allocated_as_it(
        compiled_graphs: dict[str, CompiledGraph]) -> None:
    """A 3-D activation that the next linear (and the backward) only ever takes flattened
    is allocated flat: no view of it made per call; gradients still match eager."""
    torch.manual_seed(0)
    w1, w2 = torch.randn(32, 16, requires_grad=True), torch.randn(8, 32, requires_grad=True)
    b1 = torch.randn(32, requires_grad=True)
    params = (w1, w2, b1)

    def step(x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.linear(x, w1, b1))  # (4, 6, 32): a kernel's output
        loss = F.linear(h, w2).square().mean()  # h taken as (24, 32)
        loss.backward()
        return loss

    compiled = torch.compile(step, backend="kiln", dynamic=False)
    for _ in range(2):
        x = torch.randn(4, 6, 16)
        with warnings.catch_warnings():
            warnings.simplefilter("error", KilnFallbackWarning)
            loss = compiled(x)
        grads = [p.grad.clone() for p in params]  # type: ignore[union-attr]
        for p in params:
            p.grad = None
        torch.testing.assert_close(loss, step(x))
        for got, p in zip(grads, params):
            torch.testing.assert_close(got, p.grad, rtol=1e-4, atol=1e-5)
            p.grad = None
    (forward,) = [g for name, g in compiled_graphs.items() if name.startswith("forward")]
    source = forward.wrapper_source
    flat = re.findall(r"(buf\d+) = empty_strided\(\(24, 32\), \(32, 1\), .*# as its one view",
                      source)
    assert len(flat) == 1, source
    (name,) = flat
    assert f"reinterpret_tensor({name}," not in source, source
    assert re.search(rf"torch\.mm\({name}, ", source), source
    assert name in source[source.rindex("return ("):], source  # saved for the backward


def test_views_of_inputs_that_start_inside_their_storage(
        compiled_graphs: dict[str, CompiledGraph]) -> None:
    """``k`` and ``v`` sliced out of one ``qkv`` buffer start 16 and 32 elements into its
    storage. A transposed view of one handed to a library call is made by
    ``reinterpret_tensor``, whose offset counts from where the tensor starts: the input's
    own offset is not counted twice (it was: the backward of Swin's window attention
    read 32 elements past ``v``'s storage, and its gradients were garbage)."""
    torch.manual_seed(0)
    qkv = torch.randn(4, 6, 48)
    g = torch.randn(4, 6, 6)
    k, v = qkv[:, :, 16:32], qkv[:, :, 32:48]

    def f(g: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.bmm(g, v) + 1, k.transpose(1, 2) @ g.transpose(1, 2), v.mT @ g

    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        got = torch.compile(f, backend="kiln", dynamic=False)(g, k, v)
    for a, b in zip(got, f(g, k, v)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    source = next(iter(compiled_graphs.values())).wrapper_source
    assert "reinterpret_tensor(" in source, source  # the case under test: views of inputs

    # The training step of window attention, whose backward takes k and v as saved views
    # of the forward's qkv buffer.
    w = torch.randn(16, 48, requires_grad=True)

    def attention(x: torch.Tensor) -> torch.Tensor:
        q, k, v = (x @ w).reshape(4, 6, 3, 16).permute(2, 0, 1, 3).unbind(0)
        out = (q @ k.transpose(-2, -1) * 0.25).softmax(-1) @ v
        loss = out.square().mean()
        loss.backward()
        return loss

    x = torch.randn(4, 6, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        loss = torch.compile(attention, backend="kiln", dynamic=False)(x)
    grad, w.grad = w.grad, None
    torch.testing.assert_close(loss, attention(x))
    torch.testing.assert_close(grad, w.grad, rtol=1e-4, atol=1e-6)


def test_a_fault_inside_a_wrapper_shows_the_wrapper_line(
        compiled_graphs: dict[str, CompiledGraph]) -> None:
    """A wrapper's source is registered with linecache when it loads, so a traceback
    through it (and torch.cuda.memory's allocation frames, bench/memory_probe.py) shows
    the line that ran, not only ``<kiln wrapper ...>`` and a number."""
    import traceback

    from kiln.compiler.compiled_graph import load

    fn = torch.compile(lambda x, y: (x @ y).relu() + 1, backend="kiln")
    x, y = torch.randn(5, 7), torch.randn(7, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        torch.testing.assert_close(fn(x, y), (x @ y).relu() + 1)
    (graph,) = compiled_graphs.values()
    call = load(graph, {}, torch.device("cpu"))
    with pytest.raises(ValueError) as caught:
        call([x])  # one input short: the wrapper's unpacking of its inputs fails
    text = "".join(traceback.format_exception(caught.value))
    assert f"<kiln wrapper {graph.name}>" in text, text
    assert "= args" in text, text  # the line itself, read back through linecache
