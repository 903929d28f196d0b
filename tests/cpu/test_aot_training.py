"""The AOT cache serves training graphs (frontend.core.aot.training): a warm start runs no
AOTAutograd trace for a training graph whose runtime is simple, and its loss and every
parameter gradient equal eager's on fresh inputs over two steps; BatchNorm in train mode
(running statistics the compiled forward writes) is served too;
a forged training entry is rejected and the graph traced; a double backward raises."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.artifact_store import Artifact, open_store
from kiln.frontend.core.client import process_counters, reset_clients
from kiln.frontend.core.fallback import KilnFallbackWarning
from tests.aot_children import COLLECT_COUNTERS, COUNT_AOT_TRACES, manifests, run_child

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(kiln_isolated: None, tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "store"


@pytest.fixture
def aot_traces(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """AOTAutograd's traces in this process, counted at torch's own entry point."""
    import torch._dynamo.backends.common as common

    seen: list[int] = []
    real = common.aot_module_simplified

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(common, "aot_module_simplified", counted)
    return seen


def new_process() -> None:
    reset_clients()
    torch._dynamo.reset()


class NormMLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm = torch.nn.Linear(16, 32), torch.nn.LayerNorm(32)
        self.down = torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.norm(self.up(x))))


class BatchNormNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(8, 12), torch.nn.BatchNorm1d(12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.lin(x)).tanh()


def train_steps(model: torch.nn.Module, make_input: Any, steps: int = 2,
                options: dict[str, Any] | None = None, tol: float = 1e-5) -> None:
    """``steps`` training steps through Kiln (no fallback allowed; Kiln ``options``),
    each on fresh inputs: the loss and every parameter's gradient equal eager's."""
    compiled = torch.compile(model, backend="kiln", options=options)
    for _ in range(steps):
        x = make_input()
        model.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            warnings.simplefilter("error", KilnFallbackWarning)
            loss = compiled(x).square().mean()
            loss.backward()
        got = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        model.zero_grad(set_to_none=True)
        want = model(x).square().mean()
        want.backward()
        torch.testing.assert_close(loss, want, rtol=tol, atol=tol)
        for g, p in zip(got, model.parameters()):
            torch.testing.assert_close(g, p.grad, rtol=tol, atol=tol)


def aot_entries(store: Path) -> list[tuple[Path, dict[str, Any]]]:
    return manifests(store, "aot")


def test_a_warm_start_serves_a_training_graph(store: Path, aot_traces: list[int]) -> None:
    torch.manual_seed(0)
    model = NormMLP()
    train_steps(model, lambda: torch.randn(4, 16))
    cold = process_counters()
    assert (cold.get("aot_misses"), cold.get("aot_publishes"), len(aot_traces)) == (1, 1, 1)
    [(_, entry)] = aot_entries(store)
    assert entry["serve"] is True and entry["training"]["outputs"] == 1
    assert entry["training"]["grad_inputs"].count(True) == 6  # the parameters, not x
    assert entry["training"]["backward"] != entry["graph"]

    new_process()
    train_steps(model, lambda: torch.randn(4, 16))
    warm = process_counters()
    assert len(aot_traces) == 1  # none more
    assert warm.get("aot_hits") == 1 and warm.get("aot_traces", 0) == 0
    assert warm.get("hits") == warm.get("graphs") == 2 and warm.get("compiles", 0) == 0


def test_an_input_requiring_grad_gets_its_gradient(store: Path) -> None:
    """A user input that requires grad, beside an output that is not differentiable."""
    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return (x @ w).sin(), x.detach().argmax(-1)

    w = torch.randn(6, 5)
    for _ in range(2):
        new_process()
        x, gy = torch.randn(3, 6, requires_grad=True), torch.randn(3, 5)
        y, idx = torch.compile(fn, backend="kiln")(x, w)
        assert not idx.requires_grad and y.requires_grad
        (y * gy).sum().backward()
        ref = x.detach().clone().requires_grad_(True)
        (fn(ref, w)[0] * gy).sum().backward()
        torch.testing.assert_close(x.grad, ref.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(idx, x.argmax(-1))
    assert process_counters().get("aot_hits") == 1


def test_batchnorm_in_train_mode_is_served(store: Path, aot_traces: list[int]) -> None:
    """BatchNorm's running statistics are written by the compiled forward (a mutation
    AOTAutograd keeps in the graph): served, the statistics, loss and gradients equal
    eager's, and the statistics' version counters move as AOTAutograd's runtime moves
    them."""
    import copy

    torch.manual_seed(0)
    model = BatchNormNet().train()
    reference = copy.deepcopy(model)
    for _ in range(2):
        new_process()
        compiled = torch.compile(model, backend="kiln")
        x = torch.randn(6, 8)
        version = model.bn.running_mean._version
        with warnings.catch_warnings():
            warnings.simplefilter("error", KilnFallbackWarning)
            loss = compiled(x).square().mean()
            loss.backward()
        want = reference(x).square().mean()
        want.backward()
        assert model.bn.running_mean._version > version
        torch.testing.assert_close(loss, want, rtol=1e-5, atol=1e-5)
        for got, ref in [*zip(model.parameters(), reference.parameters())]:
            torch.testing.assert_close(got.grad, ref.grad, rtol=1e-5, atol=1e-5)
        for got, ref in zip(model.buffers(), reference.buffers()):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
    assert len(aot_traces) == 1
    assert process_counters().get("aot_hits") == 1
    [(_, entry)] = aot_entries(store)
    assert entry["serve"] is True and entry["training"]["mutated"]


def _forge(store: Path, how: str) -> None:
    [(path, entry)] = aot_entries(store)
    training = dict(entry["training"])
    if how == "tangent_output":
        training["tangents"] = [{**training["tangents"][0], "output": 5}]
    elif how == "grad_inputs":
        training["grad_inputs"] = training["grad_inputs"][:-1]
    elif how == "missing_backward":
        training["backward"] = "ab" * 32
    elif how == "extra_field":
        training["run"] = "this"
    elif how == "backward_is_forward":
        training["backward"] = entry["graph"]
    forged = {**entry, "training": training}
    with open_store(url=str(store), local_cache=False) as raw:
        assert raw.publish(Artifact(path.name, forged, {}))


@pytest.mark.parametrize("how", ["tangent_output", "grad_inputs", "missing_backward",
                                 "extra_field", "backward_is_forward"])
def test_a_forged_training_entry_is_rejected_and_traced(store: Path, how: str,
                                                        aot_traces: list[int]) -> None:
    torch.manual_seed(0)
    model = NormMLP()
    train_steps(model, lambda: torch.randn(4, 16), steps=1)
    _forge(store, how)
    new_process()
    train_steps(model, lambda: torch.randn(4, 16))
    seen = process_counters()
    assert seen.get("aot_rejected") == 1 and seen.get("aot_hits", 0) == 0
    assert len(aot_traces) == 2
    new_process()  # the traced path replaced the forged entry
    train_steps(model, lambda: torch.randn(4, 16), steps=1)
    assert process_counters().get("aot_hits") == 1


def test_a_double_backward_through_a_served_graph_raises(store: Path) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.sin() * x

    for _ in range(2):
        new_process()
        x = torch.randn(5, requires_grad=True)
        (g,) = torch.autograd.grad(torch.compile(fn, backend="kiln")(x).sum(), x,
                                   create_graph=True)
        torch.testing.assert_close(g, x.cos() * x + x.sin())
    assert process_counters().get("aot_hits") == 1
    with pytest.raises(RuntimeError, match="double backward"):
        g.sum().backward()


CHILD = """
import json, os, sys, warnings, torch
from kiln.frontend.core.fallback import KilnFallbackWarning
from kiln.frontend.core.client import _clients
sys.path.insert(0, os.path.join(os.environ["ROOT"], "bench"))
from coldstart_models import encoder_train, max_error
""" + COUNT_AOT_TRACES + """warnings.simplefilter("error", KilnFallbackWarning)
torch.manual_seed(int(os.environ["SEED"]))
case = encoder_train("cpu", True)
module = case.module
compiled = torch.compile(module, backend="kiln")
errors = []
for step in range(2):
    if step:
        case.inputs[0].random_(0, 256)
    got = [t.clone() for t in case.step(compiled)]
    got_all = [p.grad.clone() for p in module.parameters()]
    want = case.step(module)
    want_all = [p.grad.clone() for p in module.parameters()]
    ok, worst = max_error(got + got_all, want + want_all, case.tol)
    errors.append([ok, worst])
""" + COLLECT_COUNTERS + """
print(json.dumps({"traces": len(traces), "errors": errors, "counters": counts}))
"""


def test_encoder_train_warm_start_in_a_fresh_process(tmp_path: Path) -> None:
    """bench/coldstart_models.py's encoder training step (smoke size): cold in one
    process, then warm in another with fresh inputs and weights: no AOTAutograd trace,
    the loss and every parameter gradient equal eager's, two steps each."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(KILN_STORE=str(tmp_path / "store"), KILN_LOCAL_CACHE="off",
               KILN_FARM="inprocess", KILN_STATS_FILE=str(tmp_path / "stats.json"),
               ROOT=str(ROOT), PYTHONPATH=str(ROOT))
    runs = []
    for seed in (1, 2):
        env["SEED"] = str(seed)
        runs.append(run_child(CHILD, env, timeout=900))
    cold, warm = runs
    assert all(ok for ok, _ in cold["errors"] + warm["errors"]), (cold, warm)
    assert cold["traces"] >= 1 and cold["counters"].get("aot_publishes", 0) >= 1
    assert warm["traces"] == 0, warm
    assert warm["counters"]["aot_hits"] == cold["traces"]
    assert warm["counters"].get("compiles", 0) == 0


def test_a_training_graph_with_symbolic_sizes_is_served_at_new_sizes(
        store: Path, aot_traces: list[int]) -> None:
    """Training with a dynamic batch (``mark_dynamic``): the first process traces the
    forward and the backward (a symbolic batch, sizes saved for the backward) and
    publishes one entry; a new process at batch sizes never seen is served, with no trace
    and no compile, and its loss and gradients equal eager's. (``dynamic=True`` costs one
    trace in every process: its first graph has a symbolic feature size, which the trace
    specializes to the weights', and Dynamo compiles the frame again.)"""
    torch.manual_seed(0)
    model = NormMLP()

    def steps(batches: tuple[int, ...]) -> None:
        sizes = iter(batches)

        def marked() -> torch.Tensor:
            x = torch.randn(next(sizes), 16)
            torch._dynamo.mark_dynamic(x, 0)
            return x

        train_steps(model, marked, steps=len(batches))

    steps((5, 9))
    [(_, entry)] = aot_entries(store)
    assert entry["serve"] is True and entry["symbolic"] is True, entry
    assert entry["training"]["symints"] >= 1  # the batch size, saved for the backward
    new_process()
    steps((7, 12, 3))
    warm = process_counters()
    assert len(aot_traces) == 1, warm  # the first process's only
    assert warm.get("aot_hits") == 1 and warm.get("aot_traces", 0) == 0, warm
    assert warm.get("compiles", 0) == 0, warm
