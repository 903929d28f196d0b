"""The client's farm process (frontend.transports.process): its wire, when it is used, and a
farm that cannot be reached reported through it by name, the child exiting once let go.
(A real farm behind it: tests/farm/test_farm_process.py.)"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kiln.frontend.config import KilnConfig
from kiln.frontend.core.compile import build_request
from kiln.frontend.core.keys import compute_key
from kiln.frontend.transports.modes import LocalFarm, farm_for, remote_farm
from kiln.frontend.transports.process import ENV, ProcessFarm, receive, send, wanted
from kiln.workers.farm_api import FarmUnavailable


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("KILN_FARM_FILE", str(tmp_path / "farm.json"))
    monkeypatch.delenv(ENV, raising=False)


def test_messages_cross_the_wire_whole_and_a_closed_end_reads_none() -> None:
    ours, theirs = socket.socketpair()
    blob = os.urandom(3 << 20)  # bigger than one recv
    lock = threading.Lock()
    sender = threading.Thread(target=send, args=(ours, lock, (7, "compile_raw", (blob,))))
    sender.start()
    assert receive(theirs) == (7, "compile_raw", (blob,))
    sender.join()
    ours.close()
    assert receive(theirs) is None
    theirs.close()


def test_a_farm_address_goes_through_a_child_only_when_asked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV, raising=False)  # the default: joined in this process
    assert not wanted() and not isinstance(remote_farm("127.0.0.1:1"), ProcessFarm)
    monkeypatch.setenv(ENV, "1")
    # Earlier tests of the suite may have connected this process to Ray: hide it here, then
    # check that a process connected to Ray keeps its connection even when asked.
    with monkeypatch.context() as ray_here:
        ray_here.delitem(sys.modules, "ray", raising=False)
        assert wanted() and isinstance(remote_farm("127.0.0.1:1"), ProcessFarm)
        ray_here.setitem(sys.modules, "ray", SimpleNamespace(is_initialized=lambda: True))
        assert not wanted() and not isinstance(remote_farm("127.0.0.1:1"), ProcessFarm)
    monkeypatch.setenv(ENV, "0")
    assert not wanted() and not isinstance(remote_farm("127.0.0.1:1"), ProcessFarm)
    assert isinstance(farm_for("local"), LocalFarm)  # local keeps its own checks


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_unreachable_farm_is_named_through_the_child_which_exits_when_let_go() -> None:
    from kiln.compiler.decompositions import trace_aten

    x = torch.randn(8, 16)
    gm = trace_aten(lambda a: torch.relu(a * 2 + 1).sum(-1), [x])
    request = build_request(gm, [x], KilnConfig.resolve({}))
    address = f"127.0.0.1:{_free_port()}"  # nothing listens there
    farm = ProcessFarm(address)
    with pytest.raises(FarmUnavailable, match=f"cannot reach the Ray cluster at {address}"):
        farm.compile(compute_key(request).key, request, timeout=60)
    child = farm._proc
    assert child is not None and child.poll() is None  # still serving the next call
    with pytest.raises(FarmUnavailable, match="cannot reach"):
        farm.stats()
    farm.release()
    start = time.monotonic()
    assert child.wait(timeout=60) == 0
    assert time.monotonic() - start < 60
    with pytest.raises(FarmUnavailable):  # let go: a later call starts a child again
        farm.stats()
    farm.release()


def test_a_child_that_dies_fails_the_next_call_at_once() -> None:
    farm = ProcessFarm(f"127.0.0.1:{_free_port()}")
    farm.start()
    child = farm._proc
    assert child is not None
    child.kill()
    child.wait(timeout=30)
    start = time.monotonic()
    with pytest.raises(FarmUnavailable, match="child process"):
        farm.stats()
    assert time.monotonic() - start < 5
    farm.release()


class _SilentEnd(ProcessFarm):
    """A relayed farm whose far end has closed but whose reader has not noticed yet: the
    race a call after the child's death can meet (the send fails first)."""

    def _open(self) -> socket.socket:
        ours, theirs = socket.socketpair()
        theirs.close()
        self._log = Path("/nonexistent/farm-process.log")
        return ours

    def _receive(self, sock: socket.socket) -> None:
        threading.Event().wait(60)  # the reader never sees the end within the test
        return None


def test_a_send_to_an_ended_child_names_the_child_before_the_reader_sees_it() -> None:
    farm = _SilentEnd(f"127.0.0.1:{_free_port()}")
    start = time.monotonic()
    with pytest.raises(FarmUnavailable, match=r"child process ended .*sending stats"):
        farm.call("stats", timeout=1.0)  # a closed socketpair's peer: the send fails at once
    assert time.monotonic() - start < 1.0
    farm.release()
