"""A client that gives the farm up lets go of Ray as it should: it leaves the connection
Kiln opened when the farm is gone and no other farm of the process uses it, and stays
connected when the farm is only slow or another farm still uses the connection."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
from farm_helpers import RayHead, cuda_request, farm_stats, python_env, run_python

from kiln.frontend.config import KilnConfig
from kiln.frontend.core.client import KilnClient, KilnFarmWarning
from kiln.frontend.core.keys import compute_key
from kiln.workers.ray_farm import RayFarm

# A client in a fresh process that joins a cluster (in its own process, or through its farm
# process with KILN_FARM_PROCESS=1), compiles one graph there, then finds the cluster's head
# killed: it must compile the next graphs itself with one warning, let the farm go (leave
# Ray, or see its farm process leave), and carry on.
DEAD_HEAD_CLIENT = """
import json, os, signal, sys, time, warnings
from farm_helpers import cuda_request
from kiln.frontend.core.client import KilnClient, KilnFarmWarning
from kiln.frontend.config import KilnConfig
client = KilnClient(KilnConfig.resolve())
first = client.compile(cuda_request(shapes=((4, 8), (8, 8)))).source
joined = client.farm.joined is not None
child = getattr(client.farm, "_proc", None)
os.killpg({pgid}, signal.SIGKILL)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    start = time.monotonic()
    later = [client.compile(cuda_request(shapes=((4, n), (n, n)))).source for n in (16, 24)]
    elapsed = time.monotonic() - start
print(json.dumps({{"first": first, "joined": joined, "later": later,
                  "warnings": [str(w.message) for w in caught
                               if issubclass(w.category, KilnFarmWarning)],
                  "ray_left": client.farm.joined is None and not (
                      "ray" in sys.modules and sys.modules["ray"].is_initialized()),
                  "child_exit": None if child is None else child.wait(timeout=60),
                  "seconds": elapsed}}))
"""


@pytest.mark.parametrize("farm_process", ["0", "1"], ids=["in-process", "farm-process"])
def test_client_leaves_ray_when_the_farm_dies(tmp_path: Path, farm_process: str) -> None:
    head = RayHead(tmp_path / "head.log", num_cpus=1,
                   env={"XDG_CACHE_HOME": str(tmp_path / "workers")})
    try:
        env = python_env(XDG_CACHE_HOME=str(tmp_path / "cache"), KILN_STORE=str(tmp_path / "s"),
                         KILN_FARM=head.address, KILN_FARM_PROCESS=farm_process)
        out = run_python(DEAD_HEAD_CLIENT.format(pgid=head.proc.pid), env, timeout=300)
    finally:
        head.stop()
    assert (out["first"], out["joined"]) == ("farm", True)
    assert out["later"] == ["local", "local"]
    assert len(out["warnings"]) == 1 and "cannot compile" in out["warnings"][0]
    assert out["ray_left"], "the client stayed connected to a dead cluster"
    assert out["child_exit"] == (0 if farm_process == "1" else None), \
        "the farm process did not leave Ray cleanly"
    assert out["seconds"] < 120, out


def test_a_slow_farm_given_up_keeps_the_connection(farm: RayFarm, ray_cluster: RayHead,
                                                   tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    monkeypatch.setenv("KILN_TEST_COMPILE_DELAY", "5")
    client = KilnClient(KilnConfig.resolve({"farm": ray_cluster.address, "farm_timeout": 1,
                                            "store": str(tmp_path / "store")}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = client.compile(cuda_request(shapes=((6, 40), (40, 40))))
    messages = [str(w.message) for w in caught if issubclass(w.category, KilnFarmWarning)]
    assert result.source == "local" and len(messages) == 1 and "KILN_FARM_TIMEOUT" in messages[0]
    assert ray.is_initialized() and client.farm.joined is not None
    assert farm_stats(farm)["requests"] >= 1  # the session's farm still answers


def test_a_farm_let_go_leaves_ray_to_the_farms_still_using_it(farm: RayFarm,
                                                              ray_cluster: RayHead) -> None:
    import ray

    other = RayFarm(ray_cluster.address)
    before = farm_stats(other)
    other.release()
    assert ray.is_initialized() and other.joined is None
    request = cuda_request(shapes=((6, 44), (44, 44)))
    compiled = farm.compile(compute_key(request).key, request)
    assert compiled.kernels and farm_stats(farm)["graph_compiles"] == before["graph_compiles"] + 1
