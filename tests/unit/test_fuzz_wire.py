"""Property-based fuzzing of what a stranger (or a token holder) can send the farm
(issue 33): the gateway's frames, before and after the handshake, and compile requests
as the coordinator and its workers decode them. None may crash the gateway, hang
(hypothesis's deadline: 5 s an example) or run code; a refusal is any ordinary error.

The suite runs KILN_FUZZ_EXAMPLES examples a property (default 300, 200 for the slower
request decoder); ``python3 bench/fuzz.py`` runs 10,000 of each."""

from __future__ import annotations

import os
import secrets
import socket
import threading
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiln.compiler.decompositions import trace_aten
from kiln.compiler.keys import compute_key
from kiln.compiler.request import CompileRequest, deserialize_graph
from kiln.frontend.core.serialize import make_request
from kiln.workers.serve.gateway import Gateway, checked_call
from kiln.workers.serve.wire import HEADER, REQUEST_LIMIT, FrameError, mac, read_frame

EXAMPLES = int(os.environ.get("KILN_FUZZ_EXAMPLES", "300"))
REQUEST_EXAMPLES = int(os.environ.get("KILN_FUZZ_REQUEST_EXAMPLES", str(min(EXAMPLES, 200))))
CRASHES = (RecursionError, MemoryError, SystemError)
FUZZ = settings(max_examples=EXAMPLES, deadline=5000, derandomize=EXAMPLES < 10_000,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
                    st.floats(allow_nan=True), st.text(max_size=40),
                    st.binary(max_size=64))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=12), inner, max_size=6)),
    max_leaves=40)


def packable(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


@pytest.fixture(scope="module")
def gateway() -> Any:
    served = Gateway(None, secrets.token_hex(32))  # type: ignore[arg-type]
    yield served
    served.close()


def serve_bytes(gateway: Gateway, data: bytes) -> None:
    """One connection of the real gateway that sends ``data`` and closes; raises what
    escaped the gateway's connection handler (nothing may)."""
    ours, theirs = socket.socketpair()
    escaped: list[BaseException] = []

    def run() -> None:
        try:
            gateway.slots.acquire()
            gateway._connection(theirs)
        except BaseException as e:
            escaped.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        ours.sendall(data)
        ours.shutdown(socket.SHUT_WR)
    except OSError:
        pass  # the gateway closed first: a refusal
    thread.join(5.0)
    ours.close()
    assert not thread.is_alive(), "the gateway's connection hung"
    assert not escaped, f"escaped the gateway: {escaped[0]!r}"


@FUZZ
@given(st.one_of(st.binary(max_size=300),
                 values.map(lambda v: HEADER.pack(len(packable(v))) + packable(v)),
                 st.builds(lambda size, tail: HEADER.pack(size) + tail,
                           st.integers(0, 2**64 - 1), st.binary(max_size=64))))
def test_gateway_survives_any_bytes_before_the_handshake(gateway: Gateway,
                                                         data: bytes) -> None:
    serve_bytes(gateway, data)


@FUZZ
@given(values, st.booleans())
def test_authenticated_frames_are_checked_or_refused(message: Any, well_formed: bool
                                                     ) -> None:
    if well_formed and isinstance(message, dict):  # close to a real call
        message = {"id": 1, "method": "compile_raw", "args": list(message.values())}
    key = b"k" * 32
    body = packable(message)
    ours, theirs = socket.socketpair()
    try:
        ours.sendall(HEADER.pack(len(body)) + mac(key, body) + body)
        ours.shutdown(socket.SHUT_WR)
        try:
            got = read_frame(theirs, REQUEST_LIMIT, key)
            checked_call(got)
        except FrameError:
            pass  # refused, with a message naming what
    finally:
        ours.close()
        theirs.close()


def honest_request(dynamic: bool) -> CompileRequest:
    args = [torch.randn(4, 8), torch.randn(8)]
    return make_request(trace_aten(lambda a, b: (a * b).relu().sum(-1), args), args,
                        options={}, target={"kind": "cpu"})


HONEST = honest_request(False).to_bytes()


def mutate(wire: Any, data: st.DataObject) -> Any:
    """``wire`` with one subtree (drawn by walking down at random) replaced."""
    if not isinstance(wire, (list, dict)) or not wire or data.draw(st.integers(0, 3)) == 0:
        return data.draw(values)
    if isinstance(wire, list):
        at = data.draw(st.integers(0, len(wire) - 1))
        return [*wire[:at], mutate(wire[at], data), *wire[at + 1:]]
    name = data.draw(st.sampled_from(sorted(wire, key=str)))
    return {**wire, name: mutate(wire[name], data)}


def decode_all(data: bytes) -> None:
    """What the coordinator and a compile worker do with request bytes."""
    try:
        request = CompileRequest.from_bytes(data)
        compute_key(request)
        deserialize_graph(request.graph)
    except CRASHES:
        raise
    except Exception:
        pass  # refused: the coordinator answers it as the caller's error


@settings(FUZZ, max_examples=REQUEST_EXAMPLES)
@given(st.data(), st.sampled_from(["outer", "graph", "bytes"]))
def test_hostile_requests_are_refused_not_run(data: st.DataObject, where: str) -> None:
    wire = msgpack.unpackb(HONEST, raw=False)
    if where == "bytes":
        raw = bytearray(HONEST)
        for _ in range(data.draw(st.integers(1, 8))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        decode_all(bytes(raw))
        return
    if where == "graph":
        graph = msgpack.unpackb(wire[2], raw=False)
        wire[2] = packable(mutate(graph, data))
    else:
        wire = mutate(wire, data)
    decode_all(packable(wire))
