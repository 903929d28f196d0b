"""A training frame whose backward compiles beside its forward (``aot_kiln``'s
``backward_now``, what the backend asks for when a farm is up and the graphs will be cut
into regions): both graphs are compiled before the forward runs, each regional graph
(inference too) waits for its regions at its first call, outputs and gradients match
eager, and a region that fails while deferred runs its graph eagerly with one warning
naming graph and stage.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch._functorch import config as functorch_config

from kiln import KilnFallbackWarning
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.backend import aot_kiln, compile_aten_graph
from kiln.frontend.core.regions import DeferredGraph
from tests.regions_models import Stack, fail_second_region_compile

OPTIONS = {"regions": "on", "region_nodes": 15}  # about one block per region
TOL = {"atol": 1e-4, "rtol": 1e-4}

pytestmark = pytest.mark.skipif(
    not hasattr(functorch_config, "force_non_lazy_backward_lowering"),
    reason="this torch's AOTAutograd always compiles backward graphs lazily")


@pytest.fixture(autouse=True)
def _isolated(kiln_isolated: None) -> None:
    """Every test compiles in this process against a fresh store."""


def counters() -> dict[str, Any]:
    from kiln.frontend.core.client import process_counters

    return process_counters()


def kiln_with(backward_now: bool, made: dict[str, Any]) -> Callable[..., Any]:
    """The kiln backend's AOT path with ``backward_now`` chosen here (the backend
    chooses it from the farm); ``made``: each ATen graph's name and what it became."""
    config = KilnConfig.resolve(OPTIONS)

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        def graph_compiler(graph: torch.fx.GraphModule, inputs: Sequence[Any],
                           name: str) -> Any:
            made[name] = compile_aten_graph(graph, inputs, config, name)
            return made[name]

        return aot_kiln(gm, example_inputs, graph_compiler, backward_now=backward_now)

    return backend


def train_step(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).pow(2).mean()
    loss.backward()
    return loss.detach()


def check_against_eager(model: Stack, compiled: Callable[..., Any], x: torch.Tensor,
                        made: dict[str, Any]) -> list[str]:
    """One training step compiled and one eager (fresh copy); returns the graphs made
    before the forward ran."""
    model.zero_grad(set_to_none=True)
    ref_model = Stack()
    ref_model.load_state_dict(model.state_dict())
    out = compiled(x)
    before_backward = sorted(made)
    loss = out.pow(2).mean()
    loss.backward()
    torch.testing.assert_close(loss, train_step(ref_model, x), **TOL)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    return before_backward


def test_backward_compiles_beside_the_forward_and_regions_wait_for_the_first_call(
) -> None:
    torch.manual_seed(5)
    model, made = Stack(), {}  # type: ignore[var-annotated]
    compiled = torch.compile(model, backend=kiln_with(True, made))
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        before_backward = check_against_eager(model, compiled, torch.randn(4, 8), made)
    assert [n.split("_")[0] for n in before_backward] == ["backward", "forward"]
    assert all(isinstance(fn, DeferredGraph) for fn in made.values())
    c = counters()
    assert c["regional_graphs"] == 2 and c["regions_distinct"] < c["regions"]
    # Called again, the resolved graphs run with no further compile.
    compiles = c["compiles"]
    check_against_eager(model, compiled, torch.randn(4, 8), made)
    assert counters()["compiles"] == compiles


def test_an_inference_graph_waits_for_its_regions_at_its_first_call() -> None:
    torch.manual_seed(8)
    model, made = Stack().eval(), {}  # type: ignore[var-annotated]
    compiled = torch.compile(model, backend=kiln_with(True, made))
    x = torch.randn(4, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        out = compiled(x)
        torch.testing.assert_close(out, model(x), **TOL)
        torch.testing.assert_close(compiled(2 * x), model(2 * x), **TOL)
    assert [n.split("_")[0] for n in made] == ["inference"]
    assert all(isinstance(fn, DeferredGraph) for fn in made.values())
    assert counters()["regional_graphs"] == 1


def test_without_it_the_backward_compiles_at_the_first_backward_call() -> None:
    torch.manual_seed(6)
    model, made = Stack(), {}  # type: ignore[var-annotated]
    compiled = torch.compile(model, backend=kiln_with(False, made))
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        before_backward = check_against_eager(model, compiled, torch.randn(4, 8), made)
    assert [n.split("_")[0] for n in before_backward] == ["forward"]
    assert not any(isinstance(fn, DeferredGraph) for fn in made.values())
    assert counters()["regional_graphs"] == 2


def test_a_region_failing_while_deferred_runs_its_graph_eagerly_with_one_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fail_second_region_compile(monkeypatch)
    torch.manual_seed(7)
    model, made = Stack(), {}  # type: ignore[var-annotated]
    compiled = torch.compile(model, backend=kiln_with(True, made))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check_against_eager(model, compiled, torch.randn(4, 8), made)
    fallbacks = [w for w in caught if issubclass(w.category, KilnFallbackWarning)]
    assert len(fallbacks) == 1, [str(w.message) for w in caught]
    text = str(fallbacks[0].message)
    assert "region " in text and "injected fault" in text and "stage lowering" in text
    assert "of graph forward_" in text or "of graph backward_" in text
