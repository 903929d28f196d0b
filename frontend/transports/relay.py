"""A farm reached over one socket by a client that never imports Ray: the calls of
``RayFarm`` (``compile``, ``tuned``, ``stats``, ``release``) as numbered messages, one
reader thread handing each answer to its caller's future, so that several graphs and
background tuning lookups share the connection. Subclasses open the socket and frame the
messages: ``process.ProcessFarm`` (a child process that joins Ray) and
``gateway.GatewayFarm`` (`kiln farm up`'s gateway, over TCP)."""

from __future__ import annotations

import atexit
import socket
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

from kiln.compiler import trace
from kiln.workers.farm_api import FarmTimeout, FarmUnavailable, answer_to_graph, farm_waits

if TYPE_CHECKING:  # a client's farm process imports no torch
    from kiln.compiler.compiled_graph import CompiledGraph
    from kiln.compiler.request import CompileRequest

# Past the farm's own timeout, how long the client still waits for its answer to arrive.
ANSWER_GRACE_S = 30.0
STATS_TIMEOUT_S = 120.0  # RayFarm's connect_timeout: how long the far end waits for stats
Answer = tuple[bool, Any, list[Any]]  # ok, value (or the exception), trace events


class RelayFarm:
    """The client side of a relayed farm; subclasses give ``_open``, ``_send``,
    ``_receive`` and ``_gone``."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.joined: str | None = None
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._calls: dict[int, Future[Answer]] = {}
        self._next_id = 0
        self._ended: socket.socket | None = None  # the connection whose far end has ended

    @property
    def description(self) -> str:
        raise NotImplementedError

    def _open(self) -> socket.socket:
        """A connected socket to the far end (``FarmUnavailable`` if there is none)."""
        raise NotImplementedError

    def _send(self, sock: socket.socket, call_id: int, method: str, args: tuple[Any, ...]
              ) -> None:
        """Send one call (under ``_send_lock``); OSError if the connection broke."""
        raise NotImplementedError

    def _receive(self, sock: socket.socket) -> tuple[int, Answer] | None:
        """The next answer with its call id; None once the far end is gone."""
        raise NotImplementedError

    def _gone(self) -> FarmUnavailable:
        raise NotImplementedError

    def start(self) -> None:
        """Connect (nothing if connected); ``FarmUnavailable`` if that fails."""
        with self._lock:
            if self._sock is None:
                sock = self._open()
                self._sock, self.joined = sock, self.address
                threading.Thread(target=self._read, args=(sock,), daemon=True,
                                 name=f"kiln-{type(self).__name__}").start()
                _live.add(self)

    def _read(self, sock: socket.socket) -> None:
        """Hand each answer to its caller; at the far end's end, fail every call left."""
        while (received := self._receive(sock)) is not None:
            call_id, answer = received
            with self._lock:
                future = self._calls.pop(call_id, None)
            if future is not None:  # merged by the caller's thread (background or not)
                future.set_result(answer)
        with self._lock:
            calls, self._ended = list(self._calls.values()), sock
            self._calls = {}
        for future in calls:
            future.set_exception(self._gone())

    def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """``method`` on the far end's ``RayFarm``; waits for the answer (``timeout``:
        the farm's own, plus ANSWER_GRACE_S for the answer to arrive)."""
        self.start()
        future: Future[Answer] = Future()
        with self._lock:
            sock = self._sock
            if sock is None or sock is self._ended:
                raise self._gone()
            call_id, self._next_id = self._next_id, self._next_id + 1
            self._calls[call_id] = future
        try:
            self._send(sock, call_id, method, args)
        except OSError as e:  # the far end ended before the reader saw it: the same error
            with self._lock:
                self._calls.pop(call_id, None)
            gone = self._gone()
            raise FarmUnavailable(f"{gone} (sending {method}: {e})") from None
        try:
            ok, value, events = future.result(None if timeout is None
                                              else timeout + ANSWER_GRACE_S)
        except FutureTimeout:
            with self._lock:
                self._calls.pop(call_id, None)
            raise FarmTimeout(f"{self.description} did not answer {method} within "
                              f"{timeout:g}s") from None
        trace.merge(events)
        if not ok:
            raise value
        return value

    def compile(self, key: str, request: CompileRequest, *, timeout: float | None = None,
                delay: float = 0.0) -> CompiledGraph:
        self.start()
        with farm_waits(key):
            answer = self.call("compile_raw", key, request.to_bytes(), delay,
                               trace.recording(), timeout, timeout=timeout)
        return answer_to_graph(answer)

    def tuned(self, key: str, timeout: float | None = None) -> CompiledGraph | None:
        from kiln.compiler.compiled_graph import CompiledGraph

        result = self.call("tuned_raw", key, timeout, trace.recording(), timeout=timeout)
        return None if result is None else CompiledGraph.from_dict(result)

    def stats(self) -> dict[str, Any]:
        """The coordinator's counters (the far end waits up to its ``connect_timeout``)."""
        return dict(self.call("stats", timeout=STATS_TIMEOUT_S))

    def release(self) -> None:
        """Let go of the farm: close this end (the far end sees it at once)."""
        with self._lock:
            sock, self._sock, self.joined = self._sock, None, None
        _live.discard(self)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


_live: set[RelayFarm] = set()


def _at_exit() -> None:
    """Background tuning asks the farm: let it finish (``KILN_AUTOTUNE_EXIT_WAIT``)
    before the connections close. Registered after ``tuning``'s hook: runs first."""
    if not _live:
        return
    from kiln.frontend.tuning import wait_at_exit

    wait_at_exit()
    for farm in list(_live):
        farm.release()


atexit.register(_at_exit)
