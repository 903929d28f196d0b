"""Processes starting together on one model, in the default mode (no farm up) with a
shared folder store: each distinct graph compiles once over all of them (claims in the
store, artifact_store/claims.py), and a claimant killed with SIGKILL mid-compile is taken
over, the others done waiting within the claim's expiry plus one compile, every result
checked against eager (tests/fleet_child.py)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kiln.compiler.runtime.kernel_files import interpreter_active
from tests.fleet_helpers import fleet_env, graph_keys

ROOT = Path(__file__).resolve().parents[2]
CHILD = ROOT / "tests" / "fleet_child.py"

pytestmark = pytest.mark.skipif(interpreter_active(), reason="C++ CPU kernels")


def start(n: int, mode: str, env: dict[str, str]) -> list[subprocess.Popen[str]]:
    return [subprocess.Popen([sys.executable, str(CHILD), mode, "0"], env=env, cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for _ in range(n)]


def finish(proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def stats(tmp_path: Path) -> dict[str, Any]:
    return json.loads((tmp_path / "stats.json").read_text())


def test_four_processes_compile_each_graph_once(tmp_path: Path) -> None:
    results = [finish(p) for p in start(4, "train", fleet_env(tmp_path))]
    keys = graph_keys(tmp_path / "store")
    assert len(keys) >= 2  # forward and backward
    data = stats(tmp_path)
    client, store = data["client"], data["store"]
    assert client["compiles"] == len(keys), (client, keys)
    assert sum(r["counters"].get("compiles", 0) for r in results) == len(keys)
    assert store["claims"] == len(keys)
    assert client["graphs"] == 4 * len(keys)
    assert not list((tmp_path / "store" / "claims").rglob("*.0*"))  # all released


def claim_holder(store: Path, timeout: float = 300.0) -> int:
    """The pid named by the first claim to appear in the store."""
    ends = time.monotonic() + timeout
    while time.monotonic() < ends:
        for path in (store / "claims").rglob("*"):
            if path.is_file() and ".tmp-" not in path.name:
                try:
                    return int(json.loads(path.read_text())["owner"]["pid"])
                except (OSError, ValueError, KeyError):
                    continue
        time.sleep(0.02)
    raise AssertionError("no claim appeared in the store")


def wait_for(what: str, done: Callable[[], bool], procs: list[subprocess.Popen[str]],
             timeout: float = 300.0) -> None:
    """Until ``done()``; fails at once if one of ``procs`` has exited meanwhile."""
    ends = time.monotonic() + timeout
    while not done():
        for proc in procs:
            if proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"process {proc.pid} exited ({proc.returncode}) "
                                     f"before {what}: {err[-3000:]}")
        assert time.monotonic() < ends, f"no {what} in {timeout} s"
        time.sleep(0.02)


def claim_wait_ends(path: Path) -> list[float]:
    """When each ``claim wait`` span of a process's trace ended (seconds since the epoch)."""
    events = json.loads(path.read_text())["traceEvents"]
    return [(float(e["ts"]) + float(e["dur"])) / 1e6 for e in events
            if e.get("name") == "claim wait"]


def test_killed_claimant_is_taken_over(tmp_path: Path) -> None:
    # The holder is killed once both others wait on its claim (each process says when it
    # starts waiting), at a random point of its compile; the compile's delay is only
    # there to be longer than the others' way to their claims on a loaded machine.
    ttl, delay = 2.0, 6.0
    sync = tmp_path / "sync"
    sync.mkdir()
    env = fleet_env(tmp_path, KILN_CLAIM_TTL=str(ttl), KILN_TEST_COMPILE_DELAY=str(delay),
                    FLEET_TRACE_DIR=str(tmp_path), FLEET_SYNC_DIR=str(sync))
    procs = start(3, "infer", env)
    wait_for("all three ready", lambda: all((sync / f"ready-{p.pid}").exists()
                                            for p in procs), procs)
    (sync / "go").touch()
    pid = claim_holder(tmp_path / "store")
    victim = next(p for p in procs if p.pid == pid)
    others = [p for p in procs if p is not victim]
    wait_for("both others waiting on the claim",
             lambda: all((sync / f"waiting-{p.pid}").exists() for p in others), procs)
    assert all((sync / f"waiting-{p.pid}").read_text().endswith(f":{pid}") for p in others)
    time.sleep(random.uniform(0.0, 1.0))
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    victim.wait(timeout=30)
    assert victim.returncode == -signal.SIGKILL
    survivors = [finish(p) for p in others]
    data = stats(tmp_path)
    assert data["store"]["claim_takeovers"] == 1 and data["store"]["claim_waits"] >= 2
    assert data["client"]["compiles"] == len(graph_keys(tmp_path / "store")) == 1
    # The others' waits end within the claim's expiry (no renewal seen for one TTL,
    # polled) and one compile after the takeover (its own wall time): not at the wait's
    # deadline (KILN_CLAIM_WAIT, minutes). Loading and running the graph come after.
    compile_s = max(r["counters"].get("compile_seconds", 0.0) for r in survivors)
    assert compile_s >= delay
    last = max(end for r in survivors
               for end in claim_wait_ends(tmp_path / f"trace-{r['pid']}.json"))
    assert last - killed <= 2 * ttl + compile_s + 10.0, (last - killed, compile_s)
    assert not data["store"].get("claim_deadlines")
    # The trace shows who waited (on the killed holder) and who compiled.
    for r in survivors:
        events = json.loads((tmp_path / f"trace-{r['pid']}.json").read_text())["traceEvents"]
        waits = [e["args"] for e in events if e.get("name") == "claim wait"]
        assert waits and waits[0]["holder"].endswith(f":{pid}"), waits
    compiled = [r for r in survivors if r["counters"].get("compiles")]
    assert len(compiled) == 1
    events = json.loads((tmp_path / f"trace-{compiled[0]['pid']}.json").read_text())
    claims = [e["args"] for e in events["traceEvents"] if e.get("name") == "claim"]
    assert [c["outcome"] for c in claims] == ["took over"]
