"""Tuned kernels in the running process: a loaded graph that switches to what
autotuning chose as soon as it is chosen, between two calls.

``SwappableGraph`` is the callable the backend hands Dynamo for a graph that will be
tuned (heuristic configs first, autotuning in the background) or that has kernels with
dynamic sizes (tuned per size bucket as buckets are first seen). It holds one reference,
``call``: the loaded wrapper. When tuning finishes, the tuned graph is loaded on the
tuning thread and ``call`` is replaced in one assignment, so a call already running
finishes with the kernels it started with and the next call runs the tuned ones; no
lock is taken on the call path. ``kiln stats`` counts each switch (``hot_swaps``) and
each bucket tuned (``bucket_tunes``).

While tuning runs in this process, each call reports its begin and end to the GPU's
share (``workers.gpu_share``), which fits the benchmarks' turns between calls and counts
the calls they slowed. Before a switch the new kernels' cubins finish loading on the
tuning thread, so the first call after it loads nothing.

A tuning that fails leaves the heuristic kernels running: one warning (from the tuning
thread), and no more tuning of that graph in this process.

Under CUDA graphs (``compiler.runtime.cudagraphs``) each load is a new runner with no
recording: ``replayer`` names the runner of ``call`` (from the end of the first call on),
and ``served`` gives ``frontend.core.aot.cache.served_graph`` an entry that replays its
recordings before any other work, reading ``replayer`` at each call. A switch sets
``replayer`` to None before ``call`` changes and to the new runner after, so no call that
starts after a switch replays a recording of the kernels it replaced; the new runner warms
up and records on the calls that miss.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kiln.compiler import trace
from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.request import CompileRequest
from kiln.compiler.runtime.buckets import NewBucket
from kiln.compiler.runtime.cudagraphs import CudaGraphRunner, replaying
from kiln.compiler.runtime.static_launcher import wait_prefetched
from kiln.frontend.core.client import KilnClient
from kiln.frontend.core.first_call import traced_first_call
from kiln.frontend.core.keys import KeyInfo
from kiln.workers import gpu_share
from kiln.workers.artifact import StoredRequest
from kiln.workers.buckets import Seen, can_tune_buckets, tune_buckets

log = logging.getLogger("kiln.hotswap")

Build = Callable[[CompiledGraph, "NewBucket | None"], Callable[..., Any]]


def wants_swap(compiled: CompiledGraph, request: CompileRequest | StoredRequest,
               source: str, client: KilnClient) -> bool:
    """Whether a loaded graph may change kernels while it runs: this process tunes it
    in the background (``source``: it compiled it), or it has kernels with dynamic sizes
    and this process can tune their buckets."""
    if compiled.stats.get("autotune_pending") and source != "hit":
        return True
    dynamic = any(s.size_args and s.backend == "triton" for s in compiled.kernels)
    return dynamic and can_tune_buckets(request) and not client.farm_serves()


class SwappableGraph:
    """``graph(args)`` runs the current kernels; see the module docstring."""

    def __init__(self, build: Build, compiled: CompiledGraph, client: KilnClient,
                 key: KeyInfo, request: CompileRequest | StoredRequest,
                 recorded_s: float = 0.0) -> None:
        # On the instance, not the class: torch wraps a backward graph's callable
        # (functools.wraps copies the instance's __dict__ only), and AOTAutograd reads
        # the flag on the wrapper.
        self._boxed_call = True
        self._build = build
        self.compiled = compiled
        self.client, self.key, self.request = client, key, request
        self.recorded_s = recorded_s
        self.swaps = 0
        self.failed = False
        # With a farm up, nothing is benchmarked here (``KilnClient.farm_serves``).
        self._tune_buckets = can_tune_buckets(request) and not client.farm_serves()
        self._lock = threading.Lock()  # one tuning or switch of this graph at a time
        self._pending_lock = threading.Lock()
        self._pending: Seen = {}
        self._requested: set[tuple[str, str]] = set()
        self._switch_lock = threading.Lock()  # ``call`` and ``replayer`` change together
        self.replayer: CudaGraphRunner | None = None  # replayed by ``served``'s entry
        self.call = build(compiled, self._hook())
        self.called = False
        self.first_output = 0.0  # wall clock of the first call's return
        client.on_tuned(key.key, self.tuned)

    def __call__(self, args: list[Any]) -> Any:
        share = gpu_share.current()
        if not self.called:
            out = self._first_call(args)
        elif share is not None and share.watching():  # tuning takes turns with the calls
            call = share.call_begin(self.key.key)
            try:
                out = self.call(args)
            finally:
                share.call_end(call)
        else:
            out = self.call(args)
        if self._pending:  # a kernel launched in a size bucket not tuned yet
            self._schedule()
        return out

    def _first_call(self, args: list[Any]) -> Any:
        """The first output (on the timeline with its library calls and cubin loads:
        ``frontend.core.first_call``); this graph's held tuning may start after it."""
        out = traced_first_call(self.call, args, self.key.key)
        self.first_output = time.time()
        with self._switch_lock:
            self.called = True
            self.replayer = _runner_of(self.call)
        self.client.tuner.release(self.key.key)
        return out

    def served(self, slow: Callable[..., Any]) -> Callable[..., Any]:
        """``fn(*inputs)`` for ``served_graph`` (see the module docstring): ``slow``
        itself where the graph runs without CUDA graphs."""
        return replaying(self, slow) if _runner_of(self.call) is not None else slow

    def _hook(self) -> NewBucket | None:
        return self._new_bucket if self._tune_buckets and not self.failed else None

    def _new_bucket(self, kernel: str, bucket: str, nbytes: list[int], sizes: list[int]
                    ) -> None:
        with self._pending_lock:
            if (kernel, bucket) not in self._requested:
                self._requested.add((kernel, bucket))
                self._pending[(kernel, bucket)] = (nbytes, sizes)

    def _schedule(self) -> None:
        with self._pending_lock:
            seen, self._pending = self._pending, {}
        if seen:
            self.client.tuner.submit(self.key.key, lambda: self._tune(seen),
                                     lambda graph: None, label="bucket autotune",
                                     local=True)

    def _tune(self, seen: Seen) -> None:
        """Tune ``seen`` buckets, switch to them and publish them (a tuning thread)."""
        with self._lock:
            if self.failed:
                return
            try:
                try:
                    tuned = tune_buckets(self.compiled, self.request.target, seen,
                                         self.client.local.kernels)
                finally:
                    self.client.count_gpu_share()
                if tuned.buckets == self.compiled.buckets:
                    return  # no candidate ran at these sizes: nothing to switch to
                self._install(tuned)
            except Exception:
                self.failed = True  # one warning (the tuner's), then no more tuning
                raise
            self.client.counters.add(bucket_tunes=sum(
                bucket in tuned.buckets.get(kernel, {}) for kernel, bucket in seen))
            # Under the lock: the store never gets an older set of buckets after a newer.
            self.client.publish_tuned(self.key, self.request, tuned, self.recorded_s)

    def tuned(self, graph: CompiledGraph) -> None:
        """The graph's background autotuning finished: switch to its configs, keeping
        the buckets tuned meanwhile (and publish those with it)."""
        with self._lock:
            if self.failed:
                return
            merged = CompiledGraph.from_dict(graph.to_dict())
            for name, buckets in self.compiled.buckets.items():
                merged.buckets[name] = {**buckets, **merged.buckets.get(name, {})}
            for name, binaries in self.compiled.bucket_binaries.items():
                merged.bucket_binaries[name] = {**binaries,
                                                **merged.bucket_binaries.get(name, {})}
            try:
                self._install(merged)
            except Exception as e:  # the heuristic kernels keep running
                self.failed = True
                log.warning("kiln: the tuned kernels of graph %s did not load (%s); it "
                            "keeps its first kernels", self.key.key[:16], e)
                return
            if merged.buckets != graph.buckets:
                self.client.publish_tuned(self.key, self.request, merged, self.recorded_s)

    def _install(self, graph: CompiledGraph) -> None:
        """Load ``graph`` here, then switch to it between calls (``call`` in one
        assignment; ``replayer`` around it: see the module docstring)."""
        call = self._build(graph, self._hook())
        # The new kernels' cubins finish loading here, on the tuning thread, so that the
        # first call after the switch loads nothing (no call waits for the swap).
        wait_prefetched(getattr(getattr(call, "call", call), "launchers", ()))
        took_over = time.time()
        with self._switch_lock:
            self.replayer = None  # (a replay of the old runner never follows the switch)
            self.compiled, self.call = graph, call
            if self.called:
                self.replayer = _runner_of(call)
        self.swaps += 1
        self.client.counters.add(hot_swaps=1, **took_over_counters(self.first_output,
                                                                   took_over))
        trace.complete("tuned kernels took over", took_over * 1e6, took_over * 1e6,
                       cat="autotune", key=self.key.key[:16], switch=self.swaps)
        log.info("kiln: graph %s switched to tuned kernels (switch %d)", self.key.key[:16],
                 self.swaps)


def took_over_counters(first_output: float, took_over: float) -> dict[str, float]:
    """``kiln stats``'s record of a switch: how long after the graph's first output the
    tuned kernels took over (the time the program ran on heuristic ones), summed and at
    most; when is on the ``KILN_TRACE`` timeline ("tuned kernels took over")."""
    if not first_output:
        return {}
    after_ms = 1000 * max(0.0, took_over - first_output)
    return {"tuned_took_over_after_ms": after_ms, "tuned_took_over_after_max_ms": after_ms}


def _runner_of(call: Callable[..., Any]) -> CudaGraphRunner | None:
    return call if isinstance(call, CudaGraphRunner) else None
