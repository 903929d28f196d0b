"""Living with a backing store that is down, slow or full.

- `DaemonPool` runs remote calls on daemon threads, so a hung call can be abandoned after
  its timeout without hanging the caller or, at exit, the interpreter (the threads of
  `concurrent.futures` are joined at exit).
- `TierHealth` is a circuit breaker per tier: after a fault the tier is skipped for a
  cool-down, so an outage costs one timeout, not one per lookup; each outage is
  reported by one warning, and recovery by one info line.
- `Reporter` says a thing once per store, however often it happens.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from .errors import (
    FAULT_DENIED,
    FAULT_DOWN,
    FAULT_FULL,
    FAULT_REJECTED,
    FAULT_TIMEOUT,
    describe_exception,
    fault_kind,
)

T = TypeVar("T")

READ = "read"
WRITE = "write"


class DaemonPool:
    """A small growable pool of daemon threads."""

    def __init__(self, max_workers: int = 32, name: str = "kiln-store-io") -> None:
        self._max_workers = max_workers
        self._name = name
        self._lock = threading.Lock()
        self._reset()
        # A child forked while a parent thread held the lock must not inherit it held.
        after_fork = weakref.WeakMethod(self._after_fork)
        os.register_at_fork(after_in_child=lambda: (after_fork() or (lambda: None))())

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._queue: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]]
        self._queue = queue.SimpleQueue()
        self._threads = 0
        self._idle = 0  # workers waiting on the queue
        self._pending = 0  # items on the queue that no worker has taken yet

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            self._pending += 1
            if self._pending > self._idle and self._threads < self._max_workers:
                self._threads += 1
                thread = threading.Thread(
                    target=self._work, name=f"{self._name}-{self._threads}", daemon=True
                )
                thread.start()
            self._queue.put((future, fn, args))
        return future

    def _work(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            future, fn, args = self._queue.get()
            with self._lock:
                self._idle -= 1
                self._pending -= 1
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

    def run(self, timeout: float, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on a pool thread; TimeoutError if it takes longer than timeout."""
        future = self.submit(fn, *args)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer within {timeout:.3g} s") from None

    def run_all(
        self, timeout: float, calls: Sequence[tuple[Callable[..., T], tuple[Any, ...]]]
    ) -> list[T]:
        """Run calls concurrently; the first exception (or TimeoutError) is raised."""
        futures = [self.submit(fn, *args) for fn, args in calls]
        deadline = time.monotonic() + timeout
        try:
            return [f.result(max(0.0, deadline - time.monotonic())) for f in futures]
        except TimeoutError:
            raise TimeoutError(f"no answer within {timeout:.3g} s") from None
        finally:
            for future in futures:
                future.cancel()


_SHARED_POOL = DaemonPool()


def shared_pool() -> DaemonPool:
    return _SHARED_POOL


class Reporter:
    """Logs each topic once per store, then only at debug level."""

    def __init__(self, logger: logging.Logger, limit: int = 4096) -> None:
        self._logger = logger
        self._seen: set[str] = set()
        self._limit = limit
        self._lock = threading.Lock()

    def once(self, level: int, topic: str, message: str, *args: Any, **kwargs: Any) -> bool:
        with self._lock:
            first = topic not in self._seen
            if first:
                if len(self._seen) >= self._limit:
                    self._seen.clear()
                self._seen.add(topic)
        self._logger.log(level if first else logging.DEBUG, message, *args, **kwargs)
        return first

    def warn_once(self, topic: str, message: str, *args: Any) -> bool:
        return self.once(logging.WARNING, topic, message, *args)

    def forget(self, topic: str) -> None:
        with self._lock:
            self._seen.discard(topic)


class TierHealth:
    """Circuit breaker of one tier (module docstring)."""

    def __init__(
        self,
        label: str,
        logger: logging.Logger,
        *,
        fallback: str,
        timeout_s: float,
        cooldown_s: float = 30.0,
    ) -> None:
        self.label = label
        self.fallback = fallback
        self.timeout_s = timeout_s
        self.cooldown_s = cooldown_s
        self._logger = logger
        self._lock = threading.Lock()
        self._down_until = {READ: 0.0, WRITE: 0.0}
        self._kind: dict[str, str | None] = {READ: None, WRITE: None}  # None: no outage

    def available(self, op: str) -> bool:
        return time.monotonic() >= self._down_until[op]

    def failed(self, op: str, exc: BaseException) -> str:
        """Record a fault, open the circuit, warn if this starts an outage; the fault kind.

        A full or forbidding store, or one that answered a write with an error, stops
        writes only; a store that is down or slow stops both reads and writes."""
        kind = fault_kind(exc, op)
        writes_only = op == WRITE and kind in (FAULT_FULL, FAULT_DENIED, FAULT_REJECTED)
        ops = (WRITE,) if writes_only else (READ, WRITE)
        with self._lock:
            until = time.monotonic() + self.cooldown_s
            new_outage = self._kind[op] is None
            for o in ops:
                self._down_until[o] = until
                self._kind[o] = kind
        if new_outage:
            self._logger.warning(self._message(op, kind, exc))
        else:
            self._logger.debug("%s: %s failed again: %s", self.label, op, describe_exception(exc))
        return kind

    def succeeded(self, op: str) -> None:
        """End the outage of `op`; an answer at all also ends a connectivity outage."""
        if self._kind[READ] is None and self._kind[WRITE] is None:
            return
        with self._lock:
            ended = [o for o in (READ, WRITE)
                     if self._kind[o] is not None
                     and (o == op or self._kind[o] in (FAULT_DOWN, FAULT_TIMEOUT))]
            for o in ended:
                self._kind[o] = None
                self._down_until[o] = 0.0
        if ended:
            self._logger.info("Kiln artifact store %s works again (%s)", self.label,
                              " and ".join(ended))

    def _message(self, op: str, kind: str, exc: BaseException) -> str:
        cause = describe_exception(exc)
        retry = f"retrying in {self.cooldown_s:g} s"
        if kind == FAULT_FULL:
            return (
                f"Kiln artifact store {self.label} is full ({cause}): artifacts are not "
                f"saved there; compiled graphs still run. Free space or run `kiln gc`; {retry}."
            )
        if kind == FAULT_REJECTED:
            return (
                f"Kiln artifact store {self.label} rejected a write ({cause}): artifacts are "
                f"not saved there; lookups go on and compiled graphs still run. The "
                f"server's log says why (a full disk, a quota); {retry}."
            )
        if kind == FAULT_DENIED:
            hint = (
                "set KILN_STORE_READ_ONLY=1 on clients that should only read"
                if op == WRITE else "check the credentials in KILN_STORE_OPTIONS or the env"
            )
            return (
                f"Kiln artifact store {self.label}: permission denied on {op} ({cause}); "
                f"{self.fallback}. {hint[0].upper() + hint[1:]}; {retry}."
            )
        what = (
            f"did not answer within {self.timeout_s:g} s" if kind == FAULT_TIMEOUT
            else f"is unreachable ({cause})"
        )
        return (
            f"Kiln artifact store {self.label} {what}: {self.fallback}. Check KILN_STORE, the "
            f"network and credentials (timeout: KILN_STORE_TIMEOUT); {retry}."
        )
