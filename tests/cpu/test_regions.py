"""Regional compilation on CPU (C++ kernels): a graph of identical blocks is cut between
blocks, identical blocks compile once, the stitched regions match eager (inference, and a
training step's forward and backward graphs), a warm start reads one plan and its regions,
a region that fails names itself and its graph and the graph runs eagerly, and values are
freed after their last use."""

from __future__ import annotations

import gc
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kiln import KilnFallbackWarning
from kiln.compiler.regions import Source, compute_nodes, live_counts, split_graph
from kiln.compiler.runtime.stitch import Step, schedule, stitch
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.compile import build_request
from kiln.frontend.core.keys import compute_key
from tests.regions_models import BLOCK_NODES, Stack, aten_graph, fail_second_region_compile

OPTIONS = {"regions": "on", "region_nodes": 15}  # about one block per region
TOL = {"atol": 1e-4, "rtol": 1e-4}


@pytest.fixture(autouse=True)
def _isolated(kiln_isolated: None) -> None:
    """Every test compiles in this process against a fresh store."""


def counters() -> dict[str, Any]:
    from kiln.frontend.core.client import process_counters

    return process_counters()


def run_compiled(model: torch.nn.Module, *args: torch.Tensor,
                 options: dict[str, Any] | None = None) -> Any:
    compiled = torch.compile(model, backend="kiln", options=options or OPTIONS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        return compiled, compiled(*args)


def test_cuts_fall_between_blocks_and_identical_blocks_make_identical_requests() -> None:
    torch.manual_seed(0)
    gm, args = aten_graph(Stack(), torch.randn(4, 8))
    nodes = compute_nodes(gm)
    assert len(nodes) == 6 * BLOCK_NODES + 4  # input projection 2, head 2
    split = split_graph(gm, args, 15)
    assert split is not None
    assert [r.nodes for r in split.regions] == [2 + BLOCK_NODES] + [BLOCK_NODES] * 4 + [
        BLOCK_NODES + 2]
    counts, _ = live_counts(nodes)
    ends = [sum(r.nodes for r in split.regions[:i + 1]) - 1 for i in range(5)]
    assert [counts[p] for p in ends] == [1] * 5  # only the residual stream crosses a cut
    # A middle region reads the stream from the region before and its block's 6 params.
    for r in split.regions[1:5]:
        values = [s for s in r.inputs if s.kind == "value"]
        assert values == [Source("value", r.index - 1, 0)]
        assert len(r.inputs) == 7 and r.num_outputs == 1
    config = KilnConfig.resolve({})
    keys = [compute_key(build_request(r.gm, r.example_inputs, config)).key
            for r in split.regions]
    assert len(set(keys[1:5])) == 1 and len(set(keys)) == 3
    assert split.outputs == (Source("value", 5, 0),)
    assert split_graph(gm, args, 200) is None  # one region's worth: not cut


def test_regions_are_whole_blocks_aligned_to_the_repeat() -> None:
    """A target of about two blocks gives regions of exactly two blocks, so the middle
    ones are one graph (a cut by size alone would drift through the blocks)."""
    torch.manual_seed(8)
    gm, args = aten_graph(Stack(layers=8), torch.randn(4, 8))
    split = split_graph(gm, args, 2 * BLOCK_NODES + 3)
    assert split is not None
    assert [r.nodes for r in split.regions] == [2 + 2 * BLOCK_NODES] + [2 * BLOCK_NODES] * 2 \
        + [2 * BLOCK_NODES + 2]
    config = KilnConfig.resolve({})
    keys = [compute_key(build_request(r.gm, r.example_inputs, config)).key
            for r in split.regions]
    assert keys[1] == keys[2] and len(set(keys)) == 3


def test_six_identical_blocks_compile_each_distinct_region_once() -> None:
    from kiln.frontend.core import compile as kiln_compile

    torch.manual_seed(1)
    model = Stack().eval()
    seen: list[str] = []
    kiln_compile.observers.append(lambda name, result: seen.append(name))
    x = torch.randn(4, 8)
    with torch.no_grad():
        compiled, out = run_compiled(model, x)
        torch.testing.assert_close(out, model(x), **TOL)
        x2 = torch.randn(4, 8)  # fresh values, same graph
        torch.testing.assert_close(compiled(x2), model(x2), **TOL)
    kiln_compile.observers.pop()
    c = counters()
    assert (c["regional_graphs"], c["regions"], c["regions_distinct"]) == (1, 6, 3)
    assert c["compiles"] == c["compiles_local"] == c["misses"] == 3
    assert c.get("hits", 0) == 0
    # Observers (kiln precompile's tally) hear of each distinct region: one artifact each.
    assert sorted(name.split(".")[1] for name in seen) == ["region0", "region1", "region5"]
    assert all(name.startswith("inference_") for name in seen)


def test_training_step_forward_and_backward_as_regions() -> None:
    torch.manual_seed(2)
    model = Stack()
    ref_model = Stack()
    ref_model.load_state_dict(model.state_dict())
    x = torch.randn(4, 8)
    compiled = torch.compile(model, backend="kiln", options=OPTIONS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        loss = compiled(x).pow(2).mean()
        loss.backward()
    ref = ref_model(x).pow(2).mean()
    ref.backward()
    torch.testing.assert_close(loss, ref, **TOL)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, **TOL)
    c = counters()
    assert c["regional_graphs"] == 2  # the forward and the backward graph
    assert c["regions_distinct"] < c["regions"]


def test_a_warm_start_reads_the_plan_and_compiles_nothing() -> None:
    from kiln.frontend.core.client import reset_clients

    torch.manual_seed(3)
    model = Stack().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        run_compiled(model, x)
        reset_clients()
        torch._dynamo.reset()
        _, out = run_compiled(model, x)
        torch.testing.assert_close(out, model(x), **TOL)
    c = counters()
    # The AOT cache serves the stitched plan: no trace, every distinct region a hit.
    assert (c.get("aot_hits"), c.get("aot_region_plans"), c.get("aot_traces", 0)) == (1, 1, 0)
    assert c["hits"] == c["graphs"] == 3
    assert c.get("compiles", 0) == 0 and not c.get("region_plan_hits")
    assert not c.get("aot_rejected") and not c.get("aot_uncached")


def test_a_whole_graph_in_the_store_is_used_as_it_is() -> None:
    """A store filled with whole graphs (``kiln precompile``, regions off) still hits."""
    torch.manual_seed(6)
    model = Stack().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        run_compiled(model, x, options={**OPTIONS, "regions": "off"})
        torch._dynamo.reset()
        _, out = run_compiled(model, x)
        torch.testing.assert_close(out, model(x), **TOL)
    c = counters()
    assert c["hits"] == 1 and c["compiles"] == 1 and not c.get("regional_graphs")


def test_a_failing_region_names_itself_and_the_graph_and_the_graph_runs_eagerly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    fail_second_region_compile(monkeypatch)
    torch.manual_seed(4)
    model = Stack().eval()
    x = torch.randn(4, 8)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(model, backend="kiln", options=OPTIONS)(x)
        torch.testing.assert_close(out, model(x), **TOL)
    fallbacks = [w for w in caught if issubclass(w.category, KilnFallbackWarning)]
    assert len(fallbacks) == 1
    text = str(fallbacks[0].message)
    assert "region " in text and "of graph inference_" in text and "injected fault" in text
    assert "stage lowering" in text


def test_stitch_frees_each_value_right_after_its_last_use() -> None:
    alive: list[list[str]] = []
    refs: dict[str, weakref.ref[torch.Tensor]] = {}

    def region(name: str, make: int) -> Any:
        def call(args: list[Any]) -> tuple[Any, ...]:
            args.clear()
            gc.collect()
            alive.append(sorted(n for n, r in refs.items() if r() is not None))
            outs = tuple(torch.full((4,), float(i)) for i in range(make))
            for i, t in enumerate(outs):
                refs[f"{name}.{i}"] = weakref.ref(t)
            return outs
        return call

    v = lambda r, k=0: Source("value", r, k)  # noqa: E731
    steps = [Step(region("a", 2), (Source("input", 0),), (None,), 2),
             Step(region("b", 1), (v(0, 0),), ((1,),), 1),
             Step(region("c", 1), (v(1), v(0, 1)), ((1,), (1,)), 1),
             Step(region("d", 1), (v(2),), ((1,),), 1)]
    plan = schedule(steps, [v(3), Source("none")], 1)
    assert plan.frees == ((0,), (1,), (2, 3), (4,))
    x = torch.randn(4)
    refs["input"] = weakref.ref(x)
    args = [x]
    del x
    out = stitch(steps, [v(3), Source("none")], 1)(args)
    assert out[1] is None and out[0] is not None and not args
    # When a region runs, only values a later region needs are alive (its own inputs
    # are gone too: a compiled region frees them as it goes).
    assert alive == [[], ["a.1"], [], []]


def test_a_stored_plan_is_checked_before_use() -> None:
    from kiln.frontend.core.regions import Plan

    good = {"num_inputs": 1, "outputs": [["value", 0, 0]], "regions": [
        {"key": "a" * 64, "inputs": [["input", 0, 0]], "strides": [None], "constants": [],
         "outputs": 1, "label": "region 0"}]}
    assert Plan.from_wire(good, 1, 0).regions[0].key == "a" * 64
    bad_cases = [
        {**good, "outputs": [["value", 1, 0]]},  # a region that is not there
        {**good, "outputs": [["value", 0, 3]]},  # an output it does not make
        {**good, "regions": [{**good["regions"][0], "inputs": [["input", 5, 0]]}]},
        {**good, "regions": [{**good["regions"][0], "key": "../../etc"}]},
        {**good, "regions": [{**good["regions"][0], "constants": [0]}]},
        {**good, "outputs": [["exec", 0, 0]]},
    ]
    for wire in bad_cases:
        with pytest.raises(ValueError):
            Plan.from_wire(wire, 1, 0)
    with pytest.raises(ValueError):
        Plan.from_wire(good, 2, 0)  # a plan for another graph


@pytest.fixture
def stage_pool_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    from kiln.frontend.core import regions

    monkeypatch.setattr(regions, "_pool", None)
    yield
    if regions._pool is not None:
        regions._pool.close()


def test_graph_stages_run_in_child_processes(stage_pool_env: None) -> None:
    """A process pool for graph stages (here 2 children; on this 2-core machine this
    proves it works, not that it is faster: bench/coldstart.py measures that)."""
    from kiln.frontend.core import regions

    torch.manual_seed(5)
    model = Stack().eval()
    x = torch.randn(4, 8)
    with torch.no_grad():
        _, out = run_compiled(model, x, options={**OPTIONS, "region_processes": 2})
        torch.testing.assert_close(out, model(x), **TOL)
    assert regions._pool is not None and regions._pool.jobs == 3
    assert counters()["compiles_local"] == 3
