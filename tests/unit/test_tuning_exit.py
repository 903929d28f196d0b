"""At exit a process waits for its background tuning only up to KILN_AUTOTUNE_EXIT_WAIT
(default a few seconds): tuning that finishes within it is published, tuning cut off is
abandoned (nothing published later, no warning) and the script does not linger. Each
case runs in a fresh interpreter: the exit hook runs once per process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.frontend.tuning import EXIT_WAIT_ENV, EXIT_WAIT_S, exit_wait_s

SCRIPT = """
import json, sys, time, types
from pathlib import Path
from kiln.frontend.tuning import BackgroundTuner

marker = Path(sys.argv[1])
tune_s = float(sys.argv[2])

def tune():
    time.sleep(tune_s)
    return types.SimpleNamespace(autotuned=True)

def publish(graph):
    marker.write_text("published")

BackgroundTuner().submit("k" * 64, tune, publish)
if len(sys.argv) > 3:  # exit's wait, then outlive the tuning: does it publish late?
    from kiln.frontend.tuning import wait_at_exit
    abandoned = wait_at_exit()
    time.sleep(tune_s + 0.5)
    print(json.dumps({"abandoned": abandoned, "late": marker.exists()}), flush=True)
print(json.dumps({"ended_at": time.time()}), flush=True)
"""


def _run(tmp_path: Path, tune_s: float, wait: str | None) -> tuple[float, bool, str]:
    """Seconds from the script's end to its exit, whether it published, its stderr."""
    marker = tmp_path / "published"
    env = {k: v for k, v in os.environ.items() if k != EXIT_WAIT_ENV}
    if wait is not None:
        env[EXIT_WAIT_ENV] = wait
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(marker), str(tune_s)], env=env,
                          capture_output=True, text=True, timeout=120)
    exited = time.time()
    assert proc.returncode == 0, proc.stderr[-3000:]
    ended = json.loads(proc.stdout.splitlines()[-1])["ended_at"]
    time.sleep(max(0.0, tune_s + 0.5 - (exited - ended)))  # a daemon left would be done
    return exited - ended, marker.exists(), proc.stderr


def test_the_exit_wait_is_a_few_seconds_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(EXIT_WAIT_ENV, raising=False)
    assert exit_wait_s() == EXIT_WAIT_S == 5.0
    for value, wait in (("900", 900.0), ("0.5", 0.5), ("-3", 0.0), ("soon", EXIT_WAIT_S)):
        monkeypatch.setenv(EXIT_WAIT_ENV, value)
        assert exit_wait_s() == wait, value


def test_tuning_within_the_exit_wait_is_published(tmp_path: Path) -> None:
    lingered, published, _ = _run(tmp_path, tune_s=0.5, wait=None)
    assert published and lingered < EXIT_WAIT_S + 5


def test_tuning_cut_off_at_exit_is_abandoned_quietly_and_not_published(
        tmp_path: Path) -> None:
    lingered, published, stderr = _run(tmp_path, tune_s=3.0, wait="0.5")
    assert not published
    assert lingered < 2.5, f"the script lingered {lingered:.1f}s at exit"
    assert "failed" not in stderr and "Traceback" not in stderr, stderr


POOL_SCRIPT = """
import sys, time, types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from kiln.frontend.tuning import BackgroundTuner

marker = Path(sys.argv[1])

def tune():  # compiles its candidates in a pool, as workers/pipeline.py does
    time.sleep(0.5)  # the script has ended by now: the interpreter is exiting
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(abs, range(4)))
    return types.SimpleNamespace(autotuned=True)

BackgroundTuner().submit("k" * 64, tune, lambda graph: marker.write_text("published"))
"""


def test_tuning_that_starts_a_thread_pool_during_the_exit_wait_is_published(
        tmp_path: Path) -> None:
    """The exit wait runs before concurrent.futures refuses new pools at interpreter
    shutdown: a tuning job that compiles candidates in a pool then still finishes (it
    warned "cannot schedule new futures after interpreter shutdown" and published
    nothing, seen on the H200 host after a dynamic model's last call)."""
    marker = tmp_path / "published"
    env = {k: v for k, v in os.environ.items() if k != EXIT_WAIT_ENV}
    proc = subprocess.run([sys.executable, "-c", POOL_SCRIPT, str(marker)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "failed" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert marker.exists()


def test_tuning_that_ends_after_the_exit_wait_publishes_nothing(tmp_path: Path) -> None:
    marker = tmp_path / "published"
    env = {**os.environ, EXIT_WAIT_ENV: "0.3"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(marker), "1.5", "stay"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.splitlines()[0]) == {"abandoned": 1, "late": False}
    assert not marker.exists()


# Tuning abandoned at exit while it runs torch's C++ code (on the GPU host: a benchmark,
# a tuned graph's load): the interpreter must not finalize under it. A daemon thread that
# returns from C++ into a finalizing interpreter is ended by pthread_exit, and its unwind
# through pybind11's noexcept GIL re-acquire aborted the process on the H200 host
# ("terminate called without an active exception", exit status 134).
TORCH_SCRIPT = """
import json, sys, time, types
import torch
from kiln.frontend.tuning import BackgroundTuner
from kiln.workers import foreground

steps = []

def tune():
    a = torch.randn(600, 600)
    while True:  # as autotune_inprocess: wait_idle before each benchmark
        foreground.wait_idle()
        for _ in range(20):
            a = (a @ a).tanh()
        steps.append(1)

BackgroundTuner().submit("k" * 64, tune, lambda graph: None, local=True)
while not steps:
    time.sleep(0.01)
print(json.dumps({"ended_at": time.time()}), flush=True)
"""


@pytest.mark.parametrize("wait", ["0", "0.3"])
def test_tuning_cut_off_inside_torch_exits_cleanly(wait: str) -> None:
    env = {**os.environ, EXIT_WAIT_ENV: wait}
    for _ in range(3):  # the abort took every run before the fix; three for margin
        proc = subprocess.run([sys.executable, "-c", TORCH_SCRIPT], env=env,
                              capture_output=True, text=True, timeout=120)
        exited = time.time()
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
        assert "terminate called" not in proc.stderr, proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and "failed" not in proc.stderr, proc.stderr
        ended = json.loads(proc.stdout.splitlines()[-1])["ended_at"]
        assert exited - ended < float(wait) + 10, "exit waited far longer than one step"


def test_stopped_background_work_ends_at_its_next_wait() -> None:
    script = """
import threading
from kiln.workers import foreground
foreground.expect("backward_0", within=60)  # a foreground compile to come: jobs wait
raised = []
def job():
    try:
        foreground.wait_idle(60)
    except foreground.BackgroundStopped:
        raised.append(1)
t = threading.Thread(target=job); t.start()
foreground.stop_background()
t.join(5)
try:
    foreground.wait_idle(0)
except foreground.BackgroundStopped:
    raised.append(2)
print(raised, t.is_alive())
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["[1,", "2]", "False"], proc.stdout
