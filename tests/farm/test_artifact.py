"""CompiledGraph <-> store Artifact, and autotuning's plumbing on a cluster with a GPU
resource (the benchmark itself faked: this machine has no GPU)."""

from __future__ import annotations

from pathlib import Path

from farm_helpers import RayHead, cuda_request, python_env, run_python

from kiln.artifact_store import open_store
from kiln.frontend.core.keys import PART_NAMES, compute_key
from kiln.workers.artifact import WRAPPER_BLOB, from_artifact, to_artifact
from kiln.workers.pipeline import compile_inprocess


def test_artifact_round_trip_through_the_store(tmp_path: Path) -> None:
    request = cuda_request(shapes=((16, 32), (32, 32)))
    key = compute_key(request)
    compiled = compile_inprocess(request.to_bytes(), key.key)
    artifact = to_artifact(key, request, compiled, {"wall_s": 1.5, "mode": "local"})
    names = set(artifact.blobs)
    assert WRAPPER_BLOB in names
    for spec in compiled.kernels:
        assert {f"kernels/{spec.name}.py", f"kernels/{spec.name}.cubin"} <= names
    manifest = artifact.manifest
    assert list(manifest["key_parts"]) == list(PART_NAMES) and manifest["key"] == key.key
    assert manifest["target"]["arch"] == 90 and manifest["versions"] == request.versions
    for entry in manifest["kernels"]:
        assert entry["config"] == entry["configs"][0] and entry["autotune"] is None
        assert {"num_warps", "num_stages", "shared"} <= set(entry["launch"])
        assert len(entry["arg_bytes"]) == len(entry["arg_buffers"])
    store = open_store(f"file://{tmp_path}/store", stats_file=False)
    assert store.publish(artifact)
    loaded = from_artifact(store.get(key.key))  # type: ignore[arg-type]
    assert loaded.to_dict() == compiled.to_dict()


# A client that compiles one request through the farm at KILN_FARM and prints how its
# kernels' configs were chosen.
AUTOTUNE_CLIENT = """
import json
from farm_helpers import cuda_request
from kiln.frontend.core.client import KilnClient
from kiln.frontend.config import KilnConfig
from kiln.workers.artifact import from_artifact
client = KilnClient(KilnConfig.resolve())
result = client.compile(cuda_request(shapes=((16, 32), (32, 32))))
first = result.compiled
assert client.tuner.wait(300)
compiled = from_artifact(client.store.get(result.key.key))
print(json.dumps({"source": result.source, "autotuned": compiled.autotuned,
                  "first_autotuned": first.autotuned,
                  "first_pending": first.stats.get("autotune_pending", False),
                  "publishes": client.counters.snapshot().get("autotune_publishes", 0),
                  "chosen": {s.name: compiled.configs[s.name] for s in compiled.kernels},
                  "candidates": {s.name: list(s.configs) for s in compiled.kernels},
                  "records": compiled.stats.get("autotune", {})}))
"""


def test_gpu_autotuners_time_candidates_and_keep_the_fastest(tmp_path: Path) -> None:
    # One CPU, one kernel worker: nothing here compiles in parallel.
    head = RayHead(tmp_path / "gpu-head.log", num_cpus=1, num_gpus=1,
                   env={"KILN_TEST_FAKE_AUTOTUNE": "1",
                        "XDG_CACHE_HOME": str(tmp_path / "workers")})
    try:
        out = run_python(AUTOTUNE_CLIENT, python_env(
            KILN_FARM=head.address, KILN_STORE=str(tmp_path / "store"),
            XDG_CACHE_HOME=str(tmp_path / "client")))
    finally:
        head.stop()
    assert out["source"] == "farm" and out["autotuned"] is True
    # The first answer came from heuristic configs; the tuned artifact came after it.
    assert out["first_autotuned"] is False and out["first_pending"] is True
    assert out["publishes"] == 1
    for name, candidates in out["candidates"].items():
        if len(candidates) < 2:
            continue
        # The fake benchmark makes the config with the most warps the fastest.
        most_warps = max(candidates, key=lambda c: (c["num_warps"], -candidates.index(c)))
        assert out["chosen"][name] == most_warps
        record = out["records"][name]
        assert [r["config"] for r in record] == candidates
        assert min(record, key=lambda r: r["ms"])["config"] == most_warps
