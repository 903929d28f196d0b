"""The compile timeline: spans recorded across threads and captures, the Chrome trace
file, the critical path and `kiln trace summary`; and one real compile's timeline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kiln.compiler import trace
from kiln.frontend.cli.main import main
from kiln.frontend.trace import Span, critical_path, load_spans, summarize, write_trace

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_recorder() -> None:
    trace.clear()
    trace.enable(False)


def test_spans_are_recorded_only_when_on_and_captures_are_per_thread() -> None:
    with trace.span("off"):
        pass
    assert trace.events() == []
    seen: list[list[trace.Event]] = []

    def worker() -> None:
        with trace.capture() as events:
            with trace.span("in thread", cat="kernel", kernel="k0"):
                pass
        seen.append(events)

    with trace.capture() as mine:
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        with trace.span("in main"):
            pass
    assert [e["name"] for e in mine] == ["in main"]
    assert [e["name"] for e in seen[0]] == ["in thread"]
    assert seen[0][0]["args"]["kernel"] == "k0" and seen[0][0]["ph"] == "X"
    assert trace.events() == []  # captures do not fill the process buffer
    trace.enable()
    with trace.span("outer"):
        with trace.span("inner") as args:
            args["hit"] = True
    names = [e["name"] for e in trace.events()]
    assert names == ["inner", "outer"]
    inner, outer = trace.events()
    assert inner["args"]["hit"] is True
    assert outer["ts"] <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"]
    remote = dict(inner, pid=1)  # from another process, sent twice (autotune traces are)
    trace.merge([remote])
    trace.merge([remote])
    assert len(trace.events()) == 3


def _span(name: str, start: float, end: float, pid: int = 1, tid: int = 1) -> Span:
    return Span(name, start * 1000, end * 1000, pid, tid, f"p{pid}",
                "client" if pid == 1 else "kernel")


def test_critical_path_follows_the_chain_that_finishes_last_across_processes() -> None:
    spans = [
        _span("client", 0, 100),
        _span("hash", 0, 5),
        _span("farm wait", 5, 90),
        _span("graph stage", 10, 40, pid=2),
        _span("kernel a", 40, 60, pid=3),
        _span("kernel b", 40, 85, pid=4),  # the slower kernel is on the path
        _span("load", 90, 100),
    ]
    path = [s.name for s in critical_path(spans)]
    assert path == ["hash", "graph stage", "kernel b", "load"]
    summary = summarize(spans)
    assert summary["wall_ms"] == pytest.approx(100)
    rows = {r["stage"]: r["ms"] for r in summary["critical_path"]}
    assert rows["kernel b"] == pytest.approx(45) and "kernel a" not in rows
    # Gaps between path leaves are the enclosing span's own time: the whole wall is covered.
    assert sum(rows.values()) == pytest.approx(100)
    assert rows["farm wait (own time)"] == pytest.approx(5 + 5)
    own = {r["stage"]: r["ms"] for r in summary["top_stages"]}
    assert own["client"] == pytest.approx(0)  # all of it is nested spans
    assert own["farm wait"] == pytest.approx(85)  # nested spans of other processes do not count


def test_background_tuning_is_off_the_first_outputs_critical_path() -> None:
    """Autotuning after the first output (its candidate compiles in a pool's threads,
    the farm's tuning merged from another process) ends last, yet the critical path is
    the first output's; the spans are kept (own time) and the tuning time reported."""
    trace.enable()
    with trace.span("Dynamo compile of a frame", cat="client"):
        with trace.span("kernel compile", cat="kernel", kernel="first"):
            pass
    def compile_candidate(name: str) -> None:
        trace.complete("kernel compile", trace.now_us(), trace.now_us() + 5e5, cat="kernel",
                       kernel=name)

    def tune() -> None:
        with trace.background(), trace.span("background autotune", cat="background"):
            worker = threading.Thread(target=trace.carry(compile_candidate),
                                      args=("candidate",))
            worker.start()
            worker.join()
            trace.merge([dict(trace.make_event("autotune benchmark", trace.now_us(),
                                               trace.now_us() + 9e5, cat="autotune"),
                              pid=4242)])

    tuner = threading.Thread(target=tune)
    tuner.start()
    tuner.join()
    spans = load_spans_of(trace.events())
    assert {s.name for s in spans if s.background} == {
        "kernel compile", "autotune benchmark", "background autotune"}
    path = [s.name for s in critical_path(spans)]
    assert path == ["kernel compile"], path
    summary = summarize(spans)
    assert summary["wall_ms"] < 400 and summary["background_ms"] > 0
    on_path = {r["stage"] for r in summary["critical_path"]}
    assert not on_path & {"autotune benchmark", "background autotune"}, on_path
    assert {r["stage"] for r in summary["top_stages"]} >= {"autotune benchmark",
                                                           "background autotune"}


def test_time_after_the_last_leaf_is_the_enclosing_spans_own_time() -> None:
    """The bench's span from torch.compile to the first output ends after the last
    compile step: the first call's own work is on the path, and the path covers the wall."""
    spans = [_span("torch.compile to first output", 0, 100), _span("Dynamo", 0, 60),
             _span("lowering", 10, 50)]
    rows = {r["stage"]: r["ms"] for r in summarize(spans)["critical_path"]}
    assert rows["torch.compile to first output (own time)"] == pytest.approx(40)
    assert rows["lowering"] == pytest.approx(40) and sum(rows.values()) == pytest.approx(100)


def load_spans_of(events: list[trace.Event]) -> list[Span]:
    from kiln.frontend.trace import spans_from_events

    return spans_from_events(events)


def test_trace_file_and_cli_summary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    events = [trace.make_event("lowering", 1000, 3000, cat="compiler"),
              dict(trace.make_event("kernel compile", 3000, 9000), pid=77,
                   args={"process": "kernel worker"})]
    path = write_trace(tmp_path / "t.json", events)
    data = json.loads(path.read_text())
    names = {e["args"]["name"] for e in data["traceEvents"] if e["ph"] == "M"}
    assert "kernel worker (77)" in names
    assert [s.name for s in load_spans(path)] == ["lowering", "kernel compile"]
    assert main(["trace", "summary", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["processes"] == 2 and out["critical_path"][0]["stage"] == "kernel compile"
    (tmp_path / "bad.json").write_text("{not json")
    assert main(["trace", "summary", str(tmp_path / "bad.json")]) == 1
    assert "cannot read trace" in capsys.readouterr().out


COMPILE = """
import torch, warnings
from kiln.frontend.core.fallback import KilnFallbackWarning
warnings.simplefilter("error", KilnFallbackWarning)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32))
x = torch.randn(4, 16)
torch.testing.assert_close(torch.compile(m, backend="kiln")(x), m(x), rtol=1e-4, atol=1e-4)
"""


def test_a_compile_writes_its_timeline_with_every_client_stage(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KILN_", "RAY_"))}
    env.update(KILN_TRACE=str(tmp_path / "trace.json"), XDG_CACHE_HOME=str(tmp_path / "c"),
               KILN_STORE=str(tmp_path / "store"), KILN_FARM_FILE=str(tmp_path / "none.json"),
               KILN_DEBUG="1", KILN_DEBUG_DIR=str(tmp_path / "debug"))
    subprocess.run([sys.executable, "-c", COMPILE], env=env, check=True, cwd=ROOT,
                   timeout=600)
    names = {s.name for s in load_spans(tmp_path / "trace.json")}
    for stage in ("Dynamo compile of a frame", "AOTAutograd (compiles inside)",
                  "serialize request", "hash request", "store lookup", "local compile",
                  "lowering", "scheduling and fusion", "memory plan", "codegen",
                  "kernel compile", "publish", "load graph", "load kernel"):
        assert stage in names, stage
    per_graph = list((tmp_path / "debug").glob("*_request_*/trace.json"))
    assert per_graph and "lowering" in {s.name for s in load_spans(per_graph[0])}
