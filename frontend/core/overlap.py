"""One piece of work with another beside it, on two threads: the client's compile (a
farm's wait, or a local compile) with a graph's first-call warm-up
(``frontend.core.warmup``). No torch here: the client imports this module."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from kiln.compiler import trace

log = logging.getLogger("kiln.warmup")
T = TypeVar("T")
Warm = Callable[[threading.Event], Any]


def overlap(work: Callable[[], T], warm: Warm | None, *, warm_here: bool) -> T:
    """``work()`` with ``warm(stop)`` running beside it; ``warm_here``: the warm-up on
    this thread and ``work`` on a helper (the caller only waits), else the other way
    round. The result (or exception) is ``work``'s, once both are done. ``stop`` is set
    when ``work`` ends: the warm-up finishes the call it is in and skips the rest (the
    first call pays for those as before), so it delays the result by one call at most.
    The warm-up's own failures are logged, never raised."""
    if warm is None:
        return work()
    stop = threading.Event()
    outcome: list[tuple[bool, Any]] = []

    def guarded_warm() -> None:
        try:
            warm(stop)
        except Exception as e:
            log.info("kiln: first-call warm-up failed (%s: %s); ignored", type(e).__name__, e)

    def guarded_work() -> None:
        try:
            outcome.append((True, work()))
        except BaseException as e:  # re-raised on the caller's thread
            outcome.append((False, e))
        finally:
            stop.set()

    mine, theirs = (guarded_warm, guarded_work) if warm_here else (guarded_work, guarded_warm)
    helper = threading.Thread(target=trace.carry(lambda _: theirs()), args=(None,),
                              name="kiln-warmup", daemon=True)
    helper.start()
    try:
        mine()
    except BaseException:  # an interrupt: not kept waiting for the helper (a daemon)
        stop.set()
        raise
    with trace.span("warm-up overlap join", cat="client"):
        helper.join()
    ok, value = outcome[0]
    if not ok:
        raise value
    return value  # type: ignore[no-any-return]
