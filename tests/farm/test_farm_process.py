"""A client reaches a real farm through its child process (frontend.transports.process): the
client never imports Ray, its graphs compile on the farm and match eager, the child's
join is on the client's timeline (off the first output's path), a compile error keeps
its key, stage and op across both hops, and the child leaves once the client ends."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from farm_helpers import RayHead, cuda_request, failing_lowering_request, python_env, run_python

from kiln.compiler import trace
from kiln.frontend.core.keys import compute_key
from kiln.frontend.trace import critical_path, load_spans
from kiln.frontend.transports.process import ProcessFarm
from kiln.workers.pipeline import CompileFailure
from kiln.workers.ray_farm import RayFarm

CLIENT = """
import json, sys, time, warnings
import torch
from kiln.frontend.core.fallback import KilnFallbackWarning
from kiln.frontend.core.client import client_for
from kiln.frontend.config import KilnConfig

warnings.simplefilter("error", KilnFallbackWarning)

def model(x, w):
    return torch.tanh(torch.softmax(x @ w, -1) * 2 + x.sum(0))

x, w = torch.randn(8, 24), torch.randn(24, 24)
compiled = torch.compile(model, backend="kiln", options={"cpu_backend": "triton-interpret"})
torch.testing.assert_close(compiled(x, w), model(x, w), rtol=1e-4, atol=1e-4)
x2 = torch.randn(8, 24)
torch.testing.assert_close(compiled(x2, w), model(x2, w), rtol=1e-4, atol=1e-4)
farm = client_for(KilnConfig.resolve()).farm
print(json.dumps({"counters": client_for(KilnConfig.resolve()).counters.snapshot(),
                  "farm": type(farm).__name__, "child": farm._proc.pid,
                  "ray_imported": "ray" in sys.modules, "printed_at": time.time()}))
"""


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


def test_a_client_compiles_on_the_farm_without_importing_ray(
        farm: RayFarm, ray_cluster: RayHead, tmp_path: Path) -> None:
    timeline = tmp_path / "t.json"
    env = python_env(XDG_CACHE_HOME=str(tmp_path / "cache"), KILN_STORE=str(tmp_path / "s"),
                     KILN_FARM=ray_cluster.address, KILN_FARM_PROCESS="1", TRITON_INTERPRET="1",
                     KILN_TRACE=str(timeline))
    out = run_python(CLIENT, env, timeout=300)
    assert "Traceback" not in out["_stderr"], out["_stderr"][-3000:]
    counters = out["counters"]
    assert counters["graphs"] == counters["compiles_farm"] == 1, counters
    assert counters.get("farm_fallbacks", 0) == 0
    assert out["farm"] == "ProcessFarm" and out["ray_imported"] is False
    assert _gone(int(out["child"]), 60), "the farm process outlived its client by 60 s"
    events = json.loads(timeline.read_text())["traceEvents"]
    joins = [e for e in events if e.get("name") == "join the farm (child process)"]
    assert len(joins) == 1 and joins[0]["pid"] == out["child"]
    assert joins[0]["args"]["background"] is True
    path = {s.name for s in critical_path(load_spans(timeline))}
    assert "join the farm (child process)" not in path and "lowering" in path


def test_a_compile_error_keeps_key_stage_and_op_through_the_child(
        farm: RayFarm, ray_cluster: RayHead) -> None:
    proxied = ProcessFarm(ray_cluster.address)
    try:
        request = failing_lowering_request()
        key = compute_key(request).key
        with pytest.raises(CompileFailure) as info:
            proxied.compile(key, request, timeout=120)
        error = info.value
        assert (error.stage, error.op, error.key) == ("lowering", "aten.div.Tensor_mode", key)
        # And a graph that compiles comes back whole, its farm spans merged here.
        trace.clear()
        trace.enable(True)
        good = cuda_request(shapes=((8, 40), (40, 40)), options={"tag": "process"})
        compiled = proxied.compile(compute_key(good).key, good, timeout=120)
        assert compiled.binaries and compiled.wrapper_source
        names = {e["name"] for e in trace.events()}
        assert {"farm compile (client waits)", "graph stage"} <= names
    finally:
        trace.enable(False)
        trace.clear()
        proxied.release()
