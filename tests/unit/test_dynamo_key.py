"""The AOT cache's key (frontend.core.aot.dynamo_key): Dynamo graphs that AOTAutograd would trace
differently never share a key; the same graph and inputs always do; what the key cannot
see is refused (NotCacheable), never guessed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kiln.frontend.core.aot.dynamo_key import NotCacheable, aot_key

CPU = {"kind": "cpu"}


def capture(fn: Callable[..., Any], *args: Any, dynamic: bool | None = False
            ) -> tuple[torch.fx.GraphModule, list[Any]]:
    """Dynamo's first graph of ``fn(*args)`` and its example inputs (no compile)."""
    graphs: list[tuple[torch.fx.GraphModule, list[Any]]] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        graphs.append((gm, list(example_inputs)))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=backend, dynamic=dynamic)(*args)
    assert graphs, "Dynamo made no graph"
    return graphs[0]


def key_of(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    gm, inputs = capture(fn, *args, **kwargs)
    return aot_key(gm, inputs, {}, CPU).key


def mlp(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x @ w).sum(-1)


def test_same_graph_and_input_metadata_give_one_key() -> None:
    a = key_of(mlp, torch.randn(4, 8), torch.randn(8, 3))
    b = key_of(mlp, torch.randn(4, 8), torch.randn(8, 3))  # other values, fresh capture
    assert a == b


@pytest.mark.parametrize("change", ["dtype", "stride", "requires_grad", "parameter", "shape",
                                    "offset"])
def test_inputs_that_aot_sees_differently_change_the_key(change: str) -> None:
    x, w = torch.randn(4, 8), torch.randn(8, 3)
    other: dict[str, tuple[torch.Tensor, torch.Tensor]] = {
        "dtype": (x.double(), w.double()),
        "stride": (torch.randn(8, 4).t(), w),  # same shape, column-major
        "requires_grad": (x, w.clone().requires_grad_()),
        "parameter": (x, torch.nn.Parameter(w.clone(), requires_grad=False)),
        "shape": (torch.randn(5, 8), w),
        "offset": (torch.randn(33)[1:].view(4, 8), w),
    }
    with torch.no_grad():
        base = key_of(mlp, x, w)
        changed = key_of(mlp, *other[change])
    assert base != changed


def test_grad_mode_and_autocast_change_the_key() -> None:
    w = torch.nn.Parameter(torch.randn(8, 3))
    gm, inputs = capture(mlp, torch.randn(4, 8), w)
    with torch.enable_grad():
        grad_on = aot_key(gm, inputs, {}, CPU).key
    with torch.no_grad():
        grad_off = aot_key(gm, inputs, {}, CPU).key
        with torch.autocast("cpu", dtype=torch.bfloat16):
            autocast = aot_key(gm, inputs, {}, CPU).key
    with torch.inference_mode():
        inference = aot_key(gm, inputs, {}, CPU).key
    assert len({grad_on, grad_off, autocast, inference}) == 4


def test_options_target_and_graph_change_the_key() -> None:
    x = torch.randn(4, 8)
    gm, inputs = capture(lambda t: t * 2, x)
    base = aot_key(gm, inputs, {}, CPU).key
    assert aot_key(gm, inputs, {"deterministic": True}, CPU).key != base
    assert aot_key(gm, inputs, {}, {"kind": "cuda", "arch": 90}).key != base
    # Constants by type and value: * 2, * 2.0 and * 3 trace to different graphs.
    assert key_of(lambda t: t * 2.0, x) != base
    assert key_of(lambda t: t * 3, x) != base
    assert key_of(lambda t: t + 2, x) != base


def test_symbolic_sizes_are_keyed_by_symbol_not_by_value() -> None:
    """A dynamic=True graph keys its sizes as symbols: captures at other sizes share the key
    (one compile serves every size), and the static capture of the same sizes does not."""
    with torch.no_grad():
        gm, inputs = capture(mlp, torch.randn(4, 8), torch.randn(8, 3), dynamic=True)
        first = aot_key(gm, inputs, {}, CPU)
        gm2, inputs2 = capture(mlp, torch.randn(6, 5), torch.randn(5, 7), dynamic=True)
        second = aot_key(gm2, inputs2, {}, CPU)
        static = key_of(mlp, torch.randn(4, 8), torch.randn(8, 3))
    traced = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
    assert any(isinstance(s, torch.SymInt) for t in traced if isinstance(t, torch.Tensor)
               for s in t.shape), "the capture was not symbolic"
    assert first.key == second.key
    assert first.key != static


def _users_function(t: torch.Tensor) -> torch.Tensor:
    return t + 1


def test_a_function_from_outside_torch_is_not_keyed() -> None:
    """Its code could change under the same name: no key, the traced path."""
    allowed = torch._dynamo.allow_in_graph(_users_function)
    gm, inputs = capture(lambda t: allowed(t) * 2, torch.randn(4))
    assert any(n.target is _users_function for n in gm.graph.nodes)
    with pytest.raises(NotCacheable) as caught:
        aot_key(gm, inputs, {}, CPU)
    assert caught.value.reason == "graph" and "_users_function" in caught.value.detail
