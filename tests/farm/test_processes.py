"""Whole-path tests in fresh processes: torch.compile through the farm into an S3 store,
then a second process that hits and runs no compiler; keys stable across processes and
device ordinals."""

from __future__ import annotations

from pathlib import Path

from farm_helpers import RayHead, free_port, python_env, run_python, s3_env

from kiln.workers.ray_farm import RayFarm

# torch.compile of a small model on CPU (Triton's interpreter runs the kernels); prints
# the client's counters and Kiln's warnings. {patch} may forbid the compiler.
MODEL = """
import json, warnings
import torch
{patch}

def model(x, w):
    return torch.softmax(x @ w, -1) * 2 + x.sum()

torch.manual_seed(0)
x, w = torch.randn(8, 16), torch.randn(16, 16)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    compiled = torch.compile(model, backend="kiln", options={{"cpu_backend": "triton-interpret"}})
    out = compiled(x, w)
torch.testing.assert_close(out, model(x, w), rtol=1e-4, atol=1e-4)
from kiln.frontend.core.client import _clients
print(json.dumps({{"counters": [c.counters.snapshot() for c in _clients.values()],
                  "warnings": [str(w.message) for w in caught if "kiln" in str(w.message)]}}))
"""

NO_COMPILER = """
import kiln.compiler.driver, kiln.compiler.kernel_compile, kiln.workers.pipeline
from kiln import compiler, workers

def _compiler_ran(*args, **kwargs):
    raise AssertionError("the compiler ran on a cache hit")

for module, name in [(compiler.driver, "compile_graph"), (compiler.driver, "lower_and_schedule"),
                     (compiler.kernel_compile, "compile_kernel"),
                     (workers.pipeline, "compile_sources"), (workers.pipeline, "compile_kernel")]:
    setattr(module, name, _compiler_ran)
"""

# A request for a CUDA graph whose inputs live on cuda:{ordinal} (fake tensors: no GPU
# here), looked up or compiled through the farm.
ORDINAL = """
import json
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from farm_helpers import CUDA_TARGET, layer_model
from kiln.compiler.decompositions import trace_aten
from kiln.frontend.core.compile import build_request, compile_request
from kiln.frontend.config import KilnConfig

args = [torch.randn(16, 32), torch.randn(32, 32)]
gm = trace_aten(layer_model, args)
with FakeTensorMode():
    inputs = [torch.empty(a.shape, device="cuda:{ordinal}") for a in args]
config = KilnConfig.resolve()
result = compile_request(build_request(gm, inputs, config, target=CUDA_TARGET), config)
print(json.dumps({{"key": result.key.key, "source": result.source,
                  "device": str(inputs[0].device)}}))
"""


def test_second_process_hits_the_s3_store_and_runs_no_compiler(
        farm: RayFarm, ray_cluster: RayHead, s3_server: str, tmp_path: Path) -> None:
    store = s3_env(s3_server, "second-process")
    first = run_python(MODEL.format(patch=""), python_env(
        **store, KILN_FARM=ray_cluster.address, TRITON_INTERPRET="1",
        XDG_CACHE_HOME=str(tmp_path / "first")))
    (counters,) = first["counters"]
    assert counters["misses"] == counters["graphs"] == counters["compiles_farm"] >= 1
    assert first["warnings"] == []
    # A fresh local tier, and a farm address nobody answers: a miss would warn.
    second = run_python(MODEL.format(patch=NO_COMPILER), python_env(
        **store, KILN_FARM=f"127.0.0.1:{free_port()}", TRITON_INTERPRET="1",
        XDG_CACHE_HOME=str(tmp_path / "second")))
    (counters,) = second["counters"]
    assert counters["hits"] == counters["graphs"] >= 1 and "misses" not in counters
    assert second["warnings"] == []
    assert counters["time_saved_s"] > 0


def test_keys_are_stable_across_processes_and_device_ordinals(
        farm: RayFarm, ray_cluster: RayHead, tmp_path: Path) -> None:
    env = python_env(KILN_FARM=ray_cluster.address, KILN_STORE=str(tmp_path / "store"),
                     XDG_CACHE_HOME=str(tmp_path / "cache"))
    on_0 = run_python(ORDINAL.format(ordinal=0), env)
    on_3 = run_python(ORDINAL.format(ordinal=3), env)
    assert (on_0["device"], on_3["device"]) == ("cuda:0", "cuda:3")
    assert on_0["key"] == on_3["key"]
    assert (on_0["source"], on_3["source"]) == ("farm", "hit")
