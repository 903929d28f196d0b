"""The farm gateway's wire (``workers.serve.gateway``): length-prefixed msgpack frames.

A frame is an 8-byte big-endian body length, then (after the handshake) a 32-byte
HMAC-SHA256 tag of the body under the connection's session key, then the body: one
msgpack object (maps, lists, strings, bytes, numbers; nothing that runs code when read).
Each side refuses a frame longer than its limit before reading its body, a tag that does
not match, and a body that is not msgpack (``FrameError``, naming what was wrong).

The handshake proves the farm token (``farm_token_file``, mode 0600) on both sides without
sending it: the gateway sends a nonce; the client answers with its own nonce and
``HMAC(token, "client" + both nonces)``; the gateway checks it and answers
``HMAC(token, "server" + both nonces)``, which the client checks in turn. Both then tag
every frame with ``HMAC(token, "session" + both nonces)``.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import threading
from typing import Any

import msgpack

MAGIC = "kiln-gateway/1"
HEADER = struct.Struct(">Q")
TAG_BYTES = 32
NONCE_BYTES = 32
HANDSHAKE_LIMIT = 4096  # bytes of one handshake frame
REQUEST_LIMIT = 256 << 20  # a compile request (graph, shapes, options; no weights)
ANSWER_LIMIT = 2 << 30  # a compiled graph with its binaries


class FrameError(ValueError):
    """A frame that is too long, tampered with or not msgpack."""


def read_exactly(sock: socket.socket, size: int) -> bytes | None:
    """``size`` bytes from ``sock``; None when it closed (or failed) first."""
    chunks, left = [], size
    while left:
        try:
            chunk = sock.recv(min(left, 1 << 20))
        except OSError:
            return None
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def session_key(token: bytes, server_nonce: bytes, client_nonce: bytes) -> bytes:
    return mac(token, b"session", server_nonce, client_nonce)


def pack(message: Any) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(body: bytes) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, use_list=True, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for a damaged body
        raise FrameError(f"a frame's body is not msgpack ({type(e).__name__}: {e})") from None


def write_frame(sock: socket.socket, message: Any, key: bytes | None = None,
                lock: threading.Lock | None = None) -> None:
    """Send ``message`` as one frame (tagged under ``key`` when given). Raises OSError."""
    body = pack(message)
    data = HEADER.pack(len(body)) + (mac(key, body) if key else b"") + body
    if lock is None:
        sock.sendall(data)
        return
    with lock:
        sock.sendall(data)


def read_frame(sock: socket.socket, limit: int, key: bytes | None = None) -> Any:
    """The next frame's message; None when the other side closed. ``FrameError`` for a
    frame over ``limit`` bytes (its body is not read), a wrong tag or a damaged body."""
    header = read_exactly(sock, HEADER.size)
    if header is None:
        return None
    size = HEADER.unpack(header)[0]
    if size > limit:
        raise FrameError(f"a frame of {size} bytes is over the limit of {limit} bytes")
    tag = read_exactly(sock, TAG_BYTES) if key else b""
    body = read_exactly(sock, size)
    if tag is None or body is None:
        return None
    if key and not hmac.compare_digest(tag, mac(key, body)):
        raise FrameError("a frame's HMAC does not match its body (tampered with, or "
                         "another session's)")
    return unpack(body)


def field(message: Any, name: str, kind: type | tuple[type, ...], what: str) -> Any:
    """``message[name]`` checked to be of ``kind``; ``FrameError`` naming ``what``."""
    if not isinstance(message, dict):
        raise FrameError(f"{what} is not a map but {type(message).__name__}")
    value = message.get(name)
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _kinds(kind)):
        raise FrameError(f"{what}: field {name!r} is {type(value).__name__}, not "
                         f"{' or '.join(k.__name__ for k in _kinds(kind))}")
    return value


def nonce_of(message: Any, what: str) -> bytes:
    """A hello's nonce, checked to be NONCE_BYTES long."""
    nonce: bytes = field(message, "nonce", bytes, what)
    if len(nonce) != NONCE_BYTES:
        raise FrameError(f"{what}: a nonce of {len(nonce)} bytes, not {NONCE_BYTES}")
    return nonce


def _kinds(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)
