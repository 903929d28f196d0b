"""The client's path for one graph: key, store, farm, publish.

    key = compute_key(request)
    store.get(key)       hit  -> CompiledGraph from the artifact (no compiler runs)
                         miss -> farm.compile(request) -> CompiledGraph
                                 (the farm, a builder, publishes it signed itself)
                              -> or compile here -> store.publish, only if this process
                                 is a builder (a key that signs, or an unsigned store)

Roles as in Bazel remote execution: builders (farm workers, precompile jobs holding the
private key) compile, sign and publish; clients holding only the public key verify and
read. An artifact that verifies but does not load is quarantined, compiled again and
republished where this process may publish (``repair``), with one warning.

Threads of one process asking for the same key wait for one compile (across processes,
the farm's coordinator de-duplicates). A farm that is unreachable, dies or is slower than
``KILN_FARM_TIMEOUT`` is given up for this process with one warning, and graphs compile
here. Counters go to the stats file's ``client`` section (``kiln stats``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kiln.artifact_store import Artifact, Store, default_stats_file, open_store
from kiln.artifact_store.claims import describe_owner
from kiln.artifact_store.stats import merge_counters, persist_counters
from kiln.compiler import trace
from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.request import CompileRequest
from kiln.compiler.runtime.static_launcher import cubin_prefetch
from kiln.frontend.config import KilnConfig, parse_flag
from kiln.frontend.core.keys import KeyInfo, compute_key
from kiln.frontend.core.overlap import Warm, overlap
from kiln.frontend.transports.base import Farm
from kiln.frontend.transports.inprocess import InProcessFarm
from kiln.frontend.transports.modes import LocalFarm, farm_for
from kiln.frontend.tuning import BackgroundTuner
from kiln.workers import foreground, gpu_share
from kiln.workers.artifact import (
    StoredRequest,
    compile_seconds,
    cubin_records,
    from_artifact,
    to_artifact,
)
from kiln.workers.farm_api import FarmNotUp, FarmTimeout, FarmUnavailable
from kiln.workers.kernel_store import KernelStore
from kiln.workers.pipeline import (
    CompileFailure,
    KernelCache,
    autotune_inprocess,
    kernel_jobs,
    test_delay,
)

log = logging.getLogger("kiln.client")

CLIENT_SECTION = "client"
FLUSH_INTERVAL_S = 5.0


class KilnFarmWarning(UserWarning):
    """The farm could not compile; this process compiles its graphs itself."""


class UntrustedAnswer(Exception):
    """A farm's answer that a client checking signatures cannot verify."""


class KilnRepairWarning(UserWarning):
    """A stored artifact did not load: it is quarantined and the graph compiled again."""


@dataclass
class CompileResult:
    """What the client did for one graph, and how long each step took (seconds)."""

    compiled: CompiledGraph
    key: KeyInfo
    source: str  # "hit", "farm" or "local"
    timings: dict[str, float] = field(default_factory=dict)
    recorded_compile_s: float = 0.0  # on a hit: what compiling it cost when it was made
    published_bytes: int | None = None  # on a miss: bytes the store took; None: not stored
    recorded_inputs: list[Any] | None = None  # on a hit: the input metas its manifest names
    # on a hit: the request's parts its manifest keeps (tuning a served graph's buckets)
    stored_request: StoredRequest | None = None
    # What the store lookup found: "found", or why it missed ("missing"; "damaged: ...",
    # "refused: ..." as the store said; "a regions plan"; "did not decode: ..."), so that a
    # warm start that compiled can say why (bench/coldstart.py, KILN_DEBUG's key.json).
    lookup: str = "found"


class ClientCounters:
    """This process's client counters, added to the stats file every few seconds."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._delta: dict[str, Any] = {}
        self._total: dict[str, Any] = {}
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        atexit.register(self.flush)

    def add(self, **counts: float) -> None:
        with self._lock:
            merge_counters(self._delta, counts)
            merge_counters(self._total, counts)
        if time.monotonic() - self._last_flush >= FLUSH_INTERVAL_S:
            self.flush()

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return dict(self._total)

    def flush(self) -> None:
        with self._lock:
            delta, self._delta = self._delta, {}
            self._last_flush = time.monotonic()
        if not delta or not self.path:
            return
        try:
            persist_counters(self.path, CLIENT_SECTION, delta)
        except Exception as e:  # counters never break a compile
            log.debug("kiln: could not write client stats to %s: %s", self.path, e)


class KilnClient:
    """Key, look up, compile on a miss, publish; see the module docstring."""

    def __init__(self, config: KilnConfig, *, store: Store | None = None,
                 farm: Farm | None = None) -> None:
        self.config = config
        self.store = store if store is not None else open_store(**config.store_kwargs())
        self.farm = farm if farm is not None else farm_for(config.farm)
        # Kernels compiled here are shared through the store, by content key.
        self.kernel_store = KernelStore(self.store)
        kernels = KernelCache(backing=self.kernel_store)
        if isinstance(self.farm, InProcessFarm):
            if farm is None:  # the process-wide one may serve clients of other stores
                self.farm = InProcessFarm(kernels)
            elif self.farm.kernels.backing is None:
                self.farm.kernels.backing = self.kernel_store
        self.local: InProcessFarm = self.farm if isinstance(self.farm, InProcessFarm) \
            else InProcessFarm(kernels)
        self.local.attach_store(self.store)  # max-autotune choices, shared through the store
        self.farm_down: str | None = None
        self.counters = ClientCounters(self.store.stats().get("stats_file")
                                       or default_stats_file())
        self._inflight: dict[str, Future[CompileResult]] = {}
        self.tuner = BackgroundTuner()
        self._lock = threading.Lock()
        # Background autotuning's results, for graphs loaded in this process (hotswap).
        self._tuned: dict[str, CompiledGraph] = {}
        self._listeners: dict[str, list[weakref.WeakMethod[Any]]] = {}

    def compile(self, request: CompileRequest, name: str = "graph", *,
                count_hit: bool = True, warm: Warm | None = None) -> CompileResult:
        """The compiled graph of ``request``: from the store, or compiled and published.

        A caller that loads the result passes ``count_hit=False`` and reports the load
        with :meth:`loaded` (a hit that fails to load is an error, not time saved).
        ``warm``: the graph's first-call warm-up (``frontend.core.warmup``), run beside a
        compile of a miss. This process's background tuning waits meanwhile
        (``workers.foreground``)."""
        with foreground.compiling():
            return self._compile(request, name, count_hit, warm)

    def _compile(self, request: CompileRequest, name: str, count_hit: bool,
                 warm: Warm | None) -> CompileResult:
        start = time.perf_counter()
        with trace.span("hash request", cat="client", graph=name):
            key = compute_key(request)
        hashed = time.perf_counter()
        result, missed = self._lookup(key)
        if result is not None:
            result.timings.update(hash_s=hashed - start, total_s=time.perf_counter() - start)
            if count_hit:
                self.loaded(result, ok=True)
            return result
        with self._lock:
            future = self._inflight.get(key.key)
            owner = future is None
            if owner:
                future = self._inflight[key.key] = Future()
        assert future is not None
        if not owner:
            self.counters.add(graphs=1, waited=1)
            return future.result()
        try:
            result = self._compile_claimed(key, request, name, warm, missed, count_hit)
            result.timings["hash_s"] = hashed - start
            future.set_result(result)
            return result
        except BaseException as e:
            future.set_exception(e)
            raise
        finally:
            with self._lock:
                self._inflight.pop(key.key, None)

    def _compile_claimed(self, key: KeyInfo, request: CompileRequest, name: str,
                         warm: Warm | None, missed: str, count_hit: bool = True
                         ) -> CompileResult:
        """A miss compiled here claims its key in the store first; a live claim of another
        process means waiting for its artifact (a hit), up to ``KILN_CLAIM_WAIT``, then
        compiling here. With a farm up, the farm de-duplicates and claims instead."""
        if not self._compiles_here():
            return self._compile_miss(key, request, name, warm, missed)
        start = time.perf_counter()
        waited: dict[str, Any] = {}

        def found() -> CompileResult | None:
            if not self.store.contains(key.key):
                return None
            return self._lookup(key)[0]

        with trace.span("claim", cat="client", key=key.key[:16], graph=name) as span:
            outcome = self.store.claims.acquire_or_wait(key.key, found,
                                                        on_wait=waited.update)
            span.update(outcome=outcome.reason, holder=describe_owner(outcome.holder))
        if outcome.holder is not None:
            trace.complete("claim wait", trace.now_us() - outcome.waited_s * 1e6,
                           trace.now_us(), cat="client", key=key.key[:16],
                           holder=describe_owner(outcome.holder), outcome=outcome.reason)
        if outcome.found is not None:
            result = outcome.found
            result.timings.update(claim_wait_s=outcome.waited_s,
                                  total_s=time.perf_counter() - start)
            if count_hit:
                self.loaded(result, ok=True)
            return result
        try:
            result = self._compile_miss(key, request, name, warm, missed)
        finally:
            if outcome.claim is not None:
                outcome.claim.release()
        result.timings["claim_wait_s"] = outcome.waited_s
        return result

    def _compiles_here(self) -> bool:
        """Whether a miss compiles in this process (no farm up, or the farm given up)."""
        if self.farm is self.local or self.farm_down is not None:
            return True
        return isinstance(self.farm, LocalFarm) and self.farm.address() is None

    def connect_farm_early(self) -> None:
        """Start joining the farm that is up (``frontend.transports.modes.connect_early``), unless
        this process compiles here or gave the farm up."""
        if self.farm is not self.local and self.farm_down is None:
            from kiln.frontend.transports.modes import connect_early

            connect_early(self.farm)

    def loaded(self, result: CompileResult, *, ok: bool) -> None:
        """Count a graph once it is loaded: a hit saves its recorded compile time; a graph
        that fails to load counts as a load error (and a hit saves nothing)."""
        if not ok:
            self.counters.add(load_errors=1, **({"graphs": 1} if result.source == "hit"
                                               else {}))
            return
        if result.source == "hit":
            total = result.timings.get("total_s", 0.0)
            saved = max(0.0, result.recorded_compile_s - total)
            self.counters.add(graphs=1, hits=1, time_saved_s=saved, hit_seconds=total,
                              hits_autotuned=int(result.compiled.autotuned))

    def _lookup(self, key: KeyInfo) -> tuple[CompileResult | None, str]:
        """The stored graph of ``key`` and "found", or None and why it missed (what
        ``CompileResult.lookup`` says of the compile that follows)."""
        start = time.perf_counter()
        with trace.span("store lookup", cat="client", key=key.key[:16]) as found:
            # a hit's cubins start loading as their blobs arrive (static_launcher)
            outcome = self.store.lookup(key.key, observer=cubin_prefetch(cubin_records))
            artifact = outcome.artifact
            found["hit"] = artifact is not None
        fetched = time.perf_counter()
        if artifact is None:
            return None, "; ".join(f"{kind}: {detail}" for kind, detail
                                   in outcome.problems)[:500] or outcome.status
        if artifact.manifest.get("kind") == "regions":
            # a regional plan (frontend.core.regions): this graph compiles whole
            return None, "a regions plan, not a graph"
        try:
            with trace.span("decode artifact", cat="client", key=key.key[:16]):
                compiled = from_artifact(artifact)
        except Exception as e:  # verified bytes that still do not decode: repair it
            self.counters.add(load_errors=1)
            self._set_aside(key.key, f"{type(e).__name__}: {e}")
            return None, f"did not decode: {type(e).__name__}: {e}"[:500]
        timings = {"fetch_s": fetched - start, "decode_s": time.perf_counter() - fetched}
        inputs, parts = artifact.manifest.get("inputs"), artifact.manifest.get("key_parts")
        if not key.parts and isinstance(parts, dict):  # looked up by key alone: as recorded
            key = KeyInfo(key.key, {str(k): str(v) for k, v in parts.items()})
        return CompileResult(compiled, key, "hit", timings,
                             recorded_compile_s=compile_seconds(artifact.manifest),
                             recorded_inputs=inputs if isinstance(inputs, list) else None,
                             stored_request=StoredRequest.from_manifest(artifact.manifest)
                             ), "found"

    def lookup(self, key: str) -> CompileResult | None:
        """A stored graph by its key alone, with no request (the AOT cache's warm path:
        ``frontend.core.aot.cache``; the regions of a stored plan: ``frontend.core.regions``);
        verified as any read is. The caller reports the load
        with :meth:`loaded`."""
        start = time.perf_counter()
        result, _ = self._lookup(KeyInfo(key=key))
        if result is not None:
            result.timings["total_s"] = time.perf_counter() - start
        return result

    def _compile_miss(self, key: KeyInfo, request: CompileRequest, name: str,
                      warm: Warm | None = None, missed: str = "missing") -> CompileResult:
        start = time.perf_counter()
        cache = self.local.kernels
        compiles, from_store = cache.compiles, cache.store_hits
        compiled, source = self._compile_somewhere(key, request, name, warm)
        wall = time.perf_counter() - start
        if source == "local":
            kernels = {"kernels_compiled": cache.compiles - compiles,
                       "kernels_from_store": cache.store_hits - from_store}
        else:
            kernels = {"kernels_compiled": len(compiled.binaries)}
            self.tuner.submit(key.key, lambda: self._share_kernels(compiled, request),
                              lambda graph: None, label="share kernels")
        # the farm's name only where it compiled: a local compile names this process
        where = self.farm.description if source == "farm" else "this process"
        info = {"wall_s": wall, "mode": source, "farm": where,
                "graph_compile_s": compiled.timings.get("graph_compile", 0.0),
                "kernel_compile_s": compiled.timings.get("kernel_compile", 0.0)}
        artifact = to_artifact(key, request, compiled, info)
        with trace.span("publish", cat="client", key=key.key[:16]):
            published = self._publish(key, compiled, artifact)
        self.counters.add(graphs=1, misses=1, compiles=1, **{f"compiles_{source}": 1},
                          **kernels, **gemm_counters(compiled), compile_seconds=wall,
                          publishes=int(published))
        timings = {"compile_s": wall, "publish_s": time.perf_counter() - start - wall}
        nbytes = sum(len(blob) for blob in artifact.blobs.values()) if published else None
        if compiled.stats.get("autotune_pending"):
            self._tune_later(key, request, compiled, source, info)
        return CompileResult(compiled, key, source, timings, published_bytes=nbytes,
                             lookup=missed)

    def _share_kernels(self, compiled: CompiledGraph, request: CompileRequest) -> None:
        """Put the farm's binaries in the store by content key (in the background), so
        that a graph compiled in process anywhere finds them."""
        jobs = kernel_jobs(compiled, request.target)
        for name, binary in compiled.binaries.items():
            if name in jobs and binary.config == jobs[name][0].config:
                self.kernel_store.put(jobs[name][0], binary)
        return None

    def _tune_later(self, key: KeyInfo, request: CompileRequest, compiled: CompiledGraph,
                    source: str, info: dict[str, Any]) -> None:
        """Autotune in the background (the farm's GPUs, or this process's); the tuned
        artifact then supersedes the heuristic one under the same key."""
        def publish(tuned: CompiledGraph) -> None:
            self._notify_tuned(key.key, tuned)  # graphs loaded here switch to it
            if not self.store.can_publish:  # a reader: the farm publishes what it tunes
                return
            published = self.store.publish(to_artifact(key, request, tuned,
                                                       {**info, "autotuned_after": True}))
            self.counters.add(autotune_publishes=int(published))
            self.counters.flush()

        farm: Any = self.farm
        if source == "farm" and hasattr(farm, "tuned"):  # the farm tunes once asked
            timeout = self.config.farm_timeout
            self.tuner.submit(key.key, lambda: self._trusted_tuned(
                key.key, farm.tuned(key.key, timeout)), publish, hold=True)
        elif source == "local":  # held until the graph's first output
            def tune_here() -> CompiledGraph:
                try:
                    return autotune_inprocess(compiled, request.target, self.local.kernels)
                finally:
                    self.count_gpu_share()

            self.tuner.submit(key.key, tune_here, publish, hold=True, local=True)

    def count_gpu_share(self) -> None:
        """Add what tuning on this process's GPU cost the program's calls (turns, calls
        slowed and by how much: ``workers.gpu_share``) to ``kiln stats``."""
        share = gpu_share.current()
        if share is not None:
            counts = share.take_counters()
            if counts:
                self.counters.add(**counts)

    def on_tuned(self, key: str, listener: Callable[[CompiledGraph], None]) -> None:
        """Call ``listener`` (a bound method, held weakly) with the graph of ``key`` once
        its background autotuning finishes, or at once if it already has."""
        with self._lock:
            done = self._tuned.get(key)
            if done is None:
                self._listeners.setdefault(key, []).append(weakref.WeakMethod(listener))  # type: ignore[arg-type]
        if done is not None:
            listener(done)

    def _notify_tuned(self, key: str, tuned: CompiledGraph) -> None:
        with self._lock:
            self._tuned[key] = tuned
            listeners = [ref() for ref in self._listeners.pop(key, [])]
        for listener in listeners:
            if listener is not None:
                listener(tuned)

    def publish_tuned(self, key: KeyInfo, request: CompileRequest | StoredRequest,
                      tuned: CompiledGraph,
                      compile_s: float = 0.0) -> bool:
        """Publish a graph tuned in this process (a bucket tuned after it was loaded),
        superseding the artifact under its key; only where this process is a builder."""
        if not self.store.can_publish:
            return False
        info = {"wall_s": compile_s, "mode": "local", "autotuned_after": True}
        with trace.span("publish tuned", cat="background", key=key.key[:16]):
            published = self.store.publish(to_artifact(key, request, tuned, info))
        self.counters.add(autotune_publishes=int(published))
        self.counters.flush()
        return published

    def _publish(self, key: KeyInfo, compiled: CompiledGraph, artifact: Artifact) -> bool:
        """Publish where this process is a builder and the farm did not already."""
        if compiled.published_to and compiled.published_to == self.store.url:
            return True
        if not self.store.can_publish:
            log.debug("kiln: not publishing %s: this client only verifies and reads %s",
                      key.key, self.store.url)
            return False
        return self.store.publish(artifact)

    def repair(self, request: CompileRequest, name: str, error: BaseException
               ) -> CompileResult:
        """An artifact that verified but failed to load: set it aside, compile the graph
        again (locally or on the farm) and republish it where this process may."""
        key = compute_key(request)
        self._set_aside(key.key, f"{type(error).__name__}: {error}")
        result = self._compile_miss(
            key, request, name,
            missed=f"found, did not load: {type(error).__name__}: {error}"[:500])
        result.source = f"repaired ({result.source})"
        return result

    def _set_aside(self, key: str, reason: str) -> None:
        self.counters.add(repairs=1)
        warnings.warn(f"kiln: the stored artifact {key} passed its checks but does not load "
                      f"({reason}); it is quarantined and the graph compiled again",
                      KilnRepairWarning, stacklevel=4)
        self.store.quarantine(key, reason)

    def _compile_somewhere(self, key: KeyInfo, request: CompileRequest, name: str,
                           warm: Warm | None = None) -> tuple[CompiledGraph, str]:
        """Compiled on the farm (this thread warms the graph's first call meanwhile),
        else here (the warm-up on a helper thread)."""
        if self.farm is not self.local and self.farm_down is None:
            farm = self.farm
            try:
                answer = overlap(lambda: farm.compile(key.key, request,
                                                      timeout=self.config.farm_timeout,
                                                      delay=test_delay()),
                                 warm, warm_here=True)
                return self._trusted_answer(key.key, answer), "farm"
            except FarmNotUp:  # the default with no farm up: compile here, at once
                self.counters.add(farm_not_up=1)
            except FarmUnavailable as e:  # a slow farm is up: stay connected to it
                self._give_up_farm(str(e), leave=not isinstance(e, FarmTimeout))
            except CompileFailure:
                self.counters.add(compile_errors=1)
                raise
            except Exception as e:  # a farm bug must cost a local compile, not the graph
                log.debug("kiln farm failure", exc_info=True)
                self._give_up_farm(f"{type(e).__name__}: {e}")
        # The compiler's KILN_DEBUG folder; not its logs: compile.py prints those, once,
        # however the graph came.
        debug: dict[str, Any] = {"logs": ""}
        if self.config.debug:
            debug.update(debug="1", debug_dir=self.config.debug_dir)
        try:
            with trace.span("local compile", cat="client", key=key.key[:16]):
                return overlap(lambda: self.local.compile(key.key, request,
                                                          delay=test_delay(),
                                                          debug_options=debug),
                               warm, warm_here=False), "local"
        except CompileFailure:
            self.counters.add(compile_errors=1)
            raise

    def farm_serves(self) -> bool:
        """Whether a farm compiles and tunes for this process now (one that is up, not
        given up): then no kernel is ever benchmarked here, on the user's GPU; the farm's
        GPU autotuners tune, and the tuned artifact comes through the store or the
        farm's answer (``farm.tuned``)."""
        if self.farm is self.local or self.farm_down is not None:
            return False
        address = getattr(self.farm, "address", None)
        return address() is not None if callable(address) else True

    def _checks_signatures(self, key: str) -> bool:
        """Whether this client runs only signed code for ``key``: it holds a key, requires
        signatures, or its store is one others can write (whose unsigned artifacts it
        refuses: then an answer from the farm that publishes there is refused too, unless
        the store holds it signed)."""
        return bool(self.store.keyring) or self.store.refuses_unsigned(key) is not None

    def _trusted_answer(self, key: str, answer: CompiledGraph) -> CompiledGraph:
        """The farm's answer as this client may run it. A client that checks signatures
        (``_checks_signatures``) runs no code the farm's connection carried: it reads
        back what the farm published and verifies it as any store read (signature,
        digests); the answer's numbers (stats, timings) are kept. UntrustedAnswer when
        the store holds no such artifact. Otherwise (no key, and a store only this user
        can write, where the farm publishes for this user alone) the answer runs as the
        farm's authenticated connection carried it (the farm token's handshake, Ray's
        token authentication)."""
        if not self._checks_signatures(key):
            return answer
        artifact = self.store.get(key, kind="farm_answer")
        if artifact is None:
            raise UntrustedAnswer(
                f"its answer for graph {key[:16]} is not in the store {self.store.url} "
                "under a signature this client's key accepts (KILN_SIGNING_KEY), so its "
                "code is refused")
        trusted = from_artifact(artifact)
        trusted.stats = {**answer.stats, **trusted.stats}
        trusted.timings = {**answer.timings, **trusted.timings}
        trusted.published_to = answer.published_to
        return trusted

    def _trusted_tuned(self, key: str, tuned: CompiledGraph | None) -> CompiledGraph | None:
        """``_trusted_answer`` for the farm's autotuned graph; None (the heuristic graph
        stays) when it cannot be verified."""
        if tuned is None:
            return None
        try:
            return self._trusted_answer(key, tuned)
        except UntrustedAnswer as e:
            log.warning("kiln: not switching graph %s to the farm's autotuned version: %s",
                        key[:16], e)
            return None

    def _give_up_farm(self, reason: str, leave: bool = True) -> None:
        with self._lock:
            if self.farm_down is not None:
                return
            self.farm_down = reason
        self.counters.add(farm_fallbacks=1)
        warnings.warn(f"kiln: the compile farm ({self.farm.description}) cannot compile: "
                      f"{reason}. This process compiles its graphs itself from now on.",
                      KilnFarmWarning, stacklevel=4)
        release = getattr(self.farm, "release", None)
        if leave and release is not None:
            release()


_clients: dict[tuple[Any, ...], KilnClient] = {}
_clients_lock = threading.Lock()


def gemm_counters(compiled: CompiledGraph) -> dict[str, int]:
    """Max-autotune's GEMM problems of a compile (``gemm_problems``), and how each was
    decided: benchmarked, its choice found in the store (``gemm_cached``), or left to the
    library call with no GPU to measure (``gemm_untuned``)."""
    selection = compiled.stats.get("gemm_selection")
    if not isinstance(selection, dict):
        return {}
    return {f"gemm_{k}": int(selection.get(k, 0))
            for k in ("problems", "cached", "benchmarked", "untuned")}


def client_for(config: KilnConfig) -> KilnClient:
    """The process's client for a configuration's store and farm settings."""
    ident = (json.dumps(config.store_kwargs(), sort_keys=True, default=str), config.farm,
             config.farm_timeout)
    with _clients_lock:
        if ident not in _clients:
            _clients[ident] = KilnClient(config)
            _summary_at_exit()
        return _clients[ident]


_summary_registered = False


def _summary_at_exit() -> None:
    """``KILN_SUMMARY=1``: :func:`summary_line` on stderr when the process exits (a CI
    job's log then says whether the cache served it)."""
    global _summary_registered
    if _summary_registered:
        return
    _summary_registered = True
    try:
        on = parse_flag(os.environ.get("KILN_SUMMARY", ""))
    except ValueError:
        on = False  # the configuration warned about it already
    if on:
        atexit.register(lambda: print(summary_line(), file=sys.stderr, flush=True))


def summary_line() -> str:
    """This process's cache figures in one line: Dynamo graphs served by the AOT cache or
    traced, ATen graphs loaded from the store or compiled, store lookups and bytes read,
    graphs run eagerly."""
    counts = process_counters()
    with _clients_lock:
        stores = [client.store.stats() for client in _clients.values()]
    hits = sum(int(s.get("hits", 0)) for s in stores)
    misses = sum(int(s.get("misses", 0)) for s in stores)
    read = sum(int(t.get("bytes_read", 0)) for s in stores
               for t in (s.get("tiers") or {}).values())
    served, traced = int(counts.get("aot_hits", 0)), int(counts.get("aot_traces", 0))
    loaded, compiled = int(counts.get("hits", 0)), int(counts.get("compiles", 0))
    rate = f"{100 * hits / (hits + misses):.0f}%" if hits + misses else "no lookups"
    return (f"kiln summary: {served + traced} Dynamo graphs ({served} served by the AOT "
            f"cache, {traced} traced); ATen graphs {loaded} loaded from the store, "
            f"{compiled} compiled; store {hits} hits, {misses} misses ({rate}), {read} bytes "
            f"read; {int(counts.get('compile_errors', 0))} compile errors")


def wait_for_background(timeout: float | None = None) -> bool:
    """Wait until every client's background work (autotuning and its publish, kernel
    sharing) is done; True if none is left. Benchmarks that time runtime call it, then
    compile again to load the tuned artifacts."""
    with _clients_lock:
        clients = list(_clients.values())
    return all([client.tuner.wait(timeout) for client in clients])


def process_counters() -> dict[str, Any]:
    """Every client's counters in this process, added up (numbers only)."""
    with _clients_lock:
        snapshots = [client.counters.snapshot() for client in _clients.values()]
    total: dict[str, Any] = {}
    for snapshot in snapshots:
        for name, value in snapshot.items():
            if isinstance(value, (int, float)):
                total[name] = total.get(name, 0) + value
    return total


def reset_clients() -> None:
    """Forget every client (tests, and `kiln` commands that change the environment)."""
    with _clients_lock:
        for client in _clients.values():
            client.counters.flush()
            client.store.close()
        _clients.clear()
