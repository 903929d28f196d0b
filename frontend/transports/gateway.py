"""A client of `kiln farm up`'s gateway (``workers.serve.gateway``): the farm over one TCP
connection, without Ray. Connecting is a socket connect and ``workers.serve.wire``'s handshake
(milliseconds), done in the background when the backend is first called. The gateway's
answers are hostile until checked: every frame's tag under the session key, its fields'
types, and then ``answer_to_graph`` as for any farm's answer."""

from __future__ import annotations

import secrets
import socket
from typing import Any

from kiln.compiler import trace
from kiln.frontend.transports.relay import Answer, RelayFarm
from kiln.workers.farm_api import PROBE_TIMEOUT_S, FarmTimeout, FarmUnavailable, host_port
from kiln.workers.serve.wire import (
    ANSWER_LIMIT,
    HANDSHAKE_LIMIT,
    MAGIC,
    NONCE_BYTES,
    FrameError,
    field,
    mac,
    nonce_of,
    read_frame,
    session_key,
    write_frame,
)


def error_from(error: Any) -> Exception:
    """The exception of an answer's ``error`` map (``gateway.error_fields``)."""
    from kiln.workers.pipeline import CompileFailure

    kind = field(error, "type", str, "an error answer")
    if kind == "CompileFailure":
        fields = field(error, "fields", list, "a compile failure")
        if len(fields) != 7 or not all(isinstance(f, str) for f in fields):
            raise FrameError("a compile failure's fields are not seven strings")
        return CompileFailure(*fields)
    message = field(error, "message", str, "an error answer")
    return FarmTimeout(message) if kind == "FarmTimeout" else FarmUnavailable(message)


def own_namespace() -> str:
    """This client's farm namespace (its versions' hash), which the gateway checks."""
    from kiln.compiler.versions import versions
    from kiln.workers.names import namespace_for

    return namespace_for(versions())


class GatewayFarm(RelayFarm):
    """The farm behind the gateway at ``address`` (``host:port``), for holders of
    ``token``; the same calls as ``RayFarm``."""

    def __init__(self, address: str, token: str) -> None:
        super().__init__(address)
        self._token = token.encode()
        self._key = b""

    @property
    def description(self) -> str:
        return f"the farm gateway at {self.address}"

    def _open(self) -> socket.socket:
        target = host_port(self.address)
        if target is None:
            raise FarmUnavailable(f"the farm gateway's address {self.address!r} is not "
                                  "host:port")
        from kiln.compiler.versions import versions
        from kiln.workers.names import namespace_for

        # Before connecting: the gateway gives the whole handshake one deadline, and the
        # versions may import the compiler's dependencies.
        namespace = namespace_for(versions())
        with trace.span("connect to the farm gateway", cat="client"):
            # before connecting: computing it (it imports torch and triton, and hashes the
            # compiler's sources) can outlast the gateway's handshake limit on a busy host
            namespace = own_namespace()
            try:
                sock = socket.create_connection(target, timeout=PROBE_TIMEOUT_S)
            except OSError as e:
                raise FarmUnavailable(f"{self.description} does not answer ({e})") from None
            try:
                self._key = self._handshake(sock, namespace)
            except (OSError, FrameError, FarmUnavailable) as e:
                sock.close()
                if isinstance(e, FarmUnavailable):
                    raise
                raise FarmUnavailable(f"{self.description}: the handshake failed: {e}") \
                    from None
        sock.settimeout(None)
        return sock

    def _handshake(self, sock: socket.socket, namespace: str) -> bytes:
        """The session key, once each side proved it holds the farm token."""
        hello = read_frame(sock, HANDSHAKE_LIMIT)
        if hello is None:
            raise FarmUnavailable(f"{self.description} closed the connection (or did not "
                                  f"greet within {PROBE_TIMEOUT_S:g}s)")
        if field(hello, "magic", str, "the gateway's hello") != MAGIC:
            raise FrameError(f"the gateway speaks {hello['magic'][:40]!r}, not {MAGIC!r}")
        server_nonce = nonce_of(hello, "the gateway's hello")
        nonce = secrets.token_bytes(NONCE_BYTES)
        write_frame(sock, {"magic": MAGIC, "nonce": nonce, "namespace": namespace,
                           "proof": mac(self._token, b"client", server_nonce, nonce)})
        answer = read_frame(sock, HANDSHAKE_LIMIT)
        if answer is None:
            raise FarmUnavailable(f"{self.description} closed the connection in the "
                                  "handshake")
        if not field(answer, "ok", bool, "the gateway's answer to the hello"):
            reason = str(answer.get("error", "no reason given"))[:300]
            raise FarmUnavailable(f"{self.description} refused this client: {reason}")
        proof = field(answer, "proof", bytes, "the gateway's answer to the hello")
        if not secrets.compare_digest(proof, mac(self._token, b"server", nonce, server_nonce)):
            raise FarmUnavailable(f"{self.description} did not prove it holds the farm "
                                  "token: not the farm's gateway")
        return session_key(self._token, server_nonce, nonce)

    def _send(self, sock: socket.socket, call_id: int, method: str, args: tuple[Any, ...]
              ) -> None:
        write_frame(sock, {"id": call_id, "method": method, "args": list(args)}, self._key,
                    self._send_lock)

    def _receive(self, sock: socket.socket) -> tuple[int, Answer] | None:
        """The next answer; None (every call left fails) when the gateway is gone or sent
        a frame that does not check out."""
        try:
            message = read_frame(sock, ANSWER_LIMIT, self._key)
            if message is None:
                return None
            call_id = message.get("id") if isinstance(message, dict) else None
            if call_id is None:  # the gateway refused this connection
                self._failure = str(error_from(field(message, "error", dict, "a refusal")))
                return None
            call_id = field(message, "id", int, "an answer")
            events = field(message, "events", list, "an answer")
            if field(message, "ok", bool, "an answer"):
                return call_id, (True, message.get("value"), events)
            return call_id, (False, error_from(message.get("error")), events)
        except FrameError as e:
            self._failure = f"it sent a frame that does not check out: {e}"
            return None

    _failure = ""

    def _gone(self) -> FarmUnavailable:
        why = f": {self._failure}" if self._failure else " (the connection closed)"
        return FarmUnavailable(f"{self.description} is gone{why}")
