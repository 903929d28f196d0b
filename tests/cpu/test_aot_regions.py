"""The AOT cache serves graphs compiled as regions (frontend.core.regions): the entry names
the whole graph's key, whose manifest is the region plan, and a warm start loads the plan
and every region's artifact (each a verified hit) with no AOTAutograd trace: inference,
and a training step's forward and backward. Outputs and gradients equal eager's on
fresh inputs. A region missing or damaged at serve time rejects the entry: the graph is
traced (counted) and runs right. A deferred regional graph's entry waits for its plans."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kiln.artifact_store.manifest import decode_manifest
from kiln.frontend.core.aot.entry import ENTRY_SCHEMA
from kiln.frontend.core.client import process_counters, reset_clients
from kiln.frontend.core.fallback import KilnFallbackWarning
from tests.aot_children import COLLECT_COUNTERS, COUNT_AOT_TRACES, manifests, run_child
from tests.cpu.test_aot_training import train_steps
from tests.regions_models import Stack

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = {"regions": "on", "region_nodes": 15}  # about one block per region
TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture
def store(kiln_isolated: None, tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "store"


def new_process() -> None:
    reset_clients()
    torch._dynamo.reset()


def infer(model: torch.nn.Module) -> None:
    """One inference call through Kiln on fresh inputs (no fallback), equal to eager."""
    x = torch.randn(4, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        got = torch.compile(model, backend="kiln", options=OPTIONS)(x)
        torch.testing.assert_close(got, model(x), **TOL)


def train(model: torch.nn.Module) -> None:
    """Training steps through Kiln, cut into regions, on fresh inputs: loss and gradients
    equal eager's."""
    train_steps(model, lambda: torch.randn(4, 8), options=OPTIONS, tol=TOL["atol"])


CHILD = """
import json, os, sys, warnings, torch
from kiln.frontend.core.fallback import KilnFallbackWarning
from kiln.frontend.core.client import _clients
from tests.regions_models import Stack
""" + COUNT_AOT_TRACES + """warnings.simplefilter("error", KilnFallbackWarning)
torch.manual_seed(int(os.environ["SEED"]))  # fresh weights and inputs in each process
model = Stack()
compiled = torch.compile(model, backend="kiln")
errors = []
for step in range(2):
    x = torch.randn(4, 8)
    if os.environ["MODE"] == "inference":
        with torch.no_grad():
            got, want = [compiled(x)], [model(x)]
    else:
        model.zero_grad(set_to_none=True)
        loss = compiled(x).square().mean()
        loss.backward()
        got = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
        ref = model(x).square().mean()
        ref.backward()
        want = [ref.detach()] + [p.grad.clone() for p in model.parameters()]
    errors.append(max((g - w).abs().max().item() for g, w in zip(got, want)))
""" + COLLECT_COUNTERS + """
print(json.dumps({"traces": len(traces), "errors": errors, "counters": counts}))
"""


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_a_regional_graph_is_served_warm_in_a_fresh_process(tmp_path: Path,
                                                             mode: str) -> None:
    """Cold in one process, warm in another (fresh weights and inputs): no AOTAutograd
    trace, every region a hit, nothing compiled, outputs (and gradients) equal eager's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(KILN_STORE=str(tmp_path / "store"), KILN_LOCAL_CACHE="off",
               KILN_FARM="inprocess", KILN_STATS_FILE="off", KILN_REGIONS="on",
               KILN_REGION_NODES="15", KILN_REGION_PROCESSES="0", MODE=mode,
               PYTHONPATH=str(ROOT))
    runs = []
    for seed in (1, 2):
        env["SEED"] = str(seed)
        runs.append(run_child(CHILD, env, timeout=900))
    cold, warm = runs
    assert max(cold["errors"] + warm["errors"]) < 1e-4, (cold, warm)
    graphs = 1 if mode == "inference" else 2
    assert cold["traces"] == 1 and cold["counters"]["regional_graphs"] == graphs, cold
    assert cold["counters"].get("aot_publishes") == 1, cold
    w = warm["counters"]
    assert warm["traces"] == 0, warm
    assert (w.get("aot_hits"), w.get("aot_traces", 0), w.get("aot_region_plans")) \
        == (1, 0, graphs), w
    assert w.get("compiles", 0) == 0 and w["hits"] == w["graphs"] >= 2 * graphs, w
    assert not w.get("aot_rejected") and not w.get("regional_graphs"), w
    entry = manifests(tmp_path / "store", "aot")[0][1]
    assert entry["serve"] is True and entry["regions"] is True
    if mode == "training":
        assert entry["training"]["backward_regions"] is True


def _region_keys(store: Path) -> list[str]:
    return sorted({r["key"] for _, m in manifests(store, "regions")
                   for r in m["plan"]["regions"]})


@pytest.mark.parametrize("how", ["missing", "damaged"])
@pytest.mark.parametrize("mode", ["inference", "training"])
def test_a_region_missing_or_damaged_at_serve_time_traces(store: Path, how: str,
                                                          mode: str) -> None:
    """One region's artifact deleted, or one of its blobs changed: the entry is rejected
    (counted), the graph traced, the region compiled again; outputs stay right, and the
    next start is served again."""
    torch.manual_seed(4)
    model = Stack()
    run = infer if mode == "inference" else train
    run(model)
    keys = _region_keys(store)
    assert len(keys) >= 2
    victim = next(p for p in (store / "ac").rglob("*") if p.is_file() and p.name == keys[-1])
    if how == "missing":
        victim.unlink()
    else:
        ref = max(decode_manifest(victim.read_bytes()).blobs.values(), key=lambda r: r.size)
        blob = store / "cas" / ref.digest[:2] / ref.digest
        data = bytearray(blob.read_bytes())
        data[len(data) // 2] ^= 0xFF
        blob.write_bytes(bytes(data))
    new_process()
    run(model)
    c = process_counters()
    assert (c.get("aot_rejected"), c.get("aot_hits", 0), c.get("aot_traces")) == (1, 0, 1), c
    assert c.get("compiles", 0) >= 1  # the region that was gone, compiled again
    new_process()
    run(model)
    c = process_counters()
    assert (c.get("aot_hits"), c.get("compiles", 0), c.get("aot_rejected", 0)) == (1, 0, 0), c


def test_a_deferred_regional_entry_waits_for_its_plans(store: Path,
                                                       monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """Backward compiled beside the forward, both deferred (as with a farm up): no entry
    until both graphs' plans are stored (the backward's at the first backward); then the
    entry names both plans, and a warm start is served."""
    import kiln.frontend.core.regions as regions

    monkeypatch.setattr(regions, "overlap_backward", lambda gm, config: True)
    torch.manual_seed(5)
    model = Stack()
    compiled = torch.compile(model, backend="kiln", options=OPTIONS)
    x = torch.randn(4, 8)
    loss = compiled(x).square().mean()
    assert process_counters().get("regional_graphs") == 1  # the forward resolved
    assert not manifests(store, "aot")  # the backward's plan is not stored yet
    loss.backward()
    [(_, entry)] = manifests(store, "aot")
    assert entry["serve"] and entry["regions"] and entry["training"]["backward_regions"]
    model.zero_grad(set_to_none=True)
    new_process()
    train(model)
    c = process_counters()
    assert (c.get("aot_hits"), c.get("aot_region_plans"), c.get("compiles", 0)) == (1, 2, 0)


def test_a_deferred_region_that_fails_makes_an_entry_that_traces(
        store: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A deferred training graph whose region fails runs eagerly (one warning): its
    entry is published as not served ("regions"), so a warm start traces, counted."""
    import kiln.frontend.core.regions as regions
    from tests.regions_models import fail_second_region_compile

    monkeypatch.setattr(regions, "overlap_backward", lambda gm, config: True)
    fail_second_region_compile(monkeypatch)
    torch.manual_seed(6)
    model = Stack()
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = torch.compile(model, backend="kiln", options=OPTIONS)(x).square().mean()
        loss.backward()
    assert sum(issubclass(w.category, KilnFallbackWarning) for w in caught) == 1
    [(_, entry)] = manifests(store, "aot")
    assert entry == {"kind": "aot", "schema": ENTRY_SCHEMA, "serve": False, "reason": "regions"}
    new_process()
    train(model)
    c = process_counters()
    assert (c.get("aot_uncached_regions"), c.get("aot_hits", 0), c.get("aot_traces")) \
        == (1, 0, 1), c
