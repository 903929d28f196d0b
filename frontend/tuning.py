"""Autotuning after the first output: a graph's first artifact has heuristic configs; its
candidates are then timed in the background, on the farm's GPU autotuners or on this
process's GPU, and the tuned artifact supersedes the first one in the store under the
same key (its manifest says ``autotuned: true`` only when configs were timed). Graphs loaded
in this process switch to it between calls (``frontend.hotswap``); other clients pick it
up on their next lookup. ``kiln stats`` counts ``autotune_publishes``, ``hits_autotuned``
and ``hot_swaps``.

Tuning threads are daemons; at exit the process waits up to ``KILN_AUTOTUNE_EXIT_WAIT``
seconds (default 120) for tuning still running, so that short jobs publish what they
tuned. No GPU of the target's arch means nothing runs here (CPU graphs never tune).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
from collections.abc import Callable

from kiln.compiler import trace
from kiln.compiler.compiled_graph import CompiledGraph

log = logging.getLogger("kiln.tuning")
EXIT_WAIT_ENV = "KILN_AUTOTUNE_EXIT_WAIT"


def exit_wait_s() -> float:
    try:
        return max(0.0, float(os.environ.get(EXIT_WAIT_ENV, "120")))
    except ValueError:
        return 120.0


Tune = Callable[[], "CompiledGraph | None"]
Publish = Callable[[CompiledGraph], None]


class BackgroundTuner:
    """Runs tuning jobs on daemon threads and publishes what they tuned."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        atexit.register(self.wait, None)

    def submit(self, key: str, tune: Tune, publish: Publish,
               label: str = "background autotune") -> None:
        """Run ``tune`` (which returns the tuned graph, or None); ``publish`` a graph
        whose configs were timed. Other background work of a graph (``label`` says
        what) runs here too, so that exit waits for it."""
        thread = threading.Thread(target=self._run, args=(key, tune, publish, label),
                                  daemon=True,
                                  name=f"kiln-autotune-{key[:8]}")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()

    def _run(self, key: str, tune: Tune, publish: Publish, label: str) -> None:
        try:
            with trace.span(label, cat="background", key=key[:16]):
                tuned = tune()
            if tuned is not None and tuned.autotuned:
                publish(tuned)
        except Exception as e:  # an optimization; the first artifact stays
            log.warning("kiln: %s of graph %s failed: %s", label, key[:16], e)

    def pending(self) -> int:
        with self._lock:
            return sum(t.is_alive() for t in self._threads)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for tuning still running (``None``: ``KILN_AUTOTUNE_EXIT_WAIT``); True
        if none is left."""
        budget = exit_wait_s() if timeout is None else timeout
        with self._lock:
            threads = list(self._threads)
        deadline = _now() + budget
        for thread in threads:
            thread.join(max(0.0, deadline - _now()))
        return self.pending() == 0


def _now() -> float:
    import time

    return time.monotonic()
