"""With a farm up, tuning runs on the farm's GPU autotuners, never in the client: a
client that could benchmark here (the fake benchmark stands in for a GPU of the target's
arch) compiles through a real Ray farm with a (fake) GPU, calls the loaded graph, and
gets the tuned kernels from the farm's answer, having benchmarked nothing itself; its
dynamic-size kernels are not tuned here either. The farm's autotuner shares its GPU
(``KILN_AUTOTUNE_GPU_SHARED=1``: a one-GPU `kiln farm up` box) and times in turns, with
the same choices."""

from __future__ import annotations

from pathlib import Path

from farm_helpers import RayHead, python_env, run_python

CLIENT = """
import json
from farm_helpers import cuda_request
from kiln.compiler import trace
from kiln.frontend.core.client import KilnClient
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.hotswap import SwappableGraph
from kiln.workers import gpu_share
from kiln.workers.artifact import from_artifact
from kiln.workers.pipeline import local_autotune

client = KilnClient(KilnConfig.resolve())
request = cuda_request(shapes=((16, 32), (32, 32)))
assert local_autotune(request), "the client could tune here: the rule must stop it"
with trace.capture() as events:
    result = client.compile(request)
    builds = []
    def build(compiled, hook):
        builds.append((compiled.autotuned, hook is not None))
        return lambda args: [a + 1 for a in args]
    graph = SwappableGraph(build, result.compiled, client, result.key, request)
    outs = [graph([i])[0] for i in range(50)]
    assert client.tuner.wait(300)
    outs += [graph([i])[0] for i in range(5)]
tuned = from_artifact(client.store.get(result.key.key))
print(json.dumps({
    "source": result.source, "farm_serves": client.farm_serves(),
    "first_pending": bool(result.compiled.stats.get("autotune_pending")),
    "autotuned": tuned.autotuned, "builds": builds, "swaps": graph.swaps,
    "outs_ok": outs == [i + 1 for i in range(50)] + [i + 1 for i in range(5)],
    "local_share": gpu_share.current() is not None,
    "local_benchmarks": [e["name"] for e in events if e.get("args", {}).get("gpu") == "local"
                         or e["name"] in ("gpu turn", "autotune heuristic")],
    "chosen": {s.name: tuned.configs[s.name] for s in tuned.kernels},
    "candidates": {s.name: list(s.configs) for s in tuned.kernels}}))
"""


def test_with_a_farm_up_the_farm_tunes_and_the_client_benchmarks_nothing(
        tmp_path: Path) -> None:
    # One CPU, one kernel worker: nothing here compiles in parallel.
    head = RayHead(tmp_path / "gpu-head.log", num_cpus=1, num_gpus=1,
                   env={"KILN_TEST_FAKE_AUTOTUNE": "1", "KILN_AUTOTUNE_GPU_SHARED": "1",
                        "KILN_TEST_FAKE_AUTOTUNE_MS": "5",
                        "XDG_CACHE_HOME": str(tmp_path / "workers")})
    try:
        out = run_python(CLIENT, python_env(
            KILN_FARM=head.address, KILN_STORE=str(tmp_path / "store"),
            KILN_TEST_FAKE_AUTOTUNE="1", XDG_CACHE_HOME=str(tmp_path / "client")))
    finally:
        head.stop()
    assert out["source"] == "farm" and out["farm_serves"] is True
    assert out["first_pending"] is True and out["autotuned"] is True
    # Nothing benchmarked here: no share of this GPU was ever made, no span of one.
    assert out["local_share"] is False and out["local_benchmarks"] == []
    # The farm's tuned graph came through its answer and was switched to; the graph got
    # no bucket hook (no client-side bucket tuning with a farm up).
    assert out["builds"] == [[False, False], [True, False]] and out["swaps"] == 1
    assert out["outs_ok"]
    for name, candidates in out["candidates"].items():
        if len(candidates) > 1:  # the fake benchmark's choice: the most warps
            most = max(candidates, key=lambda c: (c["num_warps"], -candidates.index(c)))
            assert out["chosen"][name] == most
