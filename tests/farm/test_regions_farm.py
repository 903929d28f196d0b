"""Regional compilation through a real farm: the distinct regions of a 6-block graph are
submitted at once, each compiled once by the farm's workers, and the stitched result
matches eager (also when the graph returns before its regions are compiled, as a
training frame's forward and backward do when they compile at once). With two compile
workers, a deep graph's regions compile on both at once, and its kernels in several
kernel processes (the timeline names each span's process)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from farm_helpers import farm_stats

from kiln.compiler import trace
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.client import KilnClient
from kiln.frontend.core.compile import build_request
from kiln.frontend.core.regions import (
    DeferredGraph,
    compile_regional,
    overlap_backward,
    regions_deferred,
)
from kiln.workers.ray_farm import RayFarm
from tests.regions_models import Stack, aten_graph


def test_distinct_regions_compile_once_each_on_the_farm(farm: RayFarm) -> None:
    torch.manual_seed(7)
    model = Stack(d=24).eval()
    gm, args = aten_graph(model, torch.randn(4, 8))
    config = KilnConfig.resolve({"regions": "on", "region_nodes": 15})
    client = KilnClient(config, farm=farm)
    before = farm_stats(farm)
    fn = compile_regional(client, gm, args, config, "inference_farm",
                          build_request(gm, args, config))
    assert fn is not None
    x = torch.randn(4, 8)  # fresh values through the stitched regions
    with torch.no_grad():
        (out,) = fn([x, *[p.detach() for p in model.parameters()]])
        torch.testing.assert_close(out, model(x), atol=1e-4, rtol=1e-4)
    after = farm_stats(farm)
    c = client.counters.snapshot()
    assert (c["regions"], c["regions_distinct"]) == (6, 3)
    assert c["compiles_farm"] == 3 and c.get("compiles_local", 0) == 0
    assert after["requests"] - before["requests"] == 3
    assert after["graph_compiles"] - before["graph_compiles"] == 3


def test_a_deferred_training_graph_returns_at_submit_and_waits_at_its_first_call(
        farm: RayFarm) -> None:
    """What the backend does when a training frame's backward compiles beside its
    forward: the regional graph comes back while its regions are on the farm."""
    torch.manual_seed(13)
    model = Stack(d=28).eval()  # sizes no other test compiles
    gm, args = aten_graph(model, torch.randn(4, 8))
    config = KilnConfig.resolve({"regions": "on", "region_nodes": 15})
    client = KilnClient(config, farm=farm)
    with regions_deferred():
        fn = compile_regional(client, gm, args, config, "forward_farm",
                              build_request(gm, args, config))
    assert isinstance(fn, DeferredGraph)
    assert "regional_graphs" not in client.counters.snapshot()  # counted once loaded
    x = torch.randn(4, 8)
    with torch.no_grad():
        (out,) = fn([x, *[p.detach() for p in model.parameters()]])
        torch.testing.assert_close(out, model(x), atol=1e-4, rtol=1e-4)
    c = client.counters.snapshot()
    assert (c["regional_graphs"], c["regions"], c["regions_distinct"]) == (1, 6, 3)
    assert c["compiles_farm"] == 3 and c.get("compiles_local", 0) == 0


def test_the_backend_overlaps_farm_work_only_with_a_farm_and_a_graph_to_cut(
        farm: RayFarm) -> None:
    options = {"regions": "on", "region_nodes": 15}
    large = torch.fx.symbolic_trace(Stack(layers=6))
    small = torch.fx.symbolic_trace(torch.nn.Linear(4, 4))
    through_farm = KilnConfig.resolve({**options, "farm": str(farm.address)})
    assert overlap_backward(large, through_farm)
    assert not overlap_backward(small, through_farm)
    assert not overlap_backward(large, KilnConfig.resolve({**options, "farm": "inprocess"}))
    assert not overlap_backward(large, KilnConfig.resolve({**options, "regions": "off",
                                                           "farm": str(farm.address)}))


@pytest.fixture(scope="module")
def two_worker_farm(farm: RayFarm) -> Iterator[RayFarm]:
    """A second coordinator on the session's cluster, with two compile workers (the
    session's has one: its cluster has 2 CPUs, and a farm starts one per two CPUs)."""
    import ray

    from kiln.workers.coordinator import get_farm_actor

    two = RayFarm(farm.address, graph_workers=2)
    two._actor = get_farm_actor(2, name="KilnFarmTwoWorkers")
    ray.get(two._actor.wait_warm.remote(), timeout=240)
    assert ray.get(two._actor.ping.remote())["graph_workers"] == 2
    yield two
    ray.kill(two._actor)


# Seconds each region's compile call sleeps before it starts (the workers' test delay), so
# that the call lasts much longer than the time between the client's three submissions
# even on a loaded machine. A region's graph stage alone takes a fraction of a second,
# less than it can take a loaded machine to start a worker on the next one: whether two
# stages overlapped was a matter of timing, whether two calls did is one of scheduling.
CALL_DELAY_S = 2.0


@dataclass(frozen=True)
class _Call:
    """A region's compile call on a worker: its process, and when it began (the delay
    before the request's deserialization) and ended (its graph stage's end), in us."""

    pid: int
    began: float
    ended: float

    def overlaps(self, other: _Call) -> bool:
        return self.began < other.ended and other.began < self.ended


def _calls(events: list[trace.Event]) -> list[_Call]:
    began = {e["args"]["key"]: float(e["ts"]) - CALL_DELAY_S * 1e6 for e in events
             if e["name"] == "deserialize request"}
    return [_Call(int(e["pid"]), began[e["args"]["key"]], float(e["ts"]) + float(e["dur"]))
            for e in events if e["name"] == "graph stage"]


def test_a_deep_graph_spreads_over_compile_workers_and_kernel_processes(
        two_worker_farm: RayFarm, recording: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_TEST_COMPILE_DELAY", str(CALL_DELAY_S))
    torch.manual_seed(11)
    model = Stack(d=40, layers=8).eval()  # sizes no other test compiles: fresh kernels
    gm, args = aten_graph(model, torch.randn(6, 8))
    config = KilnConfig.resolve({"regions": "on", "region_nodes": 15})
    client = KilnClient(config, farm=two_worker_farm)
    fn = compile_regional(client, gm, args, config, "inference_deep",
                          build_request(gm, args, config))
    assert fn is not None
    x = torch.randn(6, 8)
    with torch.no_grad():
        (out,) = fn([x, *[p.detach() for p in model.parameters()]])
        torch.testing.assert_close(out, model(x), atol=1e-4, rtol=1e-4)
    c = client.counters.snapshot()
    assert (c["regions"], c["regions_distinct"], c["compiles_farm"]) == (8, 3, 3)
    events = trace.events()
    stages = [e for e in events if e["name"] == "graph stage"]
    assert len(stages) == 3  # each distinct region once
    assert {e["args"]["process"] for e in stages} == {"compile worker"}
    assert len({e["pid"] for e in stages}) == 2, "the regions did not use both workers"
    calls = _calls(events)
    assert any(a.overlaps(b) for a in calls for b in calls if a.pid != b.pid), \
        "no two regions compiled at once"
    kernels = [e for e in events if e["name"] == "kernel compile"]
    assert kernels and all(e["pid"] != os.getpid() for e in kernels)
    assert {e["args"]["process"] for e in kernels} == {"kernel worker"}
    assert len({e["pid"] for e in kernels}) >= 2, "kernels compiled in one process"
    # One round trip per distinct region: nothing went back and forth per kernel.
    waits = [e for e in events if e["name"] == "farm compile (client waits)"]
    assert len(waits) == 3
