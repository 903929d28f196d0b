"""First output from heuristic configs, autotuning after: the client publishes the
heuristic artifact at once, tunes in the background (here with the farm tests' fake
benchmark standing in for a GPU: no GPU on this machine), and the tuned artifact then
supersedes the first under the same key; the next lookup gets it and says so."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.compiler.decompositions import trace_aten
from kiln.compiler.runtime.kernel_files import interpreter_active
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.client import KilnClient
from kiln.frontend.core.compile import build_request
from kiln.frontend.transports.inprocess import InProcessFarm
from kiln.workers.autotune import FAKE_AUTOTUNE_ENV
from tests.unit.test_cubin import SM90, fake_cuda

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


def _cuda_request(config: KilnConfig) -> object:
    x = torch.randn(256, 512)
    args = fake_cuda([x])
    gm = trace_aten(lambda a: (torch.softmax(a * 2, -1), (a + 1).sum(0)), args)
    return build_request(gm, args, config, target=dict(SM90))


def _client(tmp_path: Path, **options: object) -> KilnClient:
    config = KilnConfig.resolve({"store": str(tmp_path / "store"), "farm": "inprocess",
                                 **options})
    return KilnClient(config, farm=InProcessFarm())


def test_heuristic_first_then_the_tuned_artifact_supersedes_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kcache"))
    monkeypatch.setenv(FAKE_AUTOTUNE_ENV, "1")
    client = _client(tmp_path, local_cache="off")  # no earlier test's graph from the tier
    request = _cuda_request(client.config)
    first = client.compile(request)  # type: ignore[arg-type]
    assert first.source == "local" and not first.compiled.autotuned
    assert first.compiled.stats["autotune_pending"] is True
    tunable = [s for s in first.compiled.kernels if len(s.configs) > 1]
    assert tunable, "the test graph needs a kernel with several candidate configs"
    for spec in first.compiled.kernels:  # heuristic: each kernel's first config
        assert first.compiled.configs[spec.name] == dict(spec.configs[0])
    assert client.tuner.wait(300)
    assert client.counters.snapshot()["autotune_publishes"] == 1
    manifest = client.store.get_manifest(first.key.key)
    assert manifest is not None and manifest["graph"]["autotuned"] is True
    # The next lookup (another client of the same store) hits the tuned artifact.
    later = _client(tmp_path)
    hit = later.compile(_cuda_request(later.config))  # type: ignore[arg-type]
    assert hit.source == "hit" and hit.compiled.autotuned
    assert later.counters.snapshot()["hits_autotuned"] == 1
    for spec in tunable:  # the fake benchmark makes the most warps fastest
        chosen = hit.compiled.configs[spec.name]
        assert chosen["num_warps"] == max(c["num_warps"] for c in spec.configs)
        record = hit.compiled.stats["autotune"][spec.name]
        assert [r["config"] for r in record] == [dict(c) for c in spec.configs]


def test_nothing_tunes_without_a_gpu_or_when_autotuning_is_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kcache"))
    monkeypatch.delenv(FAKE_AUTOTUNE_ENV, raising=False)
    client = _client(tmp_path)
    result = client.compile(_cuda_request(client.config))  # type: ignore[arg-type]
    assert "autotune_pending" not in result.compiled.stats  # no GPU of sm_90 here
    monkeypatch.setenv(FAKE_AUTOTUNE_ENV, "1")
    off = _client(tmp_path / "off", autotune="0")
    result = off.compile(_cuda_request(off.config))  # type: ignore[arg-type]
    assert "autotune_pending" not in result.compiled.stats
    assert off.tuner.pending() == 0 and client.tuner.pending() == 0


def test_tuning_in_process_waits_for_the_graphs_first_output(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The candidates compile only once the graph's first call returned: before, they
    would take the CPUs and the GIL from that call."""
    import time

    from kiln.frontend.core.hotswap import SwappableGraph

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kcache"))
    monkeypatch.setenv(FAKE_AUTOTUNE_ENV, "1")
    client = _client(tmp_path, local_cache="off")  # no earlier test's graph from the tier
    request = _cuda_request(client.config)
    first = client.compile(request)  # type: ignore[arg-type]
    assert first.source == "local" and first.compiled.stats["autotune_pending"], first.source
    compiled_before = client.local.kernels.compiles
    time.sleep(1.0)
    assert client.tuner.held() == 1 and client.tuner.pending() == 1
    assert client.local.kernels.compiles == compiled_before  # no candidate compiled yet
    builds: list[bool] = []

    def build(compiled: object, hook: object) -> object:
        builds.append(bool(getattr(compiled, "autotuned", False)))
        return lambda args: [a * 2 for a in args]

    graph = SwappableGraph(build, first.compiled, client, first.key,  # type: ignore[arg-type]
                           request)  # type: ignore[arg-type]
    from kiln.compiler import trace

    with trace.capture() as events:  # the first call is on the timeline, once
        assert graph([21]) == [42] and client.tuner.held() == 0
        assert graph([4]) == [8]
    assert [e["name"] for e in events].count("first call of a graph") == 1
    assert client.tuner.wait(300)
    assert client.local.kernels.compiles > compiled_before
    assert client.counters.snapshot()["autotune_publishes"] == 1
    assert builds == [False, True] and graph.swaps == 1  # switched to the tuned kernels


def test_tuning_in_process_waits_for_the_next_graphs_compile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph's tuning let go (its first call returned) while the next graph compiles
    (a training step's backward, the graph after a break) compiles no candidate until that
    compile is done: it took the CPUs and the GIL from it (``workers.foreground``)."""
    import time

    from kiln.workers import foreground

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kcache"))
    monkeypatch.setenv(FAKE_AUTOTUNE_ENV, "1")
    client = _client(tmp_path, local_cache="off")
    first = client.compile(_cuda_request(client.config))  # type: ignore[arg-type]
    assert first.compiled.stats["autotune_pending"], first.source
    x = torch.randn(128, 256)
    args = fake_cuda([x, x])
    gm = trace_aten(lambda a, b: (torch.tanh(a) * b).amax(1), args)
    second_request = build_request(gm, args, client.config, target=dict(SM90))
    before = client.local.kernels.compiles
    with foreground.compiling():  # the next graph's compile, from its trace on
        client.tuner.release(first.key.key)  # the first graph's first call returned
        time.sleep(1.0)
        assert client.local.kernels.compiles == before  # no candidate compiled
        second = client.compile(second_request)  # type: ignore[arg-type]
        assert second.source == "local" and len(second.compiled.binaries) >= 1
        # the kernels compiled so far are the second graph's, none a candidate
        assert client.local.kernels.compiles == before + len(second.compiled.binaries)
        assert client.tuner.held() == int(bool(second.compiled.stats.get("autotune_pending")))
    assert client.tuner.wait(300)
    assert client.local.kernels.compiles > before + len(second.compiled.binaries)
    assert client.counters.snapshot()["autotune_publishes"] >= 1
    manifest = client.store.get_manifest(first.key.key)
    assert manifest is not None and manifest["graph"]["autotuned"] is True
