"""The farm's side of the trust model (issue 14), on real Ray clusters: a caller who
names another graph's key, the farm as the builder that signs and publishes (clients
holding the public key only read), and `kiln farm up`'s token on its network port."""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from farm_helpers import SRC, cuda_request, python_env, s3_env

from kiln.artifact_store import generate_ed25519_key
from kiln.artifact_store.signing import ed25519_available
from kiln.compiler.keys import compute_key
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.client import KilnClient
from kiln.workers.pipeline import compile_inprocess
from kiln.workers.ray_farm import RayFarm


def victim_and_attacker() -> tuple[Any, Any]:
    victim = cuda_request(shapes=((16, 48), (48, 48)))
    attacker = cuda_request(lambda x, w: (x @ w).relu() * 3.0, shapes=((16, 48), (48, 48)))
    return victim, attacker


def test_planted_result_under_another_key_is_refused(farm: RayFarm) -> None:
    import ray

    victim, attacker = victim_and_attacker()
    victim_key = compute_key(victim).key
    actor = farm.actor()
    # The attack: the attacker's graph, claimed to be the victim's key.
    with pytest.raises(ray.exceptions.RayTaskError, match="hash to key"):
        ray.get(actor.compile.remote(attacker.to_bytes(), 0.0, victim_key), timeout=300)
    # Without a claim the attacker's result goes under the key of its own bytes.
    answer = ray.get(actor.compile.remote(attacker.to_bytes(), 0.0), timeout=300)
    assert answer["key"] == compute_key(attacker).key != victim_key
    # The victim gets its own graph, byte for byte what it compiles alone.
    got = farm.compile(victim_key, victim)
    alone = compile_inprocess(victim.to_bytes(), victim_key)
    assert got.wrapper_source == alone.wrapper_source
    assert [k.source for k in got.kernels] == [k.source for k in alone.kernels]


@pytest.mark.skipif(not ed25519_available(), reason="needs cryptography")
def test_farm_signs_and_publishes_clients_with_the_public_key_only_read(
        farm: RayFarm, s3_server: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    from kiln.workers.coordinator import get_farm_actor

    private, public = generate_ed25519_key()
    store_env = s3_env(s3_server, f"builder-{os.getpid()}")
    builder_env = {**store_env, "KILN_SIGNING_KEY": private, "KILN_STATS_FILE": "off",
                   "XDG_CACHE_HOME": str(tmp_path / "builder-cache")}
    # A coordinator whose processes hold the private key (a deployed farm has it in its
    # image's environment); the session's own coordinator holds none.
    builder = RayFarm(farm.address)
    builder._actor = get_farm_actor(1, name="KilnFarmBuilder",
                                    runtime_env={"env_vars": builder_env})
    ray.get(builder._actor.wait_warm.remote(), timeout=300)
    for name, value in {**store_env, "KILN_SIGNING_KEY": public, "KILN_FARM": "inprocess",
                        "KILN_LOCAL_CACHE": "off"}.items():
        monkeypatch.setenv(name, value)
    client = KilnClient(KilnConfig.resolve(), farm=builder)
    assert not client.store.can_publish  # a public key verifies; it cannot sign

    victim, _ = victim_and_attacker()
    result = client.compile(victim, "victim")
    assert result.source == "farm"
    assert client.store.stats()["publishes"] == 0  # the client published nothing
    described = client.store.describe(result.key.key)
    assert described is not None and described["signature"]["alg"] == "ed25519"
    assert described["meta"]["compile"]["mode"] == "farm"
    again = KilnClient(KilnConfig.resolve(), farm=builder).compile(victim, "victim")
    assert again.source == "hit" and again.key == result.key
    assert again.compiled.wrapper_source == result.compiled.wrapper_source
    ray.kill(builder._actor)


TASK = """
import json, os, sys, ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False)
    pid = ray.get(ray.remote(lambda: os.getpid()).remote(), timeout=60)
    print(json.dumps({"ran": True}))
except Exception as e:
    print(json.dumps({"ran": False, "error": f"{type(e).__name__}: {e}"[:300]}))
"""


def run_task(address: str, env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-c", TASK, address], env=env, cwd=SRC,
                          capture_output=True, text=True, timeout=240)
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def listening_sockets(pids: set[int]) -> list[tuple[str, str]]:
    """(local address, process name) of every TCP socket listening in one of `pids`,
    from `ss -ltnpH`."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        fields = line.split()
        for name, pid in re.findall(r'\("([^"]+)",pid=(\d+)', line):
            if int(pid) in pids:
                found.append((fields[3], name))
    return found


def cluster_pids(head_pid: int) -> set[int]:
    """The Ray head's process and all its descendants: GCS, raylet, agents, workers."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat_line = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat_line.rsplit(")", 1)[1].split()[1])
    found = {head_pid}
    while True:
        more = {pid for pid, parent in parents.items() if parent in found} - found
        if not more:
            return found
        found |= more


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs `ss` (iproute2)")
def test_farm_up_listens_on_loopback_only_and_refuses_callers_without_the_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The attacks: reach `kiln farm up`'s Ray ports from another machine (a port on a
    non-loopback address), or from this one without the token, and run code there.
    Every port of the farm's processes, workers included, listens on 127.0.0.1 only;
    a caller without the token is refused."""
    from kiln.workers import ray_farm as farm_module
    from kiln.workers.serve import cluster as farm_cluster

    monkeypatch.setenv("KILN_FARM_FILE", str(tmp_path / "farm.json"))
    info = farm_cluster.start_local_cluster(num_cpus=1)
    try:
        assert info["address"].startswith("127.0.0.1:"), info["address"]
        token_file = Path(info["token_file"])
        assert stat.S_IMODE(token_file.stat().st_mode) == 0o600 and info["auth"] == "token"
        home = tmp_path / "stranger-home"  # no ~/.ray/auth_token either
        home.mkdir()
        stranger = {k: v for k, v in python_env(HOME=str(home)).items()
                    if not k.startswith("RAY_AUTH")}
        stranger[farm_module.RAY_LOOPBACK_ENV] = "0"  # or Ray cannot find loopback at all
        refused = run_task(info["address"], stranger)
        assert not refused["ran"], refused
        trusted = dict(stranger, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token_file.read_text())
        assert run_task(info["address"], trusted)["ran"]  # a worker process started too
        # The gateway (a Ray driver of the farm and a TCP server) counts as the farm's.
        assert info["gateway"].startswith("127.0.0.1:"), info
        gateway_pid = int(info["gateway_pid"])
        assert any(a == info["gateway"] for a, _ in listening_sockets({gateway_pid}))
        sockets = listening_sockets(cluster_pids(int(info["pid"])) | {gateway_pid})
        names = {name for _, name in sockets}
        assert {"gcs_server", "raylet"} <= names, sockets
        assert any(name.startswith("ray::") for name in names), sockets  # workers, agents
        exposed = [(a, n) for a, n in sockets
                   if a.rsplit(":", 1)[0].strip("[]").removeprefix("::ffff:") != "127.0.0.1"]
        assert not exposed, f"Ray ports open beyond loopback: {exposed}"
        printed = farm_cluster.auth_instructions(info)
        assert str(token_file) in printed and "127.0.0.1 only" in printed
    finally:
        farm_cluster.stop_local_cluster()
