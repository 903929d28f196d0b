"""The farm on a real local Ray cluster: identical artifacts in every mode, kernels and
graphs compiled once however many ask, workers killed mid-compile, errors and outages."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from farm_helpers import (
    RayHead,
    blob_digests,
    complex_model,
    cuda_request,
    failing_lowering_request,
    farm_stats,
    free_port,
    python_env,
    run_python,
)

from kiln.frontend.config import KilnConfig
from kiln.frontend.core.client import KilnClient, KilnFarmWarning
from kiln.frontend.core.keys import compute_key
from kiln.workers.pipeline import CompileFailure
from kiln.workers.ray_farm import RayFarm

# A client in a fresh process: compiles the helpers' request and prints what it got.
CLIENT = """
import json
from farm_helpers import blob_digests, cuda_request
from kiln.frontend.core.client import KilnClient
from kiln.frontend.config import KilnConfig
request = cuda_request(shapes={shapes!r})
client = KilnClient(KilnConfig.resolve())
result = client.compile(request)
artifact = client.store.get(result.key.key)
print(json.dumps({{"key": result.key.key, "source": result.source,
                  "digests": blob_digests(artifact)}}))
"""


def client_for(farm: str, store: Path, **options: object) -> KilnClient:
    return KilnClient(KilnConfig.resolve({"farm": farm, "store": str(store), **options}))


def subprocess_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    return python_env(XDG_CACHE_HOME=str(tmp_path / "sub-cache"), **extra)


def test_inprocess_local_and_cluster_artifacts_are_byte_identical(
        farm: RayFarm, ray_cluster: RayHead, tmp_path: Path) -> None:
    shapes = ((16, 32), (32, 32))
    request = cuda_request(shapes=shapes)
    found = {}
    for mode in ("inprocess", ray_cluster.address):
        client = client_for(mode, tmp_path / f"store-{len(found)}")
        result = client.compile(request)
        assert result.source == ("local" if mode == "inprocess" else "farm")
        found[mode] = blob_digests(client.store.get(result.key.key))
    # The embedded mode: a fresh process starts its own Ray with this machine's CPUs
    # (`local`, the default, would compile in process: no farm is up).
    # It starts Ray, a coordinator and a worker per CPU before it compiles, which on cores
    # shared with other work can outlast the helper's default timeout.
    env = subprocess_env(tmp_path, KILN_FARM="embedded", KILN_STORE=str(tmp_path / "store-l"))
    local = run_python(CLIENT.format(shapes=shapes), env, timeout=900)
    assert local["source"] == "farm", local["_stderr"][-3000:]
    assert local["key"] == compute_key(request).key
    found["local"] = local["digests"]
    assert found["inprocess"] == found[ray_cluster.address] == found["local"]
    assert any(name.endswith(".cubin") for name in found["local"])


def test_identical_kernels_compile_once_across_graphs(farm: RayFarm) -> None:
    first = cuda_request(shapes=((8, 24), (24, 24)), options={"tag": "a"})
    second = cuda_request(shapes=((8, 24), (24, 24)), options={"tag": "b"})
    before = farm_stats(farm)
    compiled = farm.compile(compute_key(first).key, first)
    middle = farm_stats(farm)
    again = farm.compile(compute_key(second).key, second)
    after = farm_stats(farm)
    kernels = len(compiled.binaries)
    assert kernels == 3 and compiled.binaries.keys() == again.binaries.keys()
    assert middle["kernel_compiles"] - before.get("kernel_compiles", 0) == kernels
    assert after["graph_compiles"] - middle["graph_compiles"] == 1
    assert after["kernel_compiles"] == middle["kernel_compiles"]
    assert after["kernel_cache_hits"] - middle.get("kernel_cache_hits", 0) == kernels
    assert not compiled.autotuned  # no GPU in this cluster: heuristic configs, recorded
    for spec in compiled.kernels:
        assert compiled.configs[spec.name] == spec.configs[0]


def test_concurrent_requests_for_one_key_compile_once(farm: RayFarm) -> None:
    request = cuda_request(shapes=((12, 40), (40, 40)))
    key = compute_key(request).key
    before = farm_stats(farm)
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: farm.compile(key, request, delay=2.0), range(4)))
    after = farm_stats(farm)
    assert after["graph_compiles"] - before["graph_compiles"] == 1
    assert after["deduplicated"] - before.get("deduplicated", 0) == 3
    assert len({json.dumps(r.to_dict()["wrapper_source"]) for r in results}) == 1


def test_concurrent_client_processes_compile_once(farm: RayFarm, ray_cluster: RayHead,
                                                  tmp_path: Path) -> None:
    shapes = ((20, 36), (36, 36))
    env = subprocess_env(tmp_path, KILN_FARM=ray_cluster.address,
                         KILN_STORE=str(tmp_path / "store"), KILN_TEST_COMPILE_DELAY="6")
    before = farm_stats(farm)
    with ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda _: run_python(CLIENT.format(shapes=shapes), env), range(2)))
    after = farm_stats(farm)
    assert after["graph_compiles"] - before["graph_compiles"] == 1
    assert outs[0]["key"] == outs[1]["key"] and outs[0]["digests"] == outs[1]["digests"]
    assert {o["source"] for o in outs} <= {"farm", "hit"}


def test_worker_killed_mid_compile_is_retried(farm: RayFarm) -> None:
    import ray

    request = cuda_request(shapes=((10, 44), (44, 44)))
    key = compute_key(request).key
    pids = ray.get(farm.actor().worker_pids.remote())
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(farm.compile, key, request, delay=4.0)
        deadline = time.monotonic() + 30
        while farm.stats()["inflight"] == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.0)  # inside the worker's compile (its test delay)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        compiled = future.result(timeout=180)
    assert len(compiled.binaries) == 3
    assert set(ray.get(farm.actor().worker_pids.remote())).isdisjoint(pids)


def test_compile_error_names_key_stage_and_op(farm: RayFarm) -> None:
    request = failing_lowering_request()
    key = compute_key(request).key
    with pytest.raises(CompileFailure) as info:
        farm.compile(key, request)
    error = info.value
    assert (error.stage, error.op, error.key) == ("lowering", "aten.div.Tensor_mode", key)
    assert key in str(error) and "sideways" in str(error)


def test_complex_ops_run_eagerly_inside_a_farm_compiled_graph(farm: RayFarm,
                                                             ray_cluster: RayHead) -> None:
    """Kiln's code generators have no complex dtypes: those ops become FallbackKernels
    inside the compiled graph (per-op fallback), never a whole-graph eager fallback."""
    import torch

    from kiln.compiler.decompositions import trace_aten
    from kiln.frontend.core.backend import compile_aten_graph
    from kiln.frontend.core.fallback import KilnFallbackWarning

    x = torch.randn(4, 2)
    gm = trace_aten(complex_model, [x])
    config = KilnConfig.resolve({"farm": ray_cluster.address, "cpu_backend": "cpp"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fn = compile_aten_graph(gm, [x], config, "forward_0")
    assert not [w for w in caught if issubclass(w.category, (KilnFallbackWarning,
                                                             KilnFarmWarning))]
    out = fn([x])
    torch.testing.assert_close(out[0] if isinstance(out, (list, tuple)) else out,
                               complex_model(x))


def test_unreachable_farm_compiles_locally_with_one_warning(tmp_path: Path) -> None:
    client = client_for(f"127.0.0.1:{free_port()}", tmp_path / "store")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.monotonic()
        results = [client.compile(cuda_request(shapes=((4, n), (n, n)))) for n in (8, 16)]
        elapsed = time.monotonic() - start
    farm_warnings = [w for w in caught if issubclass(w.category, KilnFarmWarning)]
    assert len(farm_warnings) == 1 and "does not answer" in str(farm_warnings[0].message)
    assert [r.source for r in results] == ["local", "local"]
    assert all(client.store.contains(r.key.key) for r in results)
    assert elapsed < 60


def test_farm_slower_than_timeout_compiles_locally(farm: RayFarm, ray_cluster: RayHead,
                                                   tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_TEST_COMPILE_DELAY", "5")
    client = client_for(ray_cluster.address, tmp_path / "store", farm_timeout=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [client.compile(cuda_request(shapes=((6, n), (n, n)))) for n in (8, 24)]
    farm_warnings = [w for w in caught if issubclass(w.category, KilnFarmWarning)]
    assert len(farm_warnings) == 1 and "KILN_FARM_TIMEOUT" in str(farm_warnings[0].message)
    assert [r.source for r in results] == ["local", "local"]


def test_published_artifacts_survive_a_farm_outage(farm: RayFarm, ray_cluster: RayHead,
                                                   tmp_path: Path) -> None:
    request = cuda_request(shapes=((14, 28), (28, 28)))
    client = client_for(ray_cluster.address, tmp_path / "store")
    first = client.compile(request)
    down = client_for(f"127.0.0.1:{free_port()}", tmp_path / "store")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a hit must not even try the farm
        again = down.compile(request)
    assert (first.source, again.source) == ("farm", "hit")
    assert again.compiled.to_dict() == first.compiled.to_dict()


def test_threads_of_one_client_share_one_compile(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import kiln.workers.pipeline as pipeline

    calls = []
    real = pipeline.compile_sources

    def counted(*args: object, **kwargs: object) -> object:
        calls.append(threading.get_ident())
        time.sleep(0.5)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pipeline, "compile_sources", counted)
    client = client_for("inprocess", tmp_path / "store")
    request = cuda_request(shapes=((6, 12), (12, 12)))
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: client.compile(request), range(4)))
    assert len(calls) == 1 and len({r.key.key for r in results}) == 1
