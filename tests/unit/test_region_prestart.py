"""When the graph-stage processes start ahead of AOTAutograd (``frontend.core.regions``'s
``prestart``): only for a Dynamo graph likely to make an ATen graph that is cut, so a
model like GPT-2 (715 Dynamo nodes, 929 ATen nodes: never cut) starts no processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kiln.frontend.config import KilnConfig
from kiln.frontend.core import regions


def dynamo_like_graph(nodes: int) -> torch.fx.GraphModule:
    """A graph of about ``nodes`` nodes (placeholder, a chain of adds, output)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    value = x
    for _ in range(nodes - 2):
        value = graph.call_function(torch.add, (value, 1))
    graph.output(value)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    calls: list[Any] = []
    monkeypatch.setattr(regions, "stage_pool", lambda config: calls.append(config))
    monkeypatch.setattr(regions, "compiles_here", lambda client: True)
    return calls


@pytest.mark.parametrize("nodes, regions_mode, expected", [
    (715, "auto", False),    # GPT-2's Dynamo graph: its ATen graph (929) is not cut
    (829, "auto", False),    # the 24-layer decoder's (1728 ATen nodes, under 2000)
    (1200, "auto", True),    # 2400 ATen nodes at 2 a node: cut
    (150, "on", True),       # "on" cuts any graph of two regions (200 nodes)
    (50, "on", False),
    (5000, "off", False),
])
def test_prestart_only_for_graphs_likely_cut(nodes: int, regions_mode: str, expected: bool,
                                             started: list[Any]) -> None:
    config = KilnConfig.resolve({"regions": regions_mode, "region_processes": "2"})
    gm = dynamo_like_graph(nodes)
    assert len(gm.graph.nodes) == nodes
    regions.prestart(gm, config)
    assert bool(started) is expected
    assert regions.likely_cut(gm, config) is expected


def test_no_prestart_with_fewer_than_two_processes(started: list[Any]) -> None:
    config = KilnConfig.resolve({"regions": "on", "region_processes": "0"})
    regions.prestart(dynamo_like_graph(5000), config)
    assert not started
