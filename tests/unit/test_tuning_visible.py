"""Tuning on the program's GPU is visible: a graph compiled here (the fake benchmark
stands in for a GPU) is called in a loop while it tunes; its benchmarks take turns
between the calls, the timeline (``KILN_TRACE``) shows each turn with its GPU and the
moment the tuned kernels took over, and ``kiln stats`` says how many turns ran on which
GPU, how many calls they slowed and by how much, and how long after the first output
the tuned kernels took over."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from kiln.compiler import trace
from kiln.compiler.runtime.kernel_files import interpreter_active
from kiln.frontend.cli.main import main as kiln_main
from kiln.frontend.core.hotswap import SwappableGraph
from kiln.workers import gpu_share
from kiln.workers.autotune import FAKE_AUTOTUNE_ENV, FAKE_AUTOTUNE_MS_ENV
from tests.targets import SM90
from tests.unit.test_background_autotune import _client, build_request, fake_cuda, trace_aten

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


def test_turns_slowdown_and_takeover_show_in_trace_and_stats(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    stats_file = tmp_path / "stats.json"
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kcache"))
    monkeypatch.setenv("KILN_STATS_FILE", str(stats_file))
    monkeypatch.setenv(FAKE_AUTOTUNE_ENV, "1")
    monkeypatch.setenv(FAKE_AUTOTUNE_MS_ENV, "2")  # each candidate's (fake) GPU time
    # Tuning's part of the time, 0.25 by default: more here, so that the candidates'
    # compiles (CPU-bound on this machine) end sooner; turns still alternate with calls.
    monkeypatch.setenv(gpu_share.SHARE_ENV, "0.9")
    client = _client(tmp_path, local_cache="off", stats_file=str(stats_file))
    args = fake_cuda([torch.randn(256, 512)])  # one tunable kernel: six candidates
    request = build_request(trace_aten(lambda a: (a + 1).sum(0), args), args, client.config,
                            target=dict(SM90))
    first = client.compile(request)  # type: ignore[arg-type]
    assert first.source == "local" and first.compiled.stats["autotune_pending"]
    calls = 0

    def build(compiled: object, hook: object) -> object:
        def call(args: list[int]) -> list[int]:
            time.sleep(0.001)  # the call's (host-timed) work
            return [a + 1 for a in args]
        return call

    trace.clear()
    trace.enable()  # every thread's spans, as KILN_TRACE records them
    try:
        graph = SwappableGraph(build, first.compiled, client, first.key,  # type: ignore[arg-type]
                               request)  # type: ignore[arg-type]
        deadline = time.monotonic() + 120
        while graph.swaps == 0 and time.monotonic() < deadline:
            assert graph([calls]) == [calls + 1]
            calls += 1
        assert client.tuner.wait(60)
    finally:
        trace.enable(False)
        events = trace.events()
        trace.clear()
    assert graph.swaps == 1
    turns = [e for e in events if e["name"] == "gpu turn"]
    share = gpu_share.current()
    assert share is not None and turns and len(turns) <= share.stats.turns
    assert all(e["args"]["gpu"] == share.stats.gpu for e in turns)
    took_over = [e for e in events if e["name"] == "tuned kernels took over"]
    assert len(took_over) == 1 and took_over[0]["ts"] >= max(e["ts"] for e in turns)
    assert share.stats.calls_timed > 0  # the loop's calls were timed while tuning ran
    client.counters.flush()
    counted = json.loads(stats_file.read_text())["client"]
    gpu = counted["gpu_share"][share.stats.gpu]
    assert gpu["turns"] >= len(turns) and gpu["turn_ms"] > 0
    assert gpu["calls_timed"] > 0 and gpu["slowed_calls"] <= gpu["calls_beside_turns"]
    assert counted["hot_swaps"] == 1 and counted["tuned_took_over_after_max_ms"] > 0
    assert kiln_main(["stats"]) == 0
    out = capsys.readouterr().out
    assert f"tuning on GPU   {share.stats.gpu}: {gpu['turns']} turns" in out
    assert "calls slowed" in out and "tuned took over" in out
    summary_code = kiln_main(["stats", "--json"])
    summary = json.loads(capsys.readouterr().out)
    assert summary_code == 0 and summary["gpu_share"][share.stats.gpu]["turns"] == gpu["turns"]
