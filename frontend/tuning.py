"""Autotuning after the first output: a graph's first artifact has heuristic configs; its
candidates are then timed in the background, on the farm's GPU autotuners or on this
process's GPU, and the tuned artifact supersedes the first one in the store under the
same key (its manifest says ``autotuned: true`` only when configs were timed). Graphs loaded
in this process switch to it between calls (``frontend.core.hotswap``); other clients pick it
up on their next lookup. ``kiln stats`` counts ``autotune_publishes``, ``hits_autotuned``
and ``hot_swaps``.

Tuning threads are daemons; at exit the process waits up to ``KILN_AUTOTUNE_EXIT_WAIT``
seconds (default 5), once for all tuners (``wait_at_exit``), for tuning still running,
so that short jobs publish what they tuned. Tuning still running then is abandoned:
nothing it finishes later is published (a publish already started completes: blobs, then
the manifest), each job stops at its next step (``workers.foreground.stop_background``;
the exit waits for that, a benchmark or a load at most, so that no tuning thread is
inside torch or CUDA when the interpreter finalizes: that aborts the process), and the
first artifacts stay in the store (a farm's tuning goes on, on the farm, which publishes
it itself). Benchmarks that need the tuned artifact wait for it
(``client.wait_for_background``) or set a longer wait.
A process that uses a farm waits before it lets the farm go (``frontend.transports.modes`` and
``frontend.transports.process`` call ``wait_at_exit`` first), since its tuning asks the farm.
No GPU of the target's arch means nothing runs here (CPU graphs never tune). With a farm
up nothing is benchmarked here at all (``KilnClient.farm_serves``): the farm's GPU
autotuners tune and the tuned graph comes back in the farm's answer.

Tuning in this process shares the GPU with the program's calls: every benchmark launch
waits for a turn (``workers.gpu_share``), a small part of a call's time each, between
the calls; only kernels far from the roofline are tuned.

Tuning in this process waits for the graph's first output (``hold``): its candidate
compiles would otherwise take the CPUs and the GIL from the rest of the first call
(Dynamo's guards, loading, the call itself). The loaded graph releases it after its
first call (``frontend.core.hotswap``); a graph that is not called within ``HOLD_S`` seconds,
or a process that waits for its tuning (exit, a benchmark), starts it anyway. Once
started, each candidate's compile and benchmark still waits while another graph compiles
here, or while a forward's backward is still to come (``workers.foreground``).
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401 (its exit hook first: see wait_at_exit's)
import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

from kiln.compiler import trace
from kiln.workers import foreground
from kiln.workers.ray_farm import on_exit as on_leaving_ray

if TYPE_CHECKING:  # not imported by a client's farm process, which has no torch
    from kiln.compiler.compiled_graph import CompiledGraph

log = logging.getLogger("kiln.tuning")
EXIT_WAIT_ENV = "KILN_AUTOTUNE_EXIT_WAIT"
HOLD_S = 10.0  # the longest a held tuning waits for its graph's first call
EXIT_WAIT_S = 5.0  # default of KILN_AUTOTUNE_EXIT_WAIT


def exit_wait_s() -> float:
    try:
        return max(0.0, float(os.environ.get(EXIT_WAIT_ENV, str(EXIT_WAIT_S))))
    except ValueError:
        return EXIT_WAIT_S


Tune = Callable[[], "CompiledGraph | None"]
Publish = Callable[["CompiledGraph"], None]


class BackgroundTuner:
    """Runs tuning jobs on daemon threads and publishes what they tuned."""

    def __init__(self) -> None:
        self._threads: list[threading.Thread] = []
        self._local: list[threading.Thread] = []  # jobs running torch/CUDA work here
        self._gates: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        _tuners.add(self)

    def submit(self, key: str, tune: Tune, publish: Publish,
               label: str = "background autotune", hold: bool = False,
               local: bool = False) -> None:
        """Run ``tune`` (which returns the tuned graph, or None); ``publish`` a graph
        whose configs were timed. Other background work of a graph (``label`` says
        what) runs here too, so that exit waits for it. ``hold``: start only once
        ``release(key)`` is called (the graph's first call returned), or ``HOLD_S``
        later, or when something waits for it. ``local``: the job runs torch or CUDA
        work in this process (a benchmark, a load) and stops at its steps
        (``workers.foreground``): once abandoned at exit, exit waits for that step."""
        gate = None
        if hold:
            with self._lock:
                gate = self._gates.setdefault(key, threading.Event())
        thread = threading.Thread(target=self._run, args=(key, tune, publish, label, gate),
                                  daemon=True,
                                  name=f"kiln-autotune-{key[:8]}")
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            self._local = [t for t in self._local if t.is_alive()] + ([thread] if local
                                                                      else [])
        thread.start()

    def release(self, key: str) -> None:
        """The graph of ``key`` gave its first output: its held tuning may start."""
        with self._lock:
            gate = self._gates.pop(key, None)
        if gate is not None:
            gate.set()

    def held(self) -> int:
        """Tunings waiting for their graph's first output."""
        with self._lock:
            return sum(not gate.is_set() for gate in self._gates.values())

    def _run(self, key: str, tune: Tune, publish: Publish, label: str,
             gate: threading.Event | None) -> None:
        if gate is not None and not gate.wait(HOLD_S):
            log.debug("kiln: graph %s not called within %.0f s: tuning it now", key[:16],
                      HOLD_S)
            self.release(key)
        try:
            with trace.background(), trace.span(label, cat="background", key=key[:16]):
                tuned = tune()
            if tuned is not None and tuned.autotuned:
                with _publishing, trace.background():
                    if _abandoned.is_set():
                        log.debug("kiln: %s of graph %s finished after exit's wait: not "
                                  "published", label, key[:16])
                        return
                    publish(tuned)
        except Exception as e:  # an optimization; the first artifact stays
            if _abandoned.is_set():  # cut off at exit (the farm's calls refused): expected
                log.debug("kiln: %s of graph %s abandoned at exit: %s", label, key[:16], e)
            else:
                log.warning("kiln: %s of graph %s failed: %s", label, key[:16], e)

    def join_local(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for this tuner's ``local`` jobs to end (exit,
        once they were stopped); True if none is left."""
        deadline = _now() + timeout
        with self._lock:
            threads = list(self._local)
        for thread in threads:
            thread.join(max(0.0, deadline - _now()))
        return not any(thread.is_alive() for thread in threads)

    def pending(self) -> int:
        with self._lock:
            return sum(t.is_alive() for t in self._threads)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for tuning still running (``None``: ``KILN_AUTOTUNE_EXIT_WAIT``); True
        if none is left."""
        budget = exit_wait_s() if timeout is None else timeout
        with self._lock:
            threads = list(self._threads)
            gates, self._gates = list(self._gates.values()), {}
        for gate in gates:  # waiting for tuning: no point holding it back
            gate.set()
        foreground.forget_expected()  # nor for a backward that may never come
        deadline = _now() + budget
        for thread in threads:
            thread.join(max(0.0, deadline - _now()))
        return self.pending() == 0


_tuners: weakref.WeakSet[BackgroundTuner] = weakref.WeakSet()
_exit_waited = threading.Event()
_abandoned = threading.Event()  # set at exit once the wait ran out: publish nothing more
_publishing = threading.Lock()  # held while a tuned artifact is published
PUBLISH_FINISH_S = 10.0  # at exit, the longest a publish already started is waited for
# At exit, the longest abandoned jobs are waited for to reach their next step (a
# benchmark, a load): a daemon thread still inside torch or CUDA when the interpreter
# finalizes aborts the process (``workers.foreground``).
STOP_WAIT_S = 30.0


def wait_at_exit() -> int:
    """At exit: wait, once, up to ``KILN_AUTOTUNE_EXIT_WAIT`` seconds in all for every
    tuner's work, then abandon what is left (see the module docstring); the number of
    jobs abandoned. The farm's exit hooks call it before letting the farm go (they run
    before Ray's); this module's hook covers a process that never used one."""
    if _exit_waited.is_set():
        return 0
    _exit_waited.set()
    wait = exit_wait_s()
    deadline = _now() + wait
    for tuner in list(_tuners):
        tuner.wait(max(0.0, deadline - _now()))
    left = sum(tuner.pending() for tuner in list(_tuners))
    if left:
        _abandoned.set()
        foreground.stop_background()  # each job ends at its next step (a few seconds)
        if _publishing.acquire(timeout=PUBLISH_FINISH_S):  # one already started ends
            _publishing.release()
        stop_deadline = _now() + STOP_WAIT_S
        for tuner in list(_tuners):
            tuner.join_local(max(0.0, stop_deadline - _now()))
        log.info("kiln: %d background autotuning job(s) still running after %g s "
                 "(KILN_AUTOTUNE_EXIT_WAIT) abandoned at exit; the first artifacts stay",
                 left, wait)
    return left


# The wait runs from threading's exit hooks, which come before atexit's and, registered
# after concurrent.futures' own (imported here first; they run in reverse order), before
# it refuses new thread pools: a job that compiles its candidates in a pool during the
# wait still finishes. atexit's hook covers an interpreter that skips threading's.
atexit.register(wait_at_exit)
try:
    threading._register_atexit(wait_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # another Python, or already shutting down
    pass


def _now() -> float:
    import time

    return time.monotonic()


# A process that joined Ray waits for its tuning before Kiln leaves Ray at exit.
on_leaving_ray(wait_at_exit)
