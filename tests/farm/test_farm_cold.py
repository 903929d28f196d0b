"""The compile timeline through a real farm: one traced request brings back the spans of
the coordinator, the compile worker's passes and each kernel compile with the process
that ran it, and the critical path runs through the farm's work. The farm's kernels
shared through its store by content key. A farm warmed by a process that then left (as
`kiln farm up` does) compiles its first request's kernels in the processes it warmed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from farm_helpers import RayHead, cuda_request, farm_stats, python_env, run_python

from kiln.compiler import trace
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.client import KilnClient
from kiln.frontend.core.keys import compute_key
from kiln.frontend.trace import Span, critical_path
from kiln.frontend.transports.inprocess import InProcessFarm
from kiln.workers.ray_farm import RayFarm


def test_a_traced_farm_compile_carries_every_process_spans(farm: RayFarm,
                                                           recording: None) -> None:
    request = cuda_request(shapes=((8, 56), (56, 56)), options={"tag": "trace"})
    compiled = farm.compile(compute_key(request).key, request)
    events = trace.events()
    by_name: dict[str, list[trace.Event]] = {}
    for event in events:
        by_name.setdefault(event["name"], []).append(event)
    for stage in ("farm compile (client waits)", "farm request", "queue for a compile worker",
                  "deserialize request", "graph stage", "lowering", "scheduling and fusion",
                  "memory plan", "codegen", "kernel fan-out", "kernel compile"):
        assert stage in by_name, stage
    process = {e["name"]: e["args"]["process"] for e in events}
    assert process["graph stage"] == "compile worker"
    assert process["farm request"] == "farm coordinator"
    assert process["farm compile (client waits)"] == "client"
    kernels = by_name["kernel compile"]
    assert len(kernels) == len(compiled.binaries)  # fresh kernels: one span each
    assert {e["args"]["process"] for e in kernels} == {"kernel worker"}
    assert all(e["pid"] != os.getpid() for e in kernels)
    assert {e["args"]["kernel"] for e in kernels} == set(compiled.binaries)
    spans = [Span(e["name"], e["ts"], e["ts"] + e["dur"], e["pid"], e["tid"],
                  e["args"]["process"], e["cat"]) for e in events]
    path = {s.name for s in critical_path(spans)}
    assert "kernel compile" in path and "lowering" in path
    assert "farm compile (client waits)" not in path  # the wait is not work
    # The same request again: compiled once already, no kernel compiles to show.
    trace.clear()
    farm.compile(compute_key(request).key, request)
    assert not [e for e in trace.events() if e["name"] == "kernel compile"]


def test_the_farm_finds_kernels_in_its_store_by_content_key(farm: RayFarm) -> None:
    """Kernels compiled elsewhere (here: a client compiling in process into the farm's
    store) are not compiled again by a farm that never saw them."""
    import ray

    farm_store = ray.get(farm.actor().ping.remote())["kernel_store"]
    assert farm_store
    local = KilnClient(KilnConfig.resolve({"store": farm_store, "farm": "inprocess"}),
                       farm=InProcessFarm())
    first = cuda_request(shapes=((8, 72), (72, 72)), options={"tag": "local"})
    compiled = local.compile(first).compiled
    assert local.counters.snapshot()["kernels_compiled"] == len(compiled.binaries) > 0
    before = farm_stats(farm)
    second = cuda_request(shapes=((8, 72), (72, 72)), options={"tag": "farm"})
    again = farm.compile(compute_key(second).key, second)
    after = farm_stats(farm)
    assert after.get("kernel_store_hits", 0) - before.get("kernel_store_hits", 0) == \
        len(compiled.binaries)
    assert after.get("kernel_compiles", 0) == before.get("kernel_compiles", 0)
    for name, binary in compiled.binaries.items():
        assert again.binaries[name].binary == binary.binary


WARM_AND_LEAVE = """
import json, ray
from kiln.workers.ray_farm import use_auth_token
from kiln.workers.coordinator import get_farm_actor
use_auth_token()
ray.init(address="{ADDRESS}", log_to_driver=False)
actor = get_farm_actor(1, name="KilnFarmWarmedByAnother")
ray.get(actor.wait_warm.remote(), timeout=300)
print(json.dumps({{"pids": ray.get(actor.kernel_worker_pids.remote())}}))
ray.shutdown()
"""


def test_a_farm_warmed_by_a_process_that_left_compiles_in_its_warm_kernel_workers(
        farm: RayFarm, ray_cluster: RayHead, recording: None) -> None:
    """`kiln farm up` warms the farm from a driver that then exits, ending its Ray job:
    Ray's task processes of that job went with it, so the first request used to start
    new processes (6.3 s on the H200 host) and pay Triton's start-up in each kernel.
    The kernel workers are actors of the coordinator: they stay, warm."""
    import ray

    from kiln.workers.coordinator import farm_namespace

    warmed = run_python(WARM_AND_LEAVE.format(ADDRESS=ray_cluster.address), python_env(),
                        timeout=400)["pids"]
    assert len(warmed) == 2  # one per CPU of the session's cluster
    left = RayFarm(farm.address)
    left._actor = ray.get_actor("KilnFarmWarmedByAnother", namespace=farm_namespace())
    try:
        request = cuda_request(shapes=((8, 88), (88, 88)), options={"tag": "warmed"})
        compiled = left.compile(compute_key(request).key, request)
        kernels = [e for e in trace.events() if e["name"] == "kernel compile"]
        assert len(kernels) == len(compiled.binaries) > 0
        assert {e["pid"] for e in kernels} <= set(warmed)
        assert sorted(ray.get(left._actor.kernel_worker_pids.remote())) == sorted(warmed)
    finally:
        ray.kill(left._actor)


CONNECT_EARLY = """
import json, sys, threading, time
from farm_helpers import cuda_request
from kiln.frontend.core.client import KilnClient
from kiln.frontend.config import KilnConfig
client = KilnClient(KilnConfig.resolve())
assert "ray" not in sys.modules
client.connect_farm_early()  # what the backend does before AOTAutograd's trace
connecting = [t for t in threading.enumerate() if t.name == "kiln-farm-connect"]
for thread in connecting:
    thread.join(120)
farm = client.farm
if hasattr(farm, "_actor"):  # joined here, on a thread
    joined = farm._actor is not None
else:  # the farm process started at once; it joins on its own
    joined = farm._proc is not None and farm._proc.poll() is None
result = client.compile(cuda_request(shapes=((8, 40), (40, 40)), options={"tag": "early"}))
print(json.dumps({"threads": len(connecting), "joined": joined, "source": result.source,
                  "ray_here": "ray" in sys.modules}))
"""


@pytest.mark.parametrize("in_process", [False, True], ids=["farm-process", "thread"])
def test_the_client_joins_the_farm_in_the_background_before_its_first_miss(
        farm: RayFarm, ray_cluster: RayHead, tmp_path: Path, in_process: bool) -> None:
    """A thread of the client connects: with KILN_FARM_PROCESS=1 it starts the farm
    process (no Ray here at all); with 0 (the default for a Ray address) it joins Ray."""
    env = python_env(KILN_FARM=ray_cluster.address, KILN_STORE=str(tmp_path / "store"),
                     XDG_CACHE_HOME=str(tmp_path / "client-cache"),
                     KILN_FARM_PROCESS="0" if in_process else "1")
    out = run_python(CONNECT_EARLY, env, timeout=300)
    assert out == {"threads": 1, "joined": True, "source": "farm",
                   "ray_here": in_process, "_stderr": out["_stderr"]}
