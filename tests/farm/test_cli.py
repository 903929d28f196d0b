"""The `kiln` command: precompile, stats, inspect, explain-miss, gc, farm up/down."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from farm_helpers import SRC, RayHead, python_env, run_python

from kiln.frontend.cli.main import main


def kiln(*args: str, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    """`kiln ARGS` in a fresh process (the console script is `frontend.cli.main:main`)."""
    return subprocess.run([sys.executable, "-m", "kiln.frontend.cli.main", *args], env=env, cwd=SRC,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def precompiled(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Two shape sets of a small MLP precompiled (forward and backward) in process, then
    again from the store; the environment that did it."""
    tmp_path = tmp_path_factory.mktemp("precompile")
    env = python_env(KILN_FARM="inprocess", KILN_STORE=str(tmp_path / "store"),
                     XDG_CACHE_HOME=str(tmp_path / "cache"), TRITON_INTERPRET="1",
                     KILN_DEBUG="1", KILN_DEBUG_DIR=str(tmp_path / "debug"))
    args = ["precompile", "cli_models:mlp", "--shapes", "4x16", "8x16", "--train",
            "--option", "cpu_backend=triton-interpret", "--json"]
    first = kiln(*args, env=env)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout.strip().splitlines()[-1])
    assert summary["graphs"] == summary["misses"] == summary["published"] == 4
    assert summary["eager"] == 0 and summary["problems"] == []
    assert "precompile: 100%" in first.stderr and "2/2" in first.stderr  # tqdm's display
    again = json.loads(kiln(*args, env=env).stdout.strip().splitlines()[-1])
    assert again["graphs"] == again["hits"] == 4 and again["misses"] == 0
    return env


def test_stats_json_counts_hits_misses_compiles_and_time_saved(
        precompiled: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", precompiled["XDG_CACHE_HOME"])
    assert main(["stats", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["hits"]["total"] == 4 and stats["misses"]["total"] == 4
    assert stats["hits"]["local"] == 4
    assert (stats["graphs"], stats["compiles"], stats["compiles_local"]) == (8, 4, 4)
    assert stats["time_saved_s"] > 0 and stats["compile_seconds"] > 0


def store_keys(env: dict[str, str]) -> list[str]:
    """The compiled graphs' keys (not the AOT cache's entries, which name them)."""
    from kiln.artifact_store.manifest import decode_manifest

    return sorted(p.name for p in (Path(env["KILN_STORE"]) / "ac").rglob("*") if p.is_file()
                  and decode_manifest(p.read_bytes()).meta.get("kind") != "aot")


def test_inspect_shows_manifest_kernels_lifetimes_and_wrapper(
        precompiled: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KILN_STORE", precompiled["KILN_STORE"])
    key = store_keys(precompiled)[0]
    assert main(["inspect", key]) == 0
    out = capsys.readouterr().out
    for part in (f"key          {key}", "key parts    schema", "== kernels ==",
                 "triton_", "== buffer lifetimes ==", "peak memory estimate",
                 "== wrapper (wrapper.py) ==", "def call(args):"):
        assert part in out
    assert main(["inspect", "f" * 64]) == 1


def test_explain_miss_between_keys_and_saved_requests(
        precompiled: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KILN_STORE", precompiled["KILN_STORE"])
    first, second = store_keys(precompiled)[:2]
    assert main(["explain-miss", first, second]) == 0
    assert "differs" in capsys.readouterr().out
    assert main(["explain-miss", first, first]) == 0
    assert "the keys are equal" in capsys.readouterr().out
    saved = sorted(p.parent for p in Path(precompiled["KILN_DEBUG_DIR"]).rglob("request.msgpack")
                   if p.parent.name.startswith("forward"))
    assert len(saved) >= 2
    assert all("def call(args)" in (folder / "output_code.py").read_text() for folder in saved)
    assert main(["explain-miss", str(saved[0]), str(saved[-1])]) == 0
    out = capsys.readouterr().out
    assert "inputs differs" in out and "in detail:" in out and ": shape (" in out


def test_gc_dry_run_reports_and_keeps_everything(
        precompiled: dict[str, str], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("KILN_STORE", precompiled["KILN_STORE"])
    before = store_keys(precompiled)
    assert main(["gc", "--dry-run", "--max-age", "0s"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["dry_run"] is True and store_keys(precompiled) == before


# A `local` client: prints where it compiled and which cluster it joined.
LOCAL_CLIENT = """
import json, sys
from farm_helpers import cuda_request
from kiln.frontend.core.client import KilnClient
from kiln.frontend.config import KilnConfig
client = KilnClient(KilnConfig.resolve())
result = client.compile(cuda_request(shapes=((4, 8), (8, 8))))
print(json.dumps({"source": result.source, "joined": client.farm.joined,
                  "ray": "ray" in sys.modules}))
"""


def test_farm_up_serves_local_clients_and_farm_down_stops_it(tmp_path: Path) -> None:
    env = python_env(XDG_CACHE_HOME=str(tmp_path / "cache"), KILN_STORE=str(tmp_path / "s"))
    up = kiln("farm", "up", "--num-cpus", "1", "--no-warm", env=env)
    try:
        assert up.returncode == 0, up.stderr[-3000:]
        farm_file = json.loads((tmp_path / "cache" / "kiln" / "farm.json").read_text())
        assert farm_file["address"] in up.stdout
        status = kiln("farm", "status", env=env)
        assert status.returncode == 0 and "up" in status.stdout
        # Through the farm's gateway: the client never imports Ray.
        out = run_python(LOCAL_CLIENT, {**env, "KILN_FARM": "local"})
        assert out == {**out, "source": "farm", "joined": farm_file["gateway"], "ray": False}
        # A gateway that died is started again by the next `farm up` (Ray kept running).
        os.kill(int(farm_file["gateway_pid"]), signal.SIGKILL)
        again = kiln("farm", "up", "--num-cpus", "1", "--no-warm", env=env)
        assert again.returncode == 0 and "already running" in again.stdout, again.stderr
        farm_file = json.loads((tmp_path / "cache" / "kiln" / "farm.json").read_text())
        assert farm_file["gateway"] in again.stdout
        out = run_python(LOCAL_CLIENT, {**env, "KILN_FARM": "local", "KILN_STORE":
                                        str(tmp_path / "s-again")})
        assert out == {**out, "source": "farm", "joined": farm_file["gateway"], "ray": False}
        # Asked for another size while one runs: said so, never silently ignored.
        changed = kiln("farm", "up", "--num-cpus", "2", "--no-warm", env=env)
        assert changed.returncode == 1, changed.stdout + changed.stderr
        assert "--num-cpus 1 (asked: 2)" in changed.stderr
        assert "`kiln farm down`" in changed.stderr
    finally:
        down = kiln("farm", "down", env=env)
    assert down.returncode == 0 and "stopped" in down.stdout
    assert _ended(int(farm_file["gateway_pid"]), 10.0)  # the gateway went too
    assert not (tmp_path / "cache" / "kiln" / "farm.json").exists()
    assert kiln("farm", "status", env=env).returncode == 1
    # No farm up: a `local` client compiles in process at once, and says nothing.
    out = run_python(LOCAL_CLIENT, {**env, "KILN_FARM": "local", "KILN_STORE":
                                    str(tmp_path / "s2")})
    assert out == {**out, "source": "local", "joined": None}
    assert "KilnFarmWarning" not in out.get("_stderr", "")


def _ended(pid: int, within: float) -> bool:
    """Whether ``pid`` is gone (or a zombie) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def test_farm_status_names_the_missing_token_and_keeps_rays_noise_out(tmp_path: Path) -> None:
    """A cluster with token authentication: without the token, one Kiln line naming the
    fix (and none of Ray's InvalidAuthToken retries); with it, pure JSON, every counter."""
    token = secrets.token_hex(32)
    head = RayHead(tmp_path / "head.log", num_cpus=1,
                   env={"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token})
    try:
        env = python_env(HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "cache"),
                         KILN_FARM=head.address)
        for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_AUTH_MODE"):
            env.pop(name, None)
        refused = kiln("farm", "status", env=env)
        assert refused.returncode == 1, refused.stderr[-3000:]
        assert "set RAY_AUTH_TOKEN" in refused.stdout and len(refused.stdout.splitlines()) == 1
        assert "InvalidAuthToken" not in refused.stdout + refused.stderr
        assert "Traceback" not in refused.stdout + refused.stderr
        joined = kiln("farm", "status", "--json", env={**env, "RAY_AUTH_TOKEN": token})
        assert joined.returncode == 0, joined.stderr[-3000:]
        status = json.loads(joined.stdout)
        assert status["up"] is True and status["counters"]["requests"] == 0
        assert {"graph_compiles", "kernel_compiles", "deduplicated"} <= set(status["counters"])
    finally:
        head.stop()
