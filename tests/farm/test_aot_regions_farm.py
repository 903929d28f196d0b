"""The AOT cache and regional graphs deferred on a real farm: a training step whose
forward and backward are cut into regions compiles both on the farm at once (each a
``DeferredGraph`` until its first call); the AOT entry is published once both plans are
stored, and a second process (an S3 store, no farm, the compiler forbidden) serves the
step with no AOTAutograd trace, its loss and gradients equal eager's on fresh inputs."""

from __future__ import annotations

from pathlib import Path

from farm_helpers import RayHead, free_port, python_env, run_python, s3_env

from kiln.workers.ray_farm import RayFarm
from tests.aot_children import COUNT_AOT_TRACES

STEP = """
import json, os, warnings
import torch
{patch}
""" + COUNT_AOT_TRACES + """
class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln, self.fc1, self.fc2 = (torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d),
                                       torch.nn.Linear(2 * d, d))
    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln(x))))

class Stack(torch.nn.Module):
    def __init__(self, d=20, layers=6):
        super().__init__()
        self.inp = torch.nn.Linear(8, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.head = torch.nn.Linear(d, 4)
    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

torch.manual_seed({seed})  # fresh weights and inputs in each process
model = Stack()
x = torch.randn(4, 8)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    loss = torch.compile(model, backend="kiln")(x).square().mean()
    loss.backward()
got = [loss.detach()] + [p.grad.clone() for p in model.parameters()]
model.zero_grad(set_to_none=True)
ref = model(x).square().mean()
ref.backward()
want = [ref.detach()] + [p.grad.clone() for p in model.parameters()]
error = max((g - w).abs().max().item() for g, w in zip(got, want))
from kiln.frontend.core.client import _clients
counters = {{}}
for client in _clients.values():
    counters.update(client.counters.snapshot())
print(json.dumps({{"counters": counters, "traces": len(traces), "error": error,
                  "warnings": [str(w.message) for w in caught if "kiln" in str(w.message)]}}))
"""

NO_COMPILER = """
from kiln import compiler, workers
import kiln.compiler.driver, kiln.workers.pipeline

def _compiler_ran(*args, **kwargs):
    raise AssertionError("the compiler ran on a warm start")

for module, name in [(compiler.driver, "compile_graph"), (workers.pipeline, "compile_sources")]:
    setattr(module, name, _compiler_ran)
"""


def test_a_deferred_regional_training_step_is_served_warm(
        farm: RayFarm, ray_cluster: RayHead, s3_server: str, tmp_path: Path) -> None:
    store = s3_env(s3_server, "aot-regions")
    regions = {"KILN_REGIONS": "on", "KILN_REGION_NODES": "15"}
    cold = run_python(STEP.format(patch="", seed=1), python_env(
        **store, **regions, KILN_FARM=ray_cluster.address,
        XDG_CACHE_HOME=str(tmp_path / "cold")), timeout=600)
    c = cold["counters"]
    assert cold["error"] < 1e-4 and cold["warnings"] == [], cold
    assert c["regional_graphs"] == 2 and c.get("compiles_farm", 0) >= 2, c
    assert c.get("compiles_local", 0) == 0 and c.get("aot_publishes") == 1, c
    # A fresh local tier and a farm nobody answers: a miss would compile here (forbidden).
    warm = run_python(STEP.format(patch=NO_COMPILER, seed=2), python_env(
        **store, **regions, KILN_FARM=f"127.0.0.1:{free_port()}",
        XDG_CACHE_HOME=str(tmp_path / "warm")), timeout=600)
    w = warm["counters"]
    assert warm["error"] < 1e-4 and warm["warnings"] == [], warm
    assert warm["traces"] == 0, w
    assert (w.get("aot_hits"), w.get("aot_region_plans"), w.get("aot_traces", 0)) \
        == (1, 2, 0), w
    assert w["hits"] == w["graphs"] >= 4 and not w.get("misses"), w
