"""Regional compilation through a real farm: the distinct regions of a 6-block graph are
submitted at once, each compiled once by the farm's workers, and the stitched result
matches eager."""

from __future__ import annotations

import torch
from farm_helpers import farm_stats

from kiln.frontend.client import KilnClient
from kiln.frontend.compile import build_request
from kiln.frontend.config import KilnConfig
from kiln.frontend.farm import RayFarm
from kiln.frontend.regions import compile_regional
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
