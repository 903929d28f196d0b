"""bench/sampler.py (``coldstart.py --sample``): a thread that competes with the main
thread shows up with its stack, and a program started during the timed part is recorded
with its time and thread."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import sampler  # noqa: E402


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(i * i for i in range(2000))


def test_a_busy_thread_and_a_started_program_are_seen(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
        ) -> None:
    monkeypatch.setenv("BENCH_SAMPLE", str(tmp_path / "row.json"))
    stop = threading.Event()
    spinner = threading.Thread(target=_spin, args=(stop,), name="spinner", daemon=True)
    recording = sampler.begin_from_env()
    assert recording is not None
    spinner.start()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    time.sleep(0.3)
    stop.set()
    spinner.join()
    sampler.write(recording)
    data = json.loads((tmp_path / "row.json").read_text())
    assert data["samples"] >= 20
    spin = data["threads"]["spinner"]
    assert spin["busy_samples"] >= 10
    assert any("_spin (test_bench_sampler.py" in stack for stack, _ in spin["top"])
    started = [e for e in data["events"] if e["event"] == "subprocess.Popen"]
    assert started and started[0]["thread"] == "MainThread"
    assert sys.executable in started[0]["detail"]
    sampler.report(str(tmp_path / "row.json"))
    sampler.compare(str(tmp_path / "row.json"), str(tmp_path / "row.json"))
    printed = capsys.readouterr().out
    assert "thread spinner" in printed and "subprocess.Popen" in printed
