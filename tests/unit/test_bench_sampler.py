"""bench/sampler.py (``coldstart.py --sample``): a thread that competes with the main
thread shows up with its stack, and a program started during the timed part is recorded
with its time and thread.

The sampled program is a fresh process (this file run as a script): a pytest worker has
threads of its own (execnet's receiver, a Ray driver's, earlier tests'), and on a loaded
machine any of them could outrank the spinner in the report's four busiest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import sampler  # noqa: E402

# Samples of the spinner the sampled program waits for (and at least this many in all).
BUSY_SAMPLES, SAMPLES = 10, 20


def _spin(stop: threading.Event) -> None:
    while not stop.is_set():
        sum(i * i for i in range(2000))


def sampled_program(deadline_s: float = 120.0) -> None:
    """What the test samples: a spinning thread, and a program started meanwhile. It
    spins until the sampler has seen it busy ``BUSY_SAMPLES`` times, not for a fixed
    time: a process that gets a fraction of a core takes fewer samples per second."""
    recording = sampler.begin_from_env()
    assert recording is not None
    stop = threading.Event()
    spinner = threading.Thread(target=_spin, args=(stop,), name="spinner", daemon=True)
    spinner.start()
    subprocess.run([sys.executable, "-c", "pass"], check=True)
    ends = time.monotonic() + deadline_s
    while (recording.busy["spinner"] < BUSY_SAMPLES or recording.samples < SAMPLES) \
            and time.monotonic() < ends:
        time.sleep(0.01)
    stop.set()
    spinner.join()
    sampler.write(recording)


def test_a_busy_thread_and_a_started_program_are_seen(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    row = tmp_path / "row.json"
    subprocess.run([sys.executable, __file__], check=True, timeout=300,
                   env={**os.environ, "BENCH_SAMPLE": str(row)})
    data = json.loads(row.read_text())
    assert data["samples"] >= SAMPLES
    spin = data["threads"]["spinner"]
    assert spin["busy_samples"] >= BUSY_SAMPLES
    assert any("_spin (test_bench_sampler.py" in stack for stack, _ in spin["top"])
    started = [e for e in data["events"] if e["event"] == "subprocess.Popen"]
    assert started and started[0]["thread"] == "MainThread"
    assert sys.executable in started[0]["detail"]
    sampler.report(str(row))
    sampler.compare(str(row), str(row))
    printed = capsys.readouterr().out
    assert "thread spinner" in printed and "subprocess.Popen" in printed


if __name__ == "__main__":
    sampled_program()
