"""A farm address where something other than Ray listens is refused at once, in words
that do not blame the Ray token: `probe_ray` speaks HTTP/2's preface, which Ray's gRPC
servers answer with a SETTINGS frame and other servers do not."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from kiln.workers.farm_api import FarmUnavailable, probe_ray

H2_SETTINGS = bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


@contextmanager
def server(answer: Callable[[socket.socket], None]) -> Iterator[str]:
    """A TCP server on loopback that runs `answer` on each connection."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            with conn:
                answer(conn)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()


def _http(conn: socket.socket) -> None:
    conn.recv(1024)
    conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")


def _grpc(conn: socket.socket) -> None:
    conn.sendall(H2_SETTINGS)
    conn.recv(1024)


def _silent(conn: socket.socket) -> None:
    conn.recv(1024)


def test_an_http_server_is_not_a_ray_cluster() -> None:
    with server(_http) as address:
        reason = probe_ray(address, timeout=2.0)
    assert reason is not None and "is not a Ray cluster (it does not speak gRPC" in reason
    assert "HTTP/1.1" in reason and "RAY_AUTH_TOKEN" not in reason


def test_a_silent_server_is_not_a_ray_cluster() -> None:
    with server(_silent) as address:
        reason = probe_ray(address, timeout=0.5)
    assert reason is not None and "it answered nothing" in reason


def test_a_grpc_server_may_be_ray_and_nothing_listening_does_not_answer() -> None:
    with server(_grpc) as address:
        assert probe_ray(address, timeout=2.0) is None
        assert probe_ray("ray://" + address, timeout=2.0) is None
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()
    assert "does not answer" in str(probe_ray(f"127.0.0.1:{port}", timeout=1.0))


def test_a_client_joining_a_non_ray_address_gives_up_with_the_reason() -> None:
    pytest.importorskip("ray")
    from kiln.workers.ray_farm import RayFarm

    with server(_http) as address:
        farm = RayFarm(address)
        with pytest.raises(FarmUnavailable, match="is not a Ray cluster") as caught:
            farm.actor()
    assert "RAY_AUTH_TOKEN" not in str(caught.value)
