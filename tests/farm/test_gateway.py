"""`kiln farm up`'s gateway (workers.serve.gateway) in front of the session's real Ray farm: a
compile through it gives the in-process artifact byte for byte; a client process that
compiles through it never imports Ray; a wrong token is refused (the client compiles
itself, one farm warning); oversized, untagged and malformed frames are refused by name
and the gateway serves on; a gateway killed mid-call costs one local compile."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from farm_helpers import (
    RayHead,
    blob_digests,
    cuda_request,
    python_env,
    run_python,
    session_ray_token,
)

from kiln.frontend.config import KilnConfig
from kiln.frontend.core.client import KilnClient, KilnFarmWarning
from kiln.frontend.transports.gateway import GatewayFarm
from kiln.workers import FARM_COUNTERS
from kiln.workers.farm_api import FarmUnavailable
from kiln.workers.ray_farm import RayFarm
from kiln.workers.serve.gateway import Gateway, ready_address
from kiln.workers.serve.wire import HEADER, MAGIC, mac, pack, read_frame, write_frame


@pytest.fixture
def gateway(farm: RayFarm) -> Iterator[Gateway]:
    """A gateway in this process, relaying to the session farm (this process's RayFarm)."""
    served = Gateway(farm, secrets.token_hex(32)).start()
    yield served
    served.close()


def client_with(farm: object, store: Path) -> KilnClient:
    return KilnClient(KilnConfig.resolve({"farm": "inprocess", "store": str(store)}),
                      farm=farm)  # type: ignore[arg-type]


def test_a_compile_through_the_gateway_matches_inprocess_byte_for_byte(
        gateway: Gateway, tmp_path: Path) -> None:
    request = cuda_request(shapes=((12, 32), (32, 32)), options={"tag": "gateway"})
    inprocess = KilnClient(KilnConfig.resolve({"farm": "inprocess",
                                               "store": str(tmp_path / "a")}))
    local = inprocess.compile(request)
    remote = GatewayFarm(gateway.address, gateway.token.decode())
    try:
        through = client_with(remote, tmp_path / "b")
        with warnings.catch_warnings():
            warnings.simplefilter("error", KilnFarmWarning)
            result = through.compile(request)
        assert (local.source, result.source) == ("local", "farm")
        assert result.key.key == local.key.key
        digests = blob_digests(through.store.get(result.key.key))
        assert digests == blob_digests(inprocess.store.get(local.key.key))
        assert any(name.endswith(".cubin") for name in digests)
        stats = remote.stats()
        assert set(FARM_COUNTERS) <= set(stats) and stats["requests"] >= 1
    finally:
        remote.release()


CLIENT = """
import json, sys, time, warnings
import torch
from kiln.frontend.core.fallback import KilnFallbackWarning
from kiln.frontend.core.client import KilnFarmWarning, client_for
from kiln.frontend.config import KilnConfig

warnings.simplefilter("error", KilnFallbackWarning)
warnings.simplefilter("error", KilnFarmWarning)

def model(x, w):
    return torch.tanh(torch.softmax(x @ w, -1) * 3 + x.mean(0))

x, w = torch.randn(8, 20), torch.randn(20, 20)
compiled = torch.compile(model, backend="kiln", options={"cpu_backend": "triton-interpret"})
torch.testing.assert_close(compiled(x, w), model(x, w), rtol=1e-4, atol=1e-4)
x2 = torch.randn(8, 20)
torch.testing.assert_close(compiled(x2, w), model(x2, w), rtol=1e-4, atol=1e-4)
client = client_for(KilnConfig.resolve())
print(json.dumps({"counters": client.counters.snapshot(), "farm": type(client.farm._ray).__name__,
                  "ray_imported": "ray" in sys.modules}))
"""


def farm_file_for(tmp_path: Path, ray_address: str, gateway: str, token: str) -> Path:
    """A farm file (and token file) as `kiln farm up` writes them."""
    path = tmp_path / "farm" / "farm.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    token_file = path.with_name("farm-token")
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    path.write_text(json.dumps({"address": ray_address, "gateway": gateway,
                                "token_file": str(token_file), "pid": 0}))
    return path


def test_a_client_process_compiles_through_the_gateway_without_ray(
        gateway: Gateway, ray_cluster: RayHead, tmp_path: Path) -> None:
    timeline = tmp_path / "t.json"
    farm_file = farm_file_for(tmp_path, ray_cluster.address, gateway.address,
                              gateway.token.decode())
    env = python_env(XDG_CACHE_HOME=str(tmp_path / "cache"), KILN_STORE=str(tmp_path / "s"),
                     KILN_FARM="local", KILN_FARM_FILE=str(farm_file), TRITON_INTERPRET="1",
                     KILN_TRACE=str(timeline))
    out = run_python(CLIENT, env, timeout=300)
    counters = out["counters"]
    assert counters["graphs"] == counters["compiles_farm"] == 1, counters
    assert counters.get("farm_fallbacks", 0) == 0
    assert out["farm"] == "GatewayFarm" and out["ray_imported"] is False
    events = json.loads(timeline.read_text())["traceEvents"]
    connects = [e for e in events if e.get("name") == "connect to the farm gateway"]
    assert len(connects) == 1 and connects[0]["args"]["background"] is True
    assert connects[0]["dur"] < 2e6  # a socket connect and a handshake: not Ray's join
    assert {"farm compile (client waits)", "graph stage"} <= {e.get("name") for e in events}


def test_a_wrong_token_is_refused_and_the_client_compiles_itself(
        gateway: Gateway, tmp_path: Path) -> None:
    stranger = GatewayFarm(gateway.address, secrets.token_hex(32))
    with pytest.raises(FarmUnavailable, match="refused this client: the client's farm token "
                                              "is wrong"):
        stranger.stats()
    client = client_with(GatewayFarm(gateway.address, "not the token"), tmp_path / "s")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results = [client.compile(cuda_request(shapes=((4, n), (n, n)))) for n in (8, 12)]
    farm_warnings = [w for w in caught if issubclass(w.category, KilnFarmWarning)]
    assert len(farm_warnings) == 1 and "token is wrong" in str(farm_warnings[0].message)
    assert [r.source for r in results] == ["local", "local"]


def _handshake(address: str, token: bytes) -> tuple[socket.socket, bytes]:
    """A raw connection past the handshake, and its session key."""
    from kiln.compiler.versions import versions
    from kiln.workers.names import namespace_for
    from kiln.workers.serve.wire import session_key

    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    hello = read_frame(sock, 4096)
    nonce = os.urandom(32)
    write_frame(sock, {"magic": MAGIC, "nonce": nonce, "namespace": namespace_for(versions()),
                       "proof": mac(token, b"client", hello["nonce"], nonce)})
    assert read_frame(sock, 4096)["ok"] is True
    return sock, session_key(token, hello["nonce"], nonce)


def _refusal(sock: socket.socket, key: bytes | None) -> str:
    answer = read_frame(sock, 1 << 20, key)
    assert answer["id"] is None and answer["ok"] is False
    assert read_frame(sock, 1 << 20, key) is None  # and the connection is closed
    sock.close()
    return str(answer["error"]["message"])


def test_bad_frames_are_refused_by_name_and_the_gateway_serves_on(gateway: Gateway) -> None:
    token = gateway.token
    host, _, port = gateway.address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    read_frame(sock, 4096)
    sock.sendall(HEADER.pack(1 << 33))  # a hello of 8 GiB
    assert "over the limit of 4096 bytes" in _refusal(sock, None)
    sock = socket.create_connection((host, int(port)), timeout=30)
    read_frame(sock, 4096)
    write_frame(sock, {"magic": MAGIC, "nonce": b"abc", "proof": b"", "namespace": ""})
    assert "a nonce of 3 bytes, not 32" in _refusal(sock, None)
    sock = socket.create_connection((host, int(port)), timeout=30)
    read_frame(sock, 4096)
    write_frame(sock, {"magic": "http/1.1"})
    assert "the client speaks 'http/1.1'" in _refusal(sock, None)
    sock, key = _handshake(gateway.address, token)
    sock.sendall(HEADER.pack(1 << 40))
    assert "over the limit" in _refusal(sock, key)
    sock, key = _handshake(gateway.address, token)
    body = pack({"id": 1, "method": "stats", "args": []})
    sock.sendall(HEADER.pack(len(body)) + b"\0" * 32 + body)  # a forged tag
    assert "HMAC does not match" in _refusal(sock, key)
    sock, key = _handshake(gateway.address, token)
    body = b"\xc1" * 10
    sock.sendall(HEADER.pack(len(body)) + mac(key, body) + body)
    assert "not msgpack" in _refusal(sock, key)
    sock, key = _handshake(gateway.address, token)
    write_frame(sock, {"id": 2, "method": "compile_raw", "args": ["k", "not bytes", 0, False,
                                                                  None]}, key)
    assert "field 'request' is str, not bytes" in _refusal(sock, key)
    remote = GatewayFarm(gateway.address, token.decode())
    try:  # still serving
        assert set(FARM_COUNTERS) <= set(remote.stats())
    finally:
        remote.release()


def test_a_gateway_killed_mid_call_costs_one_local_compile(
        farm: RayFarm, ray_cluster: RayHead, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    token = secrets.token_hex(32)
    # No Ray address in its farm file: the gateway joins the session's cluster with that
    # cluster's own Ray token (Ray turns token authentication on for the clusters it
    # starts), not the farm token, which only guards the gateway's socket.
    farm_file = farm_file_for(tmp_path, "", "", token)
    log = tmp_path / "gateway.log"
    env = python_env(KILN_FARM_FILE=str(farm_file), **session_ray_token())
    with log.open("w") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "kiln.workers.serve.gateway", "--ray",
                                 ray_cluster.address, "--join-now"], env=env, stdout=sink,
                                stderr=subprocess.STDOUT, cwd=os.environ["FARM_TEST_SRC"])
    try:
        address = _wait_for(lambda: ready_address(log), proc, log)
        remote = GatewayFarm(address, token)
        # joined, through the process's own Ray: the coordinator's counters come back
        assert set(FARM_COUNTERS) <= set(remote.stats())
        monkeypatch.setenv("KILN_TEST_COMPILE_DELAY", "20")
        client = client_with(remote, tmp_path / "s")

        def kill_mid_call() -> None:
            proc.send_signal(signal.SIGKILL)
            # The delay kept the farm's compile running; the local compiles that follow
            # would sleep it too (the compile path reads it in this process).
            os.environ.pop("KILN_TEST_COMPILE_DELAY", None)

        threading.Timer(3.0, kill_mid_call).start()
        start = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            results = [client.compile(cuda_request(shapes=((5, n), (n, n)))) for n in (8, 16)]
        assert time.monotonic() - start < 60
        farm_warnings = [w for w in caught if issubclass(w.category, KilnFarmWarning)]
        assert len(farm_warnings) == 1, [str(w.message) for w in caught]
        assert "gateway at" in str(farm_warnings[0].message)
        assert [r.source for r in results] == ["local", "local"]
        assert remote._sock is None  # given up: released, nothing left open
    finally:
        proc.kill()
        proc.wait(30)


def _wait_for(found: object, proc: subprocess.Popen[bytes], log: Path) -> str:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        value = found()  # type: ignore[operator]
        if value:
            return str(value)
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.1)
    raise TimeoutError(log.read_text()[-3000:])
