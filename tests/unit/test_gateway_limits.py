"""Issue 33 row 12, performed: thousands of slow connections with no token held
hundreds of gateway threads open. A connection now has one deadline for its whole
handshake (a byte at a time does not keep it) and the gateway serves a bounded number
at once; an honest client still gets in. The gateway is real (its socket, threads and
handshake); no farm call is made, so none stands behind it."""

from __future__ import annotations

import secrets
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kiln.frontend.transports.gateway import GatewayFarm
from kiln.workers.serve import gateway as gateway_module
from kiln.workers.serve.gateway import Gateway
from kiln.workers.serve.wire import HANDSHAKE_LIMIT, HEADER, read_frame

DEADLINE_S = 1.0
CAP = 8


@pytest.fixture
def gateway(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gateway]:
    monkeypatch.setattr(gateway_module, "HANDSHAKE_TIMEOUT_S", DEADLINE_S)
    monkeypatch.setattr(gateway_module, "MAX_CONNECTIONS", CAP, raising=False)
    served = Gateway(None, secrets.token_hex(32)).start()  # type: ignore[arg-type]
    yield served
    served.close()


def connect(gateway: Gateway) -> socket.socket:
    host, port = gateway.address.rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def test_row12_a_handshake_sent_a_byte_at_a_time_is_cut_at_one_deadline(
        gateway: Gateway) -> None:
    sock = connect(gateway)
    assert read_frame(sock, HANDSHAKE_LIMIT) is not None  # the gateway's hello
    sock.settimeout(0.25)
    drip = HEADER.pack(200) + b"\x00" * 200
    start, cut = time.monotonic(), False
    for byte in drip[:40]:  # one byte every quarter second: each read is quick
        try:
            sock.sendall(bytes([byte]))
            cut = sock.recv(1) == b""
        except TimeoutError:
            continue
        except OSError:
            cut = True
        if cut:
            break
    elapsed = time.monotonic() - start
    sock.close()
    assert cut and elapsed < DEADLINE_S + 1.0, f"still open after {elapsed:.1f}s"


def test_row12_connections_over_the_cap_are_closed_and_honest_clients_get_in(
        gateway: Gateway) -> None:
    idle = [connect(gateway) for _ in range(CAP * 4)]  # no token, never a hello back
    greeted = 0
    for sock in idle:
        try:
            greeted += read_frame(sock, HANDSHAKE_LIMIT) is not None
        except OSError:
            pass
    serving = [t for t in threading.enumerate() if t.name == "kiln-gateway-conn"]
    assert greeted <= CAP and len(serving) <= CAP
    time.sleep(DEADLINE_S + 0.5)  # their handshakes run out of time: slots free again
    for sock in idle:
        sock.close()
    honest = GatewayFarm(gateway.address, gateway.token.decode())
    honest._open().close()  # the whole handshake, both proofs
