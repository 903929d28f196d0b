"""The farm gateway's wire (workers.serve.wire): frames round-trip with bytes intact, and a
frame over the limit, with a wrong tag, cut short or not msgpack is refused by name; the
gateway's request checks and the error maps both ways."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import pytest

from kiln.frontend.transports.gateway import error_from
from kiln.workers.farm_api import FarmTimeout, FarmUnavailable
from kiln.workers.pipeline import CompileFailure
from kiln.workers.serve.gateway import checked_call, error_fields
from kiln.workers.serve.wire import (
    HEADER,
    FrameError,
    field,
    mac,
    read_frame,
    session_key,
    write_frame,
)


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_frames_round_trip_with_bytes_and_tags(pair: tuple[socket.socket, socket.socket]
                                               ) -> None:
    a, b = pair
    key = session_key(b"token", os.urandom(32), os.urandom(32))
    blob = os.urandom(3 << 20)  # several recv() calls
    message = {"id": 7, "method": "compile_raw", "args": ["k", blob, 0.5, True, None]}
    sender = threading.Thread(target=write_frame, args=(a, message, key))
    sender.start()
    got = read_frame(b, 8 << 20, key)
    sender.join()
    assert got == message and isinstance(got["args"][1], bytes)
    write_frame(a, {"plain": b"x"})
    assert read_frame(b, 100) == {"plain": b"x"}
    a.close()
    assert read_frame(b, 100) is None  # closed: no frame, no error


def test_a_frame_over_the_limit_is_refused_before_its_body(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    a.sendall(HEADER.pack(1 << 40))  # claims a terabyte, sends nothing more
    with pytest.raises(FrameError, match=r"1099511627776 bytes is over the limit of 1000"):
        read_frame(b, 1000)


def test_a_wrong_tag_and_a_damaged_body_are_refused(
        pair: tuple[socket.socket, socket.socket]) -> None:
    a, b = pair
    key, other = os.urandom(32), os.urandom(32)
    write_frame(a, {"id": 1}, other)
    with pytest.raises(FrameError, match="HMAC does not match"):
        read_frame(b, 1000, key)
    body = b"\xc1\xc1\xc1"  # 0xc1 is never used by msgpack
    a.sendall(HEADER.pack(len(body)) + mac(key, body) + body)
    with pytest.raises(FrameError, match="not msgpack"):
        read_frame(b, 1000, key)
    a.sendall(HEADER.pack(100) + b"short")
    a.close()
    assert read_frame(b, 1000) is None  # cut short: the connection is over


def test_requests_are_checked_field_by_field() -> None:
    good = {"id": 3, "method": "compile_raw", "args": ["abc", b"req", 0, False, 30.0]}
    assert checked_call(good) == (3, "compile_raw", {"key": "abc", "request": b"req",
                                                     "delay": 0, "traced": False,
                                                     "timeout": 30.0})
    assert checked_call({"id": 4, "method": "stats", "args": []})[1] == "stats"
    bad = [
        ([1, 2], "a request is not a map but list"),
        ({"id": "3", "method": "stats", "args": []}, "field 'id' is str, not int"),
        ({"id": True, "method": "stats", "args": []}, "field 'id' is bool, not int"),
        ({"id": 3, "method": "__init__", "args": []}, "has no call '__init__'"),
        ({"id": 3, "method": "stats", "args": [1]}, r"call 3 \(stats\): 1 arguments, not 0"),
        ({**good, "args": ["abc", "req", 0, False, 30.0]}, "field 'request' is str, not bytes"),
        ({**good, "args": ["abc", b"r", 0, False, "x"]}, "field 'timeout' is str, not int"),
        ({**good, "args": ["abc", b"r", 1e9, False, None]}, "delay 1000000000.0 is not within"),
        ({**good, "args": ["k" * 300, b"r", 0, False, None]}, "a key of 300 characters"),
    ]
    for message, error in bad:
        with pytest.raises(FrameError, match=error):
            checked_call(message)


def test_errors_cross_the_wire_with_their_kind_and_fields() -> None:
    failure = CompileFailure("no lowering for aten.foo", "lowering", "k" * 64, "n1",
                             "aten.foo", "", "g")
    back = error_from(error_fields(failure))
    assert isinstance(back, CompileFailure)
    assert (back.stage, back.key, back.op, back.node) == ("lowering", "k" * 64, "aten.foo", "n1")
    assert str(back) == str(failure)
    timeout = error_from(error_fields(FarmTimeout("no answer within 5s")))
    assert type(timeout) is FarmTimeout and str(timeout) == "no answer within 5s"
    other = error_from(error_fields(KeyError("x")))
    assert type(other) is FarmUnavailable and str(other) == "KeyError: 'x'"
    with pytest.raises(FrameError, match="not seven strings"):
        error_from({"type": "CompileFailure", "fields": ["a", 1]})
    with pytest.raises(FrameError, match="field 'message' is NoneType"):
        error_from({"type": "FarmUnavailable"})
    assert field({"a": None}, "a", (int, type(None)), "x") is None
