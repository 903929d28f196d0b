"""A client process that compiled through `kiln farm up`'s farm exits cleanly and promptly
(issue 10: farm rows of bench/coldstart.py died at exit with Ray's "The core worker has
already been shutdown", or hung). The farm has a fake GPU (``--num-gpus 1`` and the
tests' fake benchmark), so the farm autotunes each CUDA graph in the background and the
client's tuning thread is still waiting on the farm when the program ends. The client
reaches the farm through its gateway (no Ray here): exit waits for the tuning, then
closes the socket, and never hangs on it.

The client compiles a CPU model of two graphs (a graph break) with ``backend="kiln"``
through the farm and checks it against eager, then one CUDA graph (a request traced here,
cross-compiled by the farm) whose tuning is pending, and ends."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from farm_helpers import SRC, python_env, run_python

from kiln.artifact_store import open_store

FAKE_MS = 300  # per timed candidate: the CUDA graph's tuning takes a few seconds

CLIENT = """
import json, sys, time, warnings
import torch
from farm_helpers import cuda_request
from kiln.frontend.core.fallback import KilnFallbackWarning
from kiln.frontend.core.client import client_for
from kiln.frontend.config import KilnConfig

warnings.simplefilter("error", KilnFallbackWarning)

def model(x, w):
    h = torch.softmax(x @ w, -1) * 2
    torch._dynamo.graph_break()
    return torch.tanh(h + x.sum(0))

x, w = torch.randn(8, {n}), torch.randn({n}, {n})
compiled = torch.compile(model, backend="kiln", options={{"cpu_backend": "triton-interpret"}})
out = compiled(x, w)
torch.testing.assert_close(out, model(x, w), rtol=1e-4, atol=1e-4)
x2 = torch.randn(8, {n})  # fresh inputs, same graphs
torch.testing.assert_close(compiled(x2, w), model(x2, w), rtol=1e-4, atol=1e-4)
client = client_for(KilnConfig.resolve())
cuda = client.compile(cuda_request(shapes=((16, {n}), ({n}, {n}))))
print(json.dumps({{"counters": client.counters.snapshot(), "cuda_key": cuda.key.key,
                  "cuda_source": cuda.source,
                  "tuning_pending": bool(cuda.compiled.stats.get("autotune_pending")),
                  "tuner_threads": client.tuner.pending(), "printed_at": time.time(),
                  "ray_imported": "ray" in sys.modules}}))
"""


@pytest.fixture(scope="module")
def farm_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """`kiln farm up` (2 CPUs, one fake GPU); the environment of its clients."""
    root = tmp_path_factory.mktemp("farm-exit")
    env = python_env(XDG_CACHE_HOME=str(root / "farm-cache"), KILN_STORE=str(root / "store"),
                     KILN_FARM_FILE=str(root / "farm.json"), KILN_TEST_FAKE_AUTOTUNE="1",
                     KILN_TEST_FAKE_AUTOTUNE_MS=str(FAKE_MS))
    command = [sys.executable, "-m", "kiln.frontend.cli.main", "farm"]
    try:
        up = subprocess.run(command + ["up", "--num-cpus", "2", "--num-gpus", "1"], env=env,
                            cwd=SRC, capture_output=True, text=True, timeout=300)
        assert up.returncode == 0, up.stderr[-3000:]
        assert "gateway for local clients at 127.0.0.1:" in up.stdout, up.stdout
        assert "does not serve" not in up.stderr, up.stderr[-3000:]  # checked by `farm up`
        yield {**env, "KILN_FARM": "local", "TRITON_INTERPRET": "1",
               "XDG_CACHE_HOME": str(root / "client-cache"), "KILN_TRACE": str(root / "t.json")}
    finally:
        subprocess.run(command + ["down"], env=env, cwd=SRC, capture_output=True, timeout=120)


def run_client(env: dict[str, str], n: int) -> tuple[dict[str, object], float]:
    """The client's JSON, and the seconds from its last line to its exit (code 0, or
    ``run_python`` fails the test; a hang runs into its timeout)."""
    out = run_python(CLIENT.format(n=n), env, timeout=300)
    exit_s = time.time() - float(out["printed_at"])  # type: ignore[arg-type]
    stderr = str(out["_stderr"])
    assert "core worker has already been shutdown" not in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    counters = out["counters"]
    assert isinstance(counters, dict)
    # Every graph came from the farm: two CPU graphs of the model, one CUDA graph.
    assert counters["graphs"] == counters["compiles_farm"] == 3, counters
    assert counters.get("compiles_local", 0) == 0 and counters.get("farm_fallbacks", 0) == 0
    assert out["cuda_source"] == "farm" and out["tuning_pending"] is True
    assert int(out["tuner_threads"]) >= 1  # type: ignore[call-overload]
    assert out["ray_imported"] is False  # through the farm's gateway: one socket to close
    return out, exit_s


def client_stats(env: dict[str, str]) -> dict[str, object]:
    proc = subprocess.run([sys.executable, "-m", "kiln.frontend.cli.main", "stats", "--json"],
                          env=env, cwd=SRC, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stats: dict[str, object] = json.loads(proc.stdout)
    return stats


def test_a_client_waits_for_the_farms_tuning_then_exits_cleanly(
        farm_up: dict[str, str], tmp_path: Path) -> None:
    env = {**farm_up, "KILN_AUTOTUNE_EXIT_WAIT": "120", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    out, exit_s = run_client(env, n=24)
    # Exit waited for the farm's tuning (Ray still connected) and published it.
    assert exit_s < 90, f"the client took {exit_s:.0f}s to exit"
    assert out["counters"].get("autotune_publishes", 0) == 0  # type: ignore[attr-defined]
    assert client_stats(env)["autotune_publishes"] == 1
    manifest = open_store(farm_up["KILN_STORE"], stats_file=False).get_manifest(
        str(out["cuda_key"]))
    assert manifest is not None and manifest["graph"]["autotuned"] is True
    assert Path(farm_up["KILN_TRACE"]).exists()


def test_a_client_past_its_exit_wait_stops_waiting_and_exits_cleanly(
        farm_up: dict[str, str], tmp_path: Path) -> None:
    """No time left for tuning at exit: the tuning thread is refused Ray (or stops
    waiting on it) and the process leaves at once, publishing nothing."""
    env = {**farm_up, "KILN_AUTOTUNE_EXIT_WAIT": "0", "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    _, exit_s = run_client(env, n=40)
    assert exit_s < 30, f"the client took {exit_s:.0f}s to exit"
    assert client_stats(env)["autotune_publishes"] == 0
