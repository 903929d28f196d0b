"""Compiles on the way to a first output come before background work in this process.

Background autotuning of a graph starts once that graph's first call returned
(``frontend.tuning``'s hold). In a training step that is the forward's first call, and
the backward is compiled next, on the same path to the step's first output: its
candidates' compiles took the CPUs and the GIL from the backward's compile (on the H200
host, 2026-12-02 09:40: its request took 1.6 s to decode against 0.1 s for the forward,
and its publish 0.7 s against 7 ms). A graph break's next graph is the same case.

So a client's compile of a graph (``compiling()``: key, lookup, compile, publish, load)
holds background kernel compiles and benchmarks back: each job waits
(``wait_idle``) before it starts, for at most ``YIELD_MAX_S`` each time, so that a
process that never stops compiling still tunes. A job already running finishes. Work
that is itself background (a tuned bucket's compile) never counts as foreground.

A compile known to come counts too (``expect``): the backward of a forward just compiled
starts only once the forward ran and autograd reached it, after the forward's tuning was
let go; until it starts (``compiling(name)``), ``YIELD_MAX_S`` passed or something waits
for the tuning (``forget_expected``: exit, a benchmark), background jobs wait for it as
for one running.

At exit, background work still running is stopped (``stop_background``): its next
``wait_idle`` raises ``BackgroundStopped``, so a tuning thread ends between two jobs
instead of being inside torch or CUDA when the interpreter finalizes. (A daemon thread
that returns from C++ into a finalizing interpreter is ended by ``pthread_exit``, whose
unwinding through a ``noexcept`` frame, pybind11's GIL re-acquire, aborts the whole
process: "terminate called without an active exception", exit status 134.)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from kiln.compiler import trace

T = TypeVar("T")
R = TypeVar("R")

YIELD_MAX_S = 10.0  # the longest one background job waits for foreground compiles

_changed = threading.Condition()
_active = 0
_expected: dict[str, float] = {}  # compiles to come, by name: until when they count
_stopped = threading.Event()  # set at exit: background jobs start no more work


class BackgroundStopped(RuntimeError):
    """Background work was stopped (the process is exiting); raised between two jobs."""

    stage = "background"


def stop_background() -> None:
    """Stop background work at its next job (exit): every ``wait_idle`` raises
    ``BackgroundStopped`` from now on, those waiting included."""
    with _changed:
        _stopped.set()
        _changed.notify_all()



@contextmanager
def compiling(name: str = "") -> Iterator[None]:
    """Mark this thread's block as a compile on the way to a first output (nests);
    ``name``: the one ``expect`` announced, if any."""
    global _active
    if trace.in_background():
        yield
        return
    with _changed:
        _active += 1
        _expected.pop(name, None)
    try:
        yield
    finally:
        with _changed:
            _active -= 1
            if _active == 0:
                _changed.notify_all()


def expect(name: str, within: float = YIELD_MAX_S) -> None:
    """A compile called ``name`` is coming: count it from now until it starts, or for
    ``within`` seconds."""
    if trace.in_background():
        return
    with _changed:
        _expected[name] = time.monotonic() + within


def forget_expected() -> None:
    """Count no expected compile any more (a process waiting for its tuning: exit, a
    benchmark; a forward whose backward never comes would hold it back until then)."""
    with _changed:
        _expected.clear()
        _changed.notify_all()


def active() -> int:
    """Foreground compiles running or expected in this process now."""
    with _changed:
        return _busy(time.monotonic())


def _busy(now: float) -> int:
    """Compiles running or expected (called holding ``_changed``); expired ones go."""
    for name in [n for n, until in _expected.items() if until <= now]:
        del _expected[name]
    return _active + len(_expected)


def wait_idle(limit: float = YIELD_MAX_S) -> bool:
    """Block until no foreground compile runs or is expected, at most ``limit`` seconds;
    True if none. Background work calls it before each job (a span marks a wait);
    ``BackgroundStopped`` once the process stopped background work (exit)."""
    with _changed:
        check_stopped()
        if not _busy(time.monotonic()):
            return True
    with trace.span("wait for foreground compile", cat="background"):
        deadline = time.monotonic() + limit
        with _changed:
            while _busy(now := time.monotonic()):
                check_stopped()
                if now >= deadline:
                    return False
                # an expectation that runs out wakes no one: look again by then
                wake = min([deadline, *_expected.values()])
                _changed.wait(max(0.0, wake - now))
            check_stopped()
    return True


def check_stopped() -> None:
    """Raise ``BackgroundStopped`` once background work was stopped (exit)."""
    if _stopped.is_set():
        raise BackgroundStopped("background work stopped: the process is exiting")


def yielding(fn: Callable[[T], R]) -> Callable[[T], R]:
    """``fn`` that first waits for foreground compiles (``wait_idle``)."""

    def run(arg: T) -> R:
        wait_idle()
        return fn(arg)

    return run
