"""What a farm's clients and its gateway share: the errors that send a graph back to the
client's own compile, the coordinator's answer decoded, and the quick TCP probe that fails
fast where Ray's own connect would wait minutes for a cluster that is not there.

No Ray and no torch here: a client's farm process and the gateway import this module."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from kiln.compiler import trace

if TYPE_CHECKING:
    from kiln.compiler.compiled_graph import CompiledGraph

PROBE_TIMEOUT_S = 3.0


class FarmUnavailable(RuntimeError):
    """The farm cannot compile this graph now; the client compiles it itself."""

class FarmTimeout(FarmUnavailable):
    """The farm did not answer within ``KILN_FARM_TIMEOUT``: it is up, only slow (the
    client compiles itself and stays connected)."""

class FarmNotUp(FarmUnavailable):
    """``local`` mode and no farm is up: compile here, quietly (that is the default)."""


def process_ended(pid: int) -> bool:
    """Whether process ``pid`` has exited: it is gone, or a zombie. A farm's head and
    gateway outlive the `kiln farm up` that started them, so no process of ours reaps
    them; where init does not reap orphans either (a container without an init), an
    exited one stays a zombie, which ``kill(pid, 0)`` still finds."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # another user's process: running
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[-1].split()
    except OSError:  # no /proc here, or it went meanwhile (the next look sees that)
        return False
    return bool(fields) and fields[0] in (b"Z", b"X")


def host_port(address: str) -> tuple[str, int] | None:
    """(host, port) to probe for an address; None where there is nothing to probe."""
    rest = address.removeprefix("ray://")
    if address in ("auto", "") or ":" not in rest:
        return None
    host, _, port = rest.rpartition(":")
    try:
        return host.strip("[]"), int(port)
    except ValueError:
        return None

def probe(address: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why ``address`` cannot be reached (a TCP connect), or None if it answers.

    Ray's own connect waits minutes for a cluster that is not there; this fails fast."""
    target = host_port(address)
    if target is None:
        return None
    try:
        with socket.create_connection(target, timeout=timeout):
            return None
    except OSError as e:
        return f"{target[0]}:{target[1]} does not answer ({e})"


# HTTP/2's client preface and an empty SETTINGS frame: a gRPC server (Ray's GCS, Ray
# Client's server) answers with a SETTINGS frame of its own; anything else does not.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_H2_SETTINGS = 4


def probe_ray(address: str, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """Why ``address`` is not a Ray cluster that answers (nothing listens, or what listens
    does not speak gRPC), or None if it may be one; within ``timeout``, never Ray's own
    wait. Under RAY_USE_TLS the gRPC check is left to Ray."""
    target = host_port(address)
    if target is None:
        return None
    try:
        with socket.create_connection(target, timeout=timeout) as conn:
            if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
                return None
            conn.sendall(_H2_PREFACE)
            head = _read_some(conn, 9)
    except OSError as e:
        return f"{target[0]}:{target[1]} does not answer ({e})"
    if len(head) == 9 and head[3] == _H2_SETTINGS:
        return None
    seen = f"it answered {head[:16]!r}" if head else "it answered nothing"
    return (f"{target[0]}:{target[1]} is not a Ray cluster (it does not speak gRPC: {seen}); "
            "check the address (KILN_FARM)")


def _read_some(conn: socket.socket, nbytes: int) -> bytes:
    data = b""
    try:
        while len(data) < nbytes:
            chunk = conn.recv(nbytes - len(data))
            if not chunk:
                break
            data += chunk
    except OSError:  # a timeout or a reset: what came so far is the answer
        pass
    return data


@contextmanager
def farm_waits(key: str) -> Iterator[None]:
    """The client's wait for the farm's answer, on the timeline."""
    with trace.span("farm compile (client waits)", cat="client", key=key[:16]):
        yield

def answer_to_graph(answer: dict[str, Any]) -> CompiledGraph:
    """The compiled graph of the coordinator's answer (its timeline merged here)."""
    from kiln.compiler.compiled_graph import CompiledGraph

    trace.merge(answer.pop("trace", None))
    compiled = CompiledGraph.from_dict(answer["compiled"])
    compiled.published_to = str(answer.get("published") or "")
    return compiled
