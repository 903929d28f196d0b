"""The farm gateway: the process `kiln farm up` starts next to its Ray head, through which
clients on this machine (``KILN_FARM=local``) reach the farm without importing Ray.

It is a Ray driver of the farm (a ``RayFarm``, joined once when the farm comes up) that
listens on a TCP port (127.0.0.1 unless `kiln farm up --host` names another address) and
relays ``compile_raw``, ``tuned_raw`` and ``stats`` to the coordinator. The wire is
``wire``'s: msgpack frames, a handshake over the farm token, and every frame after it
tagged. Every byte a connection sends is hostile: a frame over ``REQUEST_LIMIT``, a bad
tag, a body that is not msgpack, an unknown call or a field of the wrong type is answered
with an error naming it, and that connection (never the gateway) is closed. A connection
has HANDSHAKE_TIMEOUT_S for its whole handshake (not per read: a byte at a time does not
keep it), at most MAX_CONNECTIONS are served at once (more are closed at once), and one
connection has at most MAX_CALLS_IN_FLIGHT calls running. The gateway
exits when the farm's Ray head does. Its address goes in the farm file (``gateway``).
"""

from __future__ import annotations

import argparse
import logging
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kiln.workers.farm_api import FarmTimeout, FarmUnavailable, probe, process_ended
from kiln.workers.ray_farm import RayFarm, use_farm_token
from kiln.workers.serve.wire import (
    HANDSHAKE_LIMIT,
    MAGIC,
    NONCE_BYTES,
    REQUEST_LIMIT,
    FrameError,
    field,
    mac,
    nonce_of,
    read_frame,
    session_key,
    write_frame,
)

log = logging.getLogger("kiln.farm")
HANDSHAKE_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 64
MAX_CALLS_IN_FLIGHT = 64
HEAD_CHECK_S = 2.0
HEAD_WAIT_S = 120.0  # how long a gateway started beside its head waits for it to answer
READY = "kiln gateway listening on "
NUMBER = (int, float)
KEY = str
# Each call's arguments, in order, with the types a request may give them.
CALLS: dict[str, tuple[tuple[str, Any], ...]] = {
    "compile_raw": (("key", KEY), ("request", bytes), ("delay", NUMBER),
                    ("traced", bool), ("timeout", (*NUMBER, type(None)))),
    "tuned_raw": (("key", KEY), ("timeout", (*NUMBER, type(None))), ("traced", bool)),
    "stats": (),
}
MAX_DELAY_S = 60.0  # the tests' compile delay (KILN_TEST_DELAY) a request may ask for


def checked_call(message: Any) -> tuple[int, str, dict[str, Any]]:
    """A request frame's call id, method and arguments by name, each checked
    (``FrameError``)."""
    call_id = field(message, "id", int, "a request")
    method = field(message, "method", str, "a request")
    args = field(message, "args", list, "a request")
    spec = CALLS.get(method)
    if spec is None:
        raise FrameError(f"call {call_id}: the gateway has no call {method[:40]!r}")
    if len(args) != len(spec):
        raise FrameError(f"call {call_id} ({method}): {len(args)} arguments, not {len(spec)}")
    named = dict(zip((name for name, _ in spec), args))
    for name, kind in spec:
        field(named, name, kind, f"call {call_id} ({method})")
    if method == "compile_raw" and not 0 <= named["delay"] <= MAX_DELAY_S:
        raise FrameError(f"call {call_id} (compile_raw): delay {named['delay']} is not "
                         f"within 0 to {MAX_DELAY_S:g} s")
    if len(named.get("key", "")) > 256:
        raise FrameError(f"call {call_id} ({method}): a key of {len(named['key'])} characters")
    return call_id, method, named


def error_fields(error: BaseException) -> dict[str, Any]:
    """An exception as an answer's ``error`` map (the client's
    ``frontend.transports.gateway.error_from`` reads it)."""
    from kiln.workers.pipeline import CompileFailure

    if isinstance(error, CompileFailure):
        return {"type": "CompileFailure", "fields": [str(a) for a in error.args]}
    kind = "FarmTimeout" if isinstance(error, FarmTimeout) else "FarmUnavailable"
    message = str(error) if isinstance(error, FarmUnavailable) else \
        f"{type(error).__name__}: {error}"
    return {"type": kind, "message": message}


class Gateway:
    """Serves ``farm``'s calls on ``host:port`` (0: a free port) to holders of ``token``."""

    def __init__(self, farm: RayFarm, token: str, host: str = "127.0.0.1", port: int = 0,
                 namespace: str | None = None) -> None:
        from kiln.workers.names import namespace_for

        if namespace is None:
            from kiln.compiler.versions import versions

            namespace = namespace_for(versions())
        self.farm, self.token, self.namespace = farm, token.encode(), namespace
        self.server = socket.create_server((host, port))
        self.address = f"{host}:{self.server.getsockname()[1]}"
        self.closed = threading.Event()
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.turned_away = 0

    def start(self) -> Gateway:
        threading.Thread(target=self.serve, daemon=True, name="kiln-gateway").start()
        return self

    def serve(self) -> None:
        """Accept connections until ``close``; each runs on a thread of its own."""
        while not self.closed.is_set():
            try:
                conn, _ = self.server.accept()
            except OSError:
                break
            if not self.slots.acquire(blocking=False):
                self.turned_away += 1
                if self.turned_away == 1:
                    log.warning("kiln gateway: %d connections are open, the most it serves; "
                                "closing new ones until some end", MAX_CONNECTIONS)
                conn.close()
                continue
            threading.Thread(target=self._connection, args=(conn,), daemon=True,
                             name="kiln-gateway-conn").start()

    def close(self) -> None:
        self.closed.set()
        try:
            self.server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.server.close()

    def _connection(self, conn: socket.socket) -> None:
        lock = threading.Lock()
        key: bytes | None = None
        calls = threading.BoundedSemaphore(MAX_CALLS_IN_FLIGHT)
        try:
            key = self._handshake(_Deadline(conn, HANDSHAKE_TIMEOUT_S))  # type: ignore[arg-type]
            conn.settimeout(None)
            while key is not None and (
                    message := read_frame(conn, REQUEST_LIMIT, key)) is not None:
                call_id, method, args = checked_call(message)
                if not calls.acquire(blocking=False):
                    raise FrameError(f"call {call_id}: {MAX_CALLS_IN_FLIGHT} calls of this "
                                     "connection are running already")
                threading.Thread(target=self._run, args=(conn, lock, key, call_id, method,
                                                         args, calls), daemon=True).start()
        except FrameError as e:
            log.warning("kiln gateway: refused a connection's frame: %s", e)
            self._refuse(conn, lock, key, f"the farm gateway refused a frame: {e}")
        except OSError as e:
            log.debug("kiln gateway: a connection failed: %s", e)
        finally:
            conn.close()
            self.slots.release()

    @staticmethod
    def _refuse(conn: socket.socket, lock: threading.Lock, key: bytes | None,
                reason: str) -> None:
        try:
            write_frame(conn, {"id": None, "ok": False,
                               "error": {"type": "FarmUnavailable", "message": reason}},
                        key, lock)
        except OSError:
            pass

    def _handshake(self, conn: socket.socket) -> bytes | None:
        """The session key once the client proved the token; None (refused) if not."""
        server_nonce = secrets.token_bytes(NONCE_BYTES)
        write_frame(conn, {"magic": MAGIC, "nonce": server_nonce})
        hello = read_frame(conn, HANDSHAKE_LIMIT)
        if hello is None:
            return None
        if field(hello, "magic", str, "the client's hello") != MAGIC:
            raise FrameError(f"the client speaks {hello['magic'][:40]!r}, not {MAGIC!r}")
        client_nonce = nonce_of(hello, "the client's hello")
        proof = field(hello, "proof", bytes, "the client's hello")
        namespace = field(hello, "namespace", str, "the client's hello")
        if not secrets.compare_digest(proof, mac(self.token, b"client", server_nonce,
                                                 client_nonce)):
            return self._deny(conn, "the client's farm token is wrong (the farm's is in its "
                                    "farm-token file)")
        if namespace != self.namespace:
            return self._deny(conn, f"the farm runs another Kiln (its namespace "
                                    f"{self.namespace}, the client's {namespace[:80]})")
        write_frame(conn, {"ok": True, "proof": mac(self.token, b"server", client_nonce,
                                                    server_nonce)})
        return session_key(self.token, server_nonce, client_nonce)

    @staticmethod
    def _deny(conn: socket.socket, reason: str) -> None:
        log.warning("kiln gateway: refused a client: %s", reason)
        write_frame(conn, {"ok": False, "error": reason})
        return None

    def _run(self, conn: socket.socket, lock: threading.Lock, key: bytes, call_id: int,
             method: str, args: dict[str, Any],
             calls: threading.BoundedSemaphore | None = None) -> None:
        try:
            self._answer(conn, lock, key, call_id, method, args)
        finally:
            if calls is not None:
                calls.release()

    def _answer(self, conn: socket.socket, lock: threading.Lock, key: bytes, call_id: int,
                method: str, args: dict[str, Any]) -> None:
        events: list[Any] = []
        try:
            value = self._dispatch(method, args, events)
            answer = {"id": call_id, "ok": True, "value": value, "events": events}
        except Exception as e:
            answer = {"id": call_id, "ok": False, "error": error_fields(e), "events": events}
        try:
            write_frame(conn, answer, key, lock)
        except (TypeError, ValueError) as e:  # an answer msgpack cannot carry
            write_frame(conn, {"id": call_id, "ok": False, "events": [], "error": {
                "type": "FarmUnavailable", "message": f"the gateway could not send the "
                f"farm's answer to {method}: {type(e).__name__}: {e}"}}, key, lock)
        except OSError:
            pass  # the client is gone

    def _dispatch(self, method: str, args: dict[str, Any], events: list[Any]) -> Any:
        """Run one checked call on the farm; its tuning timeline (if asked) in ``events``."""
        if method == "compile_raw":
            return self.farm.compile_raw(args["key"], args["request"], float(args["delay"]),
                                         args["traced"], args["timeout"])
        if method == "tuned_raw":
            result = self.farm.tuned_raw(args["key"], args["timeout"], False)
            if args["traced"]:
                events.extend(self.farm.tuning_trace(args["timeout"]))
            return result
        return self.farm.stats()


class _Deadline:
    """A connection whose reads and writes share one deadline (the whole handshake):
    each waits at most the time left, and none starts once it has passed."""

    def __init__(self, sock: socket.socket, seconds: float) -> None:
        self.sock = sock
        self.until = time.monotonic() + seconds

    def _arm(self) -> None:
        left = self.until - time.monotonic()
        if left <= 0:
            raise TimeoutError("the handshake ran past its deadline")
        self.sock.settimeout(left)

    def recv(self, size: int) -> bytes:
        self._arm()
        return self.sock.recv(size)

    def sendall(self, data: bytes) -> None:
        self._arm()
        self.sock.sendall(data)


def _watch_head(pid: int, gateway: Gateway) -> None:
    """Close the gateway once the farm's Ray head (``pid``) is gone."""
    while not gateway.closed.is_set():
        if process_ended(pid):
            gateway.close()
            return
        time.sleep(HEAD_CHECK_S)


def _join(farm: RayFarm, address: str, wait_s: float = HEAD_WAIT_S) -> None:
    """Join the farm and make its coordinator (which starts its workers) before the first
    client asks. `kiln farm up` starts this gateway beside the head, so the head may not
    answer yet: its port is awaited first."""
    deadline = time.monotonic() + wait_s
    while probe(address, timeout=1.0) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        farm.actor()
    except Exception as e:  # each call joins again and reports it
        log.warning("kiln gateway: joining the farm failed: %s", e)


def main(argv: list[str], ready: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(prog="python -m kiln.workers.serve.gateway")
    parser.add_argument("--ray", required=True, help="the farm's Ray address")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--head-pid", type=int, default=0)
    parser.add_argument("--join-now", action="store_true")
    args = parser.parse_args(argv)
    from kiln.workers.serve.farm_files import farm_token, farm_token_file

    token = farm_token()
    if token is None:
        print(f"kiln gateway: no farm token in {farm_token_file()}", file=sys.stderr)
        return 2
    use_farm_token({"token_file": str(farm_token_file())})  # the token of `kiln farm up`
    farm = RayFarm(args.ray)
    gateway = Gateway(farm, token, args.host, args.port)
    if args.join_now:
        threading.Thread(target=_join, args=(farm, args.ray), daemon=True).start()
    if args.head_pid:
        threading.Thread(target=_watch_head, args=(args.head_pid, gateway),
                         daemon=True).start()
    ready(READY + gateway.address)
    sys.stdout.flush()
    gateway.serve()
    farm.release()
    return 0


def ready_address(log_path: Path) -> str | None:
    """The gateway's address once its log says it listens; None before."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith(READY):
            return line[len(READY):].strip()
    return None


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main(sys.argv[1:]))
