"""Autotuning per size bucket and the switch to tuned kernels in the running process,
under Triton's interpreter. The kernels run for real with each chosen config; only the
chooser's timings are the tests' fake (``KILN_TEST_FAKE_AUTOTUNE``: at a size, the
largest XBLOCK that xnumel fills is "fastest"), since there is no GPU here.

A graph with a dynamic dimension is compiled once; each size bucket it launches is tuned
in the background when first seen, the process switches to the tuned kernels between
calls, the store's artifact records the config of every bucket, and a later process
loads them and launches each bucket's config."""

from __future__ import annotations

import gc
import logging
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.compiler.runtime.buckets import BucketedLauncher, bucket_name
from kiln.compiler.runtime.triton_launcher import TritonLauncher
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.client import client_for, reset_clients, wait_for_background
from kiln.frontend.core.fallback import KilnFallbackWarning
from kiln.frontend.core.hotswap import SwappableGraph
from kiln.workers.autotune import FAKE_AUTOTUNE_ENV

OPTIONS = {"cpu_backend": "triton-interpret"}
WIDTH = 64  # xnumel = n * 64: the first size (64) hints 4096, so candidates reach 4096


def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return (x * y + 1).relu() - x.sigmoid()


@pytest.fixture(autouse=True)
def _isolated(kiln_isolated: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAKE_AUTOTUNE_ENV, "1")


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """(xnumel, XBLOCK) of every interpreted launch: which config really ran."""
    seen: list[tuple[int, int]] = []
    original = TritonLauncher.run

    def spy(self: TritonLauncher, *args: Any) -> None:
        xnumel = self.spec.xnumel if self.xnumel_at is None else args[self.xnumel_at]
        seen.append((int(xnumel), int(self.config["XBLOCK"])))
        original(self, *args)

    monkeypatch.setattr(TritonLauncher, "run", spy)
    return seen


def _call(compiled: Any, n: int, g: torch.Generator) -> None:
    x, y = torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        out = compiled(x, y)
    torch.testing.assert_close(out, fn(x, y), rtol=1e-5, atol=1e-5,
                               msg=lambda m: f"size {n}: {m}")


def _swappable() -> list[SwappableGraph]:
    gc.collect()
    return [o for o in gc.get_objects() if type(o) is SwappableGraph]


def _compiled_marked(g: torch.Generator, options: dict[str, Any] | None = None) -> Any:
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="kiln", options=options or OPTIONS)
    x, y = torch.randn(WIDTH, WIDTH, generator=g), torch.randn(WIDTH, WIDTH, generator=g)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(y, 0)
    torch.testing.assert_close(compiled(x, y), fn(x, y), rtol=1e-5, atol=1e-5)
    return compiled


# xnumel at each size, its bucket, and the XBLOCK the fake chooser gives it.
EXPECTED = {64: (4096, "4096x1", 4096), 2: (128, "128x1", 128), 13: (832, "1024x1", 512),
            1031: (65984, "131072x1", 4096)}


def test_buckets_tuned_swapped_recorded_and_reloaded(
        launches: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KILN_STATS_FILE", str(tmp_path / "stats.json"))
    g = torch.Generator().manual_seed(0)
    compiled = _compiled_marked(g)
    assert launches[-1] == (4096, 1024), launches  # the heuristic config first
    assert wait_for_background(120)
    (graph,) = _swappable()
    assert graph.swaps == 1 and graph.compiled.buckets
    for n in (2, 13, 1031, 1):  # each first launch of a bucket runs the heuristic config
        _call(compiled, n, g)
    assert wait_for_background(120)
    launches.clear()
    for n in (64, 2, 13, 1031, 1):  # tuned now: each bucket launches its own config
        _call(compiled, n, g)
    tuned = {x: block for x, block in launches}
    for xnumel, _, block in EXPECTED.values():
        assert tuned[xnumel] == block, (xnumel, launches)
    counters = client_for(KilnConfig.resolve(OPTIONS)).counters.snapshot()
    assert counters["hot_swaps"] == graph.swaps == 4, counters  # 64; 2; 13; 1031
    assert counters["bucket_tunes"] == 4, counters
    client_for(KilnConfig.resolve(OPTIONS)).counters.flush()
    from kiln.frontend.cli.main import main

    capsys.readouterr()
    assert main(["stats"]) == 0
    assert "4 switches to tuned kernels in running processes; 4 size buckets tuned" in \
        capsys.readouterr().out

    # The artifact records every bucket's config: a new process starts tuned.
    (kernel,) = [s for s in graph.compiled.kernels if s.size_args]
    manifest = client_for(KilnConfig.resolve(OPTIONS)).store.get_manifest(graph.key.key)
    assert manifest is not None
    assert manifest["graph"]["buckets"][kernel.name] == {
        bucket: {**cfg, "XBLOCK": block} for _, bucket, block in EXPECTED.values()
        for cfg in kernel.configs if cfg["XBLOCK"] == block}
    reset_clients()
    torch._dynamo.reset()
    launches.clear()
    again = torch.compile(fn, backend="kiln", options=OPTIONS)
    for k, n in enumerate((1031, 2, 13)):
        x, y = torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g)
        if k == 0:
            torch._dynamo.mark_dynamic(x, 0)
            torch._dynamo.mark_dynamic(y, 0)
        torch.testing.assert_close(again(x, y), fn(x, y), rtol=1e-5, atol=1e-5)
    counters = client_for(KilnConfig.resolve(OPTIONS)).counters.snapshot()
    assert counters.get("hits") == 1 and not counters.get("bucket_tunes"), counters
    assert {x: b for x, b in launches} == {EXPECTED[n][0]: EXPECTED[n][2]
                                          for n in (1031, 2, 13)}, launches


def test_launcher_picks_the_bucket_config() -> None:
    g = torch.Generator().manual_seed(1)
    _compiled_marked(g)
    # Traced again, with the AOT cache off: this graph is the only one compiled (the
    # served path has its own test below).
    compiled = _compiled_marked(g, {**OPTIONS, "aot_cache": False})  # noqa: F841
    for n in (2, 1031):
        _call(compiled, n, g)
    assert wait_for_background(120)
    graph = _swappable()[-1]
    launchers = [v for v in graph.call.__globals__.values()
                 if isinstance(v, BucketedLauncher)]
    assert len(launchers) == 1
    (launcher,) = launchers
    assert bucket_name(128) == "128x1" and bucket_name(65984) == "131072x1"
    assert launcher.launcher_for(128).config["XBLOCK"] == 128
    assert launcher.launcher_for(65984).config["XBLOCK"] == 4096
    assert launcher.launcher_for(3 * 2**20) is launcher.default  # a bucket never seen


def test_a_served_graph_tunes_the_buckets_its_artifact_lacks_and_publishes_them(
        launches: list[tuple[int, int]]) -> None:
    """The AOT cache's warm path has no request, only the artifact: a bucket the stored
    graph has no tuned config for is tuned in the process that meets it, switched to,
    and published under the same key, so the next process launches it tuned."""
    g = torch.Generator().manual_seed(4)
    compiled = _compiled_marked(g)  # compiled, then its first bucket tuned (n = 64)
    assert wait_for_background(120)
    client = client_for(KilnConfig.resolve(OPTIONS))
    (graph,) = _swappable()
    key = graph.key.key
    assert set(graph.compiled.buckets[_dynamic_kernel(graph)]) == {"4096x1"}
    del compiled, graph

    def new_process() -> tuple[Any, Any]:
        reset_clients()
        torch._dynamo.reset()
        gc.collect()
        launches.clear()
        again = torch.compile(fn, backend="kiln", options=OPTIONS)
        x, y = torch.randn(13, WIDTH, generator=g), torch.randn(13, WIDTH, generator=g)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(y, 0)
        torch.testing.assert_close(again(x, y), fn(x, y), rtol=1e-5, atol=1e-5)
        return again, client_for(KilnConfig.resolve(OPTIONS))

    served, client = new_process()
    counters = client.counters.snapshot()
    assert counters.get("aot_hits") == 1 and not counters.get("compiles"), counters
    assert launches == [(832, 1024)], launches  # bucket 1024x1: not tuned, heuristic
    assert wait_for_background(120)
    (graph,) = [s for s in _swappable() if s.key.key == key]
    assert graph.swaps == 1, graph.swaps
    launches.clear()
    _call(served, 13, g)
    _call(served, 64, g)  # the stored bucket is kept
    assert launches == [(832, 512), (4096, 4096)], launches
    counters = client.counters.snapshot()
    assert counters["bucket_tunes"] == 1 and counters["autotune_publishes"] == 1, counters
    manifest = client.store.get_manifest(key)
    assert manifest is not None
    assert {b: c["XBLOCK"] for b, c in
            manifest["graph"]["buckets"][_dynamic_kernel(graph)].items()} == {
        "4096x1": 4096, "1024x1": 512}
    del served, graph

    third, client = new_process()  # starts tuned: nothing benchmarked
    assert launches == [(832, 512)], launches
    assert wait_for_background(120)
    counters = client.counters.snapshot()
    assert counters.get("aot_hits") == 1 and not counters.get("bucket_tunes"), counters
    del third


def _dynamic_kernel(graph: SwappableGraph) -> str:
    (spec,) = [s for s in graph.compiled.kernels if s.size_args]
    return spec.name


def test_failed_tuning_keeps_heuristic_kernels_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        launches: list[tuple[int, int]]) -> None:
    from kiln.frontend.core import hotswap

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no candidate compiled")

    monkeypatch.setattr(hotswap, "tune_buckets", broken)
    g = torch.Generator().manual_seed(2)
    with caplog.at_level(logging.WARNING):
        compiled = _compiled_marked(g)
        for n in (2, 13, 1031, 5, 700):
            _call(compiled, n, g)
            assert wait_for_background(60)
    warned = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "no candidate compiled" in warned[0].getMessage(), warned
    graph = _swappable()[-1]
    assert graph.swaps == 0 and graph.failed
    assert {block for _, block in launches} == {1024}  # the heuristic config throughout


def test_finished_tuning_switches_a_running_static_graph_between_calls(
        launches: list[tuple[int, int]]) -> None:
    """What ``_tune_later`` does when a static graph's background autotuning finishes
    (on a GPU): the loaded graph switches to the tuned configs; calls running on other
    threads meanwhile finish with whole graphs and match eager."""
    from kiln.compiler.decompositions import trace_aten
    from kiln.frontend.core.compile import _builder, build_request
    from kiln.workers.autotune import fake_timings

    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(64, WIDTH, generator=g), torch.randn(64, WIDTH, generator=g)
    config = KilnConfig.resolve(OPTIONS)
    gm = trace_aten(fn, [x, y])
    request = build_request(gm, [x, y], config)
    client = client_for(config)
    result = client.compile(request)
    graph = SwappableGraph(_builder(gm, [x, y], config, "static"), result.compiled, client,
                           result.key, request)
    (spec,) = result.compiled.kernels
    assert not spec.size_args and launches == []
    timings = fake_timings([dict(c) for c in spec.configs])  # the chooser: fake times
    best = dict(spec.configs[min(range(len(timings)), key=timings.__getitem__)])
    assert best["XBLOCK"] != spec.configs[0]["XBLOCK"]
    tuned = type(result.compiled).from_dict(result.compiled.to_dict())
    tuned.configs[spec.name], tuned.autotuned = best, True

    errors: list[BaseException] = []

    def calls() -> None:
        for _ in range(6):
            a, b = torch.randn(64, WIDTH), torch.randn(64, WIDTH)
            try:
                (out,) = graph([a, b])
                torch.testing.assert_close(out, fn(a, b), rtol=1e-5, atol=1e-5)
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)

    import threading

    worker = threading.Thread(target=calls)
    worker.start()
    client._notify_tuned(result.key.key, tuned)  # the background tuning's completion
    worker.join()
    assert not errors, errors
    assert graph.swaps == 1 and graph.compiled.configs[spec.name] == best
    launches.clear()
    (out,) = graph([x, y])
    torch.testing.assert_close(out, fn(x, y), rtol=1e-5, atol=1e-5)
    assert launches == [(64 * WIDTH, best["XBLOCK"])], launches
    assert client.counters.snapshot()["hot_swaps"] == 1
