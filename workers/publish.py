"""The farm as a builder: it publishes what it compiles to its own store, signed with its
own key (as Bazel's remote executors write the action cache; clients only read).

Which store and which key are the farm's environment (``KILN_STORE``,
``KILN_SIGNING_KEY=ed25519:<private>``, ...), never a request's: a caller cannot choose
where a result goes nor the key it goes under (the coordinator recomputes it).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from kiln.artifact_store import Store, open_store
from kiln.artifact_store.claims import Claim, default_owner
from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.keys import KeyInfo
from kiln.compiler.request import CompileRequest

from .artifact import to_artifact

log = logging.getLogger("kiln.farm")


class FarmPublisher:
    """Publishes finished graphs to the farm's store, if the farm is a builder there."""

    def __init__(self, store: Store | None = None) -> None:
        self._store = store
        self._lock = threading.Lock()

    @property
    def store(self) -> Store:
        with self._lock:
            if self._store is None:
                self._store = open_store(stats_file=False)
                if not self._store.can_publish:
                    log.warning("kiln farm: not a builder for %s (read-only, or a key that "
                                "cannot sign): clients publish what it compiles, if they "
                                "may", self._store.url)
            return self._store

    def claim(self, key: str) -> Claim | None:
        """The farm's claim on ``key`` in its store (``artifact_store.claims``), if the
        key was free or its claim expired; None otherwise (never raises)."""
        try:
            store = self.store
            owner = {**default_owner(), "farm": True}
            return store.claims.try_acquire(key, owner) if store.can_publish else None
        except Exception as e:  # a claim only saves others a compile
            log.debug("kiln farm: no claim on %s: %s", key, e)
            return None

    def publish(self, key: KeyInfo, request: CompileRequest, compiled: dict[str, Any],
                wall_s: float) -> str:
        """The store's URL once the artifact is there; "" if not published."""
        store = self.store
        if not store.can_publish:
            return ""
        graph = CompiledGraph.from_dict(compiled)
        info = {"wall_s": wall_s, "mode": "farm", "farm": "builder",
                "graph_compile_s": graph.timings.get("graph_compile", 0.0),
                "kernel_compile_s": graph.timings.get("kernel_compile", 0.0),
                "published_at": time.time()}
        if store.publish(to_artifact(key, request, graph, info)):
            return store.url
        return ""
