"""The client's path for one graph: key, store, farm, publish.

    key = compute_key(request)
    store.get(key)       hit  -> CompiledGraph from the artifact (no compiler runs)
                         miss -> farm.compile(key, request) -> store.publish -> CompiledGraph

Threads of one process asking for the same key wait for one compile (across processes,
the farm's coordinator de-duplicates). A farm that is unreachable, dies or is slower than
``KILN_FARM_TIMEOUT`` is given up for this process with one warning, and graphs compile
here. Counters go to the stats file's ``client`` section (``kiln stats``).
"""

from __future__ import annotations

import atexit
import json
import logging
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from kiln.artifact_store import Store, default_stats_file, open_store
from kiln.artifact_store.stats import merge_counters, persist_counters
from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.request import CompileRequest
from kiln.workers.pipeline import CompileFailure, test_delay

from .artifact import ArtifactFormatError, compile_seconds, from_artifact, to_artifact
from .config import KilnConfig
from .farm import Farm, FarmUnavailable, InProcessFarm, farm_for
from .keys import KeyInfo, compute_key

log = logging.getLogger("kiln.client")

CLIENT_SECTION = "client"
FLUSH_INTERVAL_S = 5.0


class KilnFarmWarning(UserWarning):
    """The farm could not compile; this process compiles its graphs itself."""


@dataclass
class CompileResult:
    """What the client did for one graph, and how long each step took (seconds)."""

    compiled: CompiledGraph
    key: KeyInfo
    source: str  # "hit", "farm" or "local"
    timings: dict[str, float] = field(default_factory=dict)
    recorded_compile_s: float = 0.0  # on a hit: what compiling it cost when it was made
    published_bytes: int | None = None  # on a miss: bytes the store took; None: not stored


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
        self.local: InProcessFarm = self.farm if isinstance(self.farm, InProcessFarm) \
            else InProcessFarm()
        self.local.attach_store(self.store)  # max-autotune choices, shared through the store
        self.farm_down: str | None = None
        self.counters = ClientCounters(self.store.stats().get("stats_file")
                                       or default_stats_file())
        self._inflight: dict[str, Future[CompileResult]] = {}
        self._lock = threading.Lock()

    def compile(self, request: CompileRequest, name: str = "graph", *,
                count_hit: bool = True) -> CompileResult:
        """The compiled graph of ``request``: from the store, or compiled and published.

        A caller that loads the result passes ``count_hit=False`` and reports the load
        with :meth:`loaded` (a hit that fails to load is an error, not time saved)."""
        start = time.perf_counter()
        key = compute_key(request)
        hashed = time.perf_counter()
        result = self._lookup(key)
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
            result = self._compile_miss(key, request, name)
            result.timings["hash_s"] = hashed - start
            future.set_result(result)
            return result
        except BaseException as e:
            future.set_exception(e)
            raise
        finally:
            with self._lock:
                self._inflight.pop(key.key, None)

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
            self.counters.add(graphs=1, hits=1, time_saved_s=saved, hit_seconds=total)

    def _lookup(self, key: KeyInfo) -> CompileResult | None:
        start = time.perf_counter()
        artifact = self.store.get(key.key)
        fetched = time.perf_counter()
        if artifact is None:
            return None
        try:
            compiled = from_artifact(artifact)
        except (ArtifactFormatError, KeyError, TypeError, ValueError) as e:
            log.warning("kiln: artifact %s cannot be read (%s); compiling it again", key.key, e)
            self.counters.add(load_errors=1)
            return None
        timings = {"fetch_s": fetched - start, "decode_s": time.perf_counter() - fetched}
        return CompileResult(compiled, key, "hit", timings,
                             recorded_compile_s=compile_seconds(artifact.manifest))

    def _compile_miss(self, key: KeyInfo, request: CompileRequest, name: str) -> CompileResult:
        start = time.perf_counter()
        compiled, source = self._compile_somewhere(key, request, name)
        wall = time.perf_counter() - start
        info = {"wall_s": wall, "mode": source, "farm": self.farm.description,
                "graph_compile_s": compiled.timings.get("graph_compile", 0.0),
                "kernel_compile_s": compiled.timings.get("kernel_compile", 0.0)}
        artifact = to_artifact(key, request, compiled, info)
        published = self.store.publish(artifact)
        self.counters.add(graphs=1, misses=1, compiles=1, **{f"compiles_{source}": 1},
                          kernels_compiled=len(compiled.binaries), compile_seconds=wall,
                          publishes=int(published))
        timings = {"compile_s": wall, "publish_s": time.perf_counter() - start - wall}
        nbytes = sum(len(blob) for blob in artifact.blobs.values()) if published else None
        return CompileResult(compiled, key, source, timings, published_bytes=nbytes)

    def _compile_somewhere(self, key: KeyInfo, request: CompileRequest, name: str
                           ) -> tuple[CompiledGraph, str]:
        if self.farm is not self.local and self.farm_down is None:
            try:
                return self.farm.compile(key.key, request, timeout=self.config.farm_timeout,
                                         delay=test_delay()), "farm"
            except FarmUnavailable as e:
                self._give_up_farm(str(e))
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
            return self.local.compile(key.key, request, debug_options=debug), "local"
        except CompileFailure:
            self.counters.add(compile_errors=1)
            raise

    def _give_up_farm(self, reason: str) -> None:
        with self._lock:
            if self.farm_down is not None:
                return
            self.farm_down = reason
        self.counters.add(farm_fallbacks=1)
        warnings.warn(f"kiln: the compile farm ({self.farm.description}) cannot compile: "
                      f"{reason}. This process compiles its graphs itself from now on.",
                      KilnFarmWarning, stacklevel=4)


_clients: dict[tuple[Any, ...], KilnClient] = {}
_clients_lock = threading.Lock()


def client_for(config: KilnConfig) -> KilnClient:
    """The process's client for a configuration's store and farm settings."""
    ident = (json.dumps(config.store_kwargs(), sort_keys=True, default=str), config.farm,
             config.farm_timeout)
    with _clients_lock:
        if ident not in _clients:
            _clients[ident] = KilnClient(config)
        return _clients[ident]


def reset_clients() -> None:
    """Forget every client (tests, and `kiln` commands that change the environment)."""
    with _clients_lock:
        for client in _clients.values():
            client.counters.flush()
            client.store.close()
        _clients.clear()
