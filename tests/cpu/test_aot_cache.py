"""The AOT cache (frontend.core.aot.cache): a warm start serves the ATen graph AOTAutograd
made last time with no AOT trace, and its outputs equal eager on fresh inputs; a
tampered or forged entry is refused and the graph traced; graphs the cache cannot serve
(dynamic shapes, an output aliasing an input) are traced, each counted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.artifact_store import Artifact, open_store
from kiln.artifact_store.manifest import decode_manifest
from kiln.frontend.core.aot.entry import ENTRY_SCHEMA
from kiln.frontend.core.client import process_counters, reset_clients
from kiln.frontend.core.fallback import KilnFallbackWarning
from tests.aot_children import COLLECT_COUNTERS, COUNT_AOT_TRACES, manifests, run_child

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def store(kiln_isolated: None, tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "store"


def counters() -> dict[str, Any]:
    return process_counters()


def new_process() -> None:
    """What a new process forgets (Dynamo's cache, the clients and their counters)."""
    reset_clients()
    torch._dynamo.reset()


def compiled_matches_eager(fn: Callable[..., Any], *args: torch.Tensor,
                           grad: bool = False) -> None:
    """Compile with Kiln (no fallback allowed) and compare with eager on ``args``."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        with torch.set_grad_enabled(grad):
            got = torch.compile(fn, backend="kiln")(*args)
            want = fn(*args)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x))).softmax(-1)


def aot_entries(store: Path) -> list[tuple[Path, dict[str, Any]]]:
    return manifests(store, "aot")


def test_warm_start_serves_the_graph_without_tracing(store: Path) -> None:
    model = MLP()
    compiled_matches_eager(model, torch.randn(4, 16))
    cold = counters()
    assert (cold.get("aot_misses"), cold.get("aot_traces"), cold.get("aot_publishes")) == \
        (1, 1, 1)
    [(_, entry)] = aot_entries(store)
    assert entry["serve"] is True and len(entry["graph"]) == 64

    new_process()
    compiled_matches_eager(model, torch.randn(4, 16))  # fresh values, same metadata
    warm = counters()
    assert warm.get("aot_hits") == 1 and warm.get("aot_traces", 0) == 0
    assert warm.get("hits") == warm.get("graphs") == 1 and warm.get("compiles", 0) == 0


def test_a_tensor_constant_of_the_aten_graph_travels_in_the_entry(store: Path) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x * torch.tensor([1.5, -2.0, 0.25, 3.0])).cos()

    compiled_matches_eager(fn, torch.randn(5, 4))
    [(_, entry)] = aot_entries(store)
    assert entry["serve"] is True and entry["constants"]  # the lifted constant
    new_process()
    compiled_matches_eager(fn, torch.randn(5, 4))
    assert counters().get("aot_hits") == 1


@pytest.mark.parametrize("forgery", ["bad_key", "other_graph", "garbage_constants",
                                     "alias_out_of_range"])
def test_a_forged_entry_is_rejected_and_the_graph_traced(store: Path, forgery: str) -> None:
    """An unsigned store: an entry that names no graph, another graph's key, or constants
    it does not hold is refused by the checks; the graph is traced and runs right."""
    model = MLP()
    compiled_matches_eager(model, torch.randn(4, 16))
    compiled_matches_eager(lambda t: t.sin() * 2, torch.randn(3, 3))  # another graph
    entries = aot_entries(store)
    mine = next(p for p, m in entries if m["inputs"] == 5)
    other = next(m for _, m in entries if m["inputs"] == 1)
    key = mine.name
    forged = {"kind": "aot", "schema": ENTRY_SCHEMA, "serve": True, "graph": other["graph"],
              "regions": False, "inputs": 5, "constants": [], "training": None,
              "aliases": []}
    blobs: dict[str, bytes] = {}
    if forgery == "bad_key":
        forged["graph"] = "../" + "0" * 61
    elif forgery == "garbage_constants":
        forged["graph"] = decode_manifest(mine.read_bytes()).meta["graph"]
        forged["constants"], blobs = ["c0"], {"constants.msgpack": b"\x93\x01\x02"}
    elif forgery == "alias_out_of_range":
        forged["graph"] = decode_manifest(mine.read_bytes()).meta["graph"]
        forged["aliases"] = [[0, 5, False]]
    with open_store(url=str(store), local_cache=False) as raw:
        assert raw.publish(Artifact(key, forged, blobs))

    new_process()
    compiled_matches_eager(model, torch.randn(4, 16))
    seen = counters()
    assert seen.get("aot_rejected") == 1 and seen.get("aot_hits", 0) == 0
    assert seen.get("aot_traces") == 1
    # The traced path replaced the forged entry: the next start is served.
    new_process()
    compiled_matches_eager(model, torch.randn(4, 16))
    assert counters().get("aot_hits") == 1


def test_a_tampered_signed_entry_is_refused(store: Path, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    monkeypatch.setenv("KILN_SIGNING_KEY", "hmac:aot-cache-builder")
    new_process()
    model = MLP()
    compiled_matches_eager(model, torch.randn(4, 16))
    [(path, entry)] = aot_entries(store)
    raw = path.read_bytes()
    graph = entry["graph"].encode()
    path.write_bytes(raw.replace(graph, graph[::-1]))  # point it elsewhere, keep the size

    new_process()
    compiled_matches_eager(model, torch.randn(4, 16))
    seen = counters()
    assert seen.get("aot_hits", 0) == 0 and seen.get("aot_misses") == 1  # refused: a miss
    assert seen.get("aot_traces") == 1


def test_training_graphs_are_served_on_a_warm_start(store: Path) -> None:
    """(A training graph whose runtime is simple: tests/cpu/test_aot_training.py tests
    the served runtime and the graphs that are still traced.)"""
    model = MLP()
    for _ in range(2):
        new_process()
        x = torch.randn(4, 16)
        with warnings.catch_warnings():
            warnings.simplefilter("error", KilnFallbackWarning)
            out = torch.compile(model, backend="kiln")(x)
        out.square().sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        model.zero_grad()
        model(x).square().sum().backward()
        for got, p in zip(grads, model.parameters()):
            torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-5)
        model.zero_grad()
    seen = counters()
    assert seen.get("aot_hits") == 1 and seen.get("aot_traces", 0) == 0
    assert [m["training"] is not None for _, m in aot_entries(store)] == [True]


def test_an_output_that_aliases_an_input_is_served_as_a_view(store: Path) -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return x.view(-1), x.exp(), x.t()

    for _ in range(2):
        new_process()
        x = torch.randn(3, 4)
        with torch.no_grad():
            flat, exp, t = torch.compile(fn, backend="kiln")(x)
        assert flat._base is x and t._base is x  # views of the input, as AOTAutograd makes
        assert (flat.stride(), t.stride()) == ((1,), (1, 4))
        torch.testing.assert_close(exp, x.exp())
        x.add_(1.0)  # a write through the input shows in both views
        torch.testing.assert_close(flat, x.view(-1))
        torch.testing.assert_close(t, x.t())
    seen = counters()
    assert seen.get("aot_hits") == 1 and "aot_uncached_output_alias_or_grad" not in seen


def test_a_view_as_another_dtype_is_traced(store: Path) -> None:
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.view(torch.int32), x.exp()

    for _ in range(2):
        new_process()
        x = torch.randn(3, 4)
        with torch.no_grad():
            bits, exp = torch.compile(fn, backend="kiln")(x)
        assert bits.data_ptr() == x.data_ptr()
        torch.testing.assert_close(bits, x.view(torch.int32))
        torch.testing.assert_close(exp, x.exp())
    assert counters().get("aot_uncached_output_alias_or_grad") == 1


def test_a_graph_with_symbolic_sizes_is_served_in_a_new_process_at_any_size(
        store: Path) -> None:
    """``dynamic=True``: the first process traces and compiles one graph with a symbolic
    row count and publishes its entry; each later process, at a row count never seen, is
    served from it (no AOTAutograd trace, no compile) and matches eager."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x.sin() + 1).sum(-1)

    for k, rows in enumerate((3, 7, 12)):
        new_process()
        x = torch.randn(rows, 5)
        with torch.no_grad():
            torch.testing.assert_close(torch.compile(fn, backend="kiln", dynamic=True)(x),
                                       fn(x))
        seen = counters()
        assert seen.get("aot_hits", 0) == (k > 0), seen
        assert seen.get("aot_traces", 0) == (k == 0) and seen.get("compiles", 0) == (k == 0)
    [(_, entry)] = aot_entries(store)
    assert entry["serve"] and entry["symbolic"] is True, entry

CHILD = """
import json, os, sys, warnings, torch
from kiln.frontend.core.fallback import KilnFallbackWarning
from kiln.frontend.core.client import _clients
sys.path.insert(0, os.environ["TEST_DIR"])
from test_aot_cache import MLP
""" + COUNT_AOT_TRACES + """warnings.simplefilter("error", KilnFallbackWarning)
torch.manual_seed(0)
model = MLP()
torch.manual_seed(os.getpid())
x = torch.randn(4, 16)
with torch.no_grad():
    out = torch.compile(model, backend="kiln")(x)
    close = bool(torch.allclose(out, model(x), rtol=1e-5, atol=1e-5))
""" + COLLECT_COUNTERS + """
print(json.dumps({"aot_traces_seen": len(traces), "close": close, "counters": counts}))
"""


def test_a_fresh_process_skips_aotautograd(tmp_path: Path) -> None:
    """Two processes on one store: the second never calls AOTAutograd (counted by
    wrapping torch's own entry point), its timeline shows the cache hit and no AOT span,
    and ``kiln stats --json`` counts the hit."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(KILN_STORE=str(tmp_path / "store"), KILN_LOCAL_CACHE="off",
               KILN_FARM="inprocess", KILN_STATS_FILE=str(tmp_path / "stats.json"),
               TEST_DIR=str(Path(__file__).parent), PYTHONPATH=str(ROOT))
    runs = []
    for i in range(2):
        env["KILN_TRACE"] = str(tmp_path / f"trace{i}.json")
        runs.append(run_child(CHILD, env, timeout=600))
    cold, warm = runs
    assert cold["close"] and warm["close"]
    assert cold["aot_traces_seen"] == 1 and cold["counters"]["aot_publishes"] == 1
    assert warm["aot_traces_seen"] == 0 and warm["counters"]["aot_hits"] == 1
    spans = json.loads((tmp_path / "trace1.json").read_text())
    spans = spans.get("traceEvents", spans) if isinstance(spans, dict) else spans
    names = {e.get("name") for e in spans}
    assert "AOT cache lookup" in names and "AOTAutograd (compiles inside)" not in names
    assert any(e.get("name") == "AOT cache lookup" and e["args"].get("hit") for e in spans)
    stats = subprocess.run([sys.executable, "-m", "kiln.frontend.cli.main", "stats", "--json"],
                           env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    summary = json.loads(stats.stdout)
    assert (summary["aot_hits"], summary["aot_traces"], summary["aot_publishes"]) == (1, 1, 1)


def test_a_failure_of_the_cache_itself_costs_the_trace_not_the_graph(
        store: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from kiln.frontend.core.aot import cache as aot_cache

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a torch this code did not expect")

    monkeypatch.setattr(aot_cache, "aot_key", broken)
    compiled_matches_eager(MLP(), torch.randn(4, 16))
    seen = counters()
    assert seen.get("aot_uncached_error") == 1 and seen.get("aot_traces") == 1
    assert "AOT cache lookup failed (RuntimeError" in caplog.text
    assert aot_entries(store) == []
