"""Counters of the store: hits, misses, bytes and latency per tier, kept in process and
merged into a small JSON file that every process on the machine adds to.

`Store.stats()` returns this process's counters as a plain dict. `read_stats()` returns
the file: the sum over every process that flushed (`kiln stats --json` prints it).
Processes flush every few seconds while busy, on `Store.close()` and at exit; a flush
takes a file lock, adds its delta and atomically replaces the file.

Shape (one per tier name, "local" and "remote"):

    {"version": 1, "since": <unix time>, "updated": <unix time>,
     "hits": n, "misses": n, "publishes": n, "publish_failures": n,
     "integrity_failures": n, "signature_failures": n, "evictions": n,
     "tiers": {"local": {"hits": n, "misses": n, "manifest_hits": n, "manifest_misses": n,
                         "bytes_read": n, "bytes_written": n, "writes": n,
                         "errors": {"down": n, "timeout": n, "full": n, "denied": n,
                                    "rejected": n},
                         "latency": {"get" | "manifest" | "publish": <histogram>}}}}
    histogram = {"count": n, "sum_ms": x, "max_ms": x, "buckets": {"<=0.1": n, ..., "inf": n}}

Files of other Kiln parts (the frontend's compile counters) live beside "store" in the
same file as other sections, through `persist_counters(path, section, delta)`.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import threading
import time
from collections.abc import Mapping
from typing import Any

from .config import default_stats_file

try:
    import fcntl
except ImportError:  # Windows: flushes are best effort without a lock
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

STORE_SECTION = "store"
LATENCY_BUCKETS_MS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 10000)
OPS = ("get", "manifest", "publish")
TOP_COUNTERS = (
    "hits", "misses", "publishes", "publish_failures",
    "integrity_failures", "signature_failures", "evictions",
)

# Claims (claims.py): keys claimed, claims taken over from a dead holder, waits on another
# process's claim and the seconds they took, waits that ran out, faults that skipped claims.
CLAIM_COUNTERS = ("claims", "claim_takeovers", "claim_waits", "claim_wait_seconds",
                  "claim_deadlines", "claim_errors")


def _bucket_label(bound: float) -> str:
    return f"<={bound:g}"


def new_histogram() -> dict[str, Any]:
    buckets = {_bucket_label(b): 0 for b in LATENCY_BUCKETS_MS}
    buckets["inf"] = 0
    return {"count": 0, "sum_ms": 0.0, "max_ms": 0.0, "buckets": buckets}


def new_tier_counters() -> dict[str, Any]:
    return {
        "hits": 0, "misses": 0, "manifest_hits": 0, "manifest_misses": 0,
        "bytes_read": 0, "bytes_written": 0, "writes": 0, "errors": {},
        "latency": {op: new_histogram() for op in OPS},
    }


def new_counters() -> dict[str, Any]:
    counters: dict[str, Any] = {"version": 1, "since": time.time()}
    counters.update({name: 0 for name in TOP_COUNTERS})
    counters["tiers"] = {}
    return counters


def observe(histogram: dict[str, Any], seconds: float) -> None:
    ms = seconds * 1000.0
    histogram["count"] += 1
    histogram["sum_ms"] += ms
    histogram["max_ms"] = max(histogram["max_ms"], ms)
    for bound in LATENCY_BUCKETS_MS:
        if ms <= bound:
            histogram["buckets"][_bucket_label(bound)] += 1
            return
    histogram["buckets"]["inf"] += 1


def latency_quantile(histogram: Mapping[str, Any], q: float) -> float | None:
    """Estimated quantile q (ms) of a histogram: linear within the bucket that holds it,
    and never above the largest value seen (so p50 <= p99 <= max); None if empty."""
    count = histogram.get("count", 0)
    if not count:
        return None
    top = float(histogram.get("max_ms", 0.0))
    rank = q * count
    seen, lower = 0, 0.0
    for bound in LATENCY_BUCKETS_MS:
        in_bucket = histogram["buckets"].get(_bucket_label(bound), 0)
        if in_bucket and seen + in_bucket >= rank:
            upper = min(float(bound), top)
            fraction = max(0.0, rank - seen) / in_bucket
            return min(top, lower + (upper - lower) * fraction)
        seen += in_bucket
        lower = float(bound)
    return top


def merge_counters(into: dict[str, Any], delta: Mapping[str, Any]) -> dict[str, Any]:
    """Add `delta` into `into` (in place, returned): numbers add, `*max_ms` and `updated`
    take the maximum, `since` the minimum, `version` is kept, maps merge recursively."""
    for name, value in delta.items():
        current = into.get(name)
        if isinstance(value, Mapping):
            into[name] = merge_counters(current if isinstance(current, dict) else {}, value)
        elif name == "version":
            into.setdefault(name, value)
        elif not isinstance(value, (int, float)) or isinstance(value, bool):
            into[name] = value
        elif not isinstance(current, (int, float)):
            into[name] = value
        elif name.endswith("max_ms") or name == "updated":
            into[name] = max(current, value)
        elif name == "since":
            into[name] = min(current, value)
        else:
            into[name] = current + value
    return into


class StoreStats:
    """A store's counters in this process, and its share of the persisted file."""

    def __init__(self, path: str | None, *, flush_interval_s: float = 5.0) -> None:
        self.path = path
        self.flush_interval_s = flush_interval_s
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._flushed = new_counters()
        self._delta = new_counters()
        self._last_flush = time.monotonic()

    def _tier(self, name: str) -> dict[str, Any]:
        tiers = self._delta["tiers"]
        if name not in tiers:
            tiers[name] = new_tier_counters()
        return tiers[name]

    def lookup(self, tier: str, op: str, hit: bool, seconds: float, nbytes: int = 0) -> None:
        # "get", "manifest", or "<kind>_get" (kernel lookups: counted on their own)
        prefix = "" if op == "get" else (op[:-3] if op.endswith("_get") else "manifest_")
        with self._lock:
            counters = self._tier(tier)
            name = prefix + ("hits" if hit else "misses")
            counters[name] = counters.get(name, 0) + 1
            counters["bytes_read"] += nbytes
            latency = counters["latency"]
            observe(latency.setdefault(op, new_histogram()), seconds)
        self._maybe_flush()

    def write(self, tier: str, seconds: float, nbytes: int) -> None:
        with self._lock:
            counters = self._tier(tier)
            counters["writes"] += 1
            counters["bytes_written"] += nbytes
            observe(counters["latency"]["publish"], seconds)
        self._maybe_flush()

    def error(self, tier: str, kind: str) -> None:
        with self._lock:
            errors = self._tier(tier)["errors"]
            errors[kind] = errors.get(kind, 0) + 1

    def count(self, name: str, n: float = 1) -> None:
        """Add to a top-level counter (kernel_hits, kernel_misses, claim_wait_seconds, ...
        start at 0)."""
        with self._lock:
            self._delta[name] = self._delta.get(name, 0) + n
        self._maybe_flush()

    def snapshot(self) -> dict[str, Any]:
        """This process's counters since the store opened, as a plain dict."""
        with self._lock:
            total = merge_counters(copy.deepcopy(self._flushed), self._delta)
        total["since"] = self._flushed["since"]
        return total

    def _maybe_flush(self) -> None:
        if self.path and time.monotonic() - self._last_flush >= self.flush_interval_s:
            self.flush()

    def flush(self) -> bool:
        """Add this process's unflushed counters to the file; never raises."""
        if not self.path:
            return False
        with self._flush_lock:
            with self._lock:
                delta, self._delta = self._delta, new_counters()
                self._last_flush = time.monotonic()
            if not _has_activity(delta):
                return True
            delta["updated"] = time.time()
            try:
                persist_counters(self.path, STORE_SECTION, delta)
            except Exception as exc:
                logger.debug("could not write store stats to %s: %s", self.path, exc)
                with self._lock:  # keep them for the next try
                    self._delta = merge_counters(delta, self._delta)
                return False
            with self._lock:
                merge_counters(self._flushed, delta)
            return True


def _has_activity(counters: Mapping[str, Any]) -> bool:
    return bool(counters.get("tiers")) or any(counters.get(n) for n in TOP_COUNTERS) \
        or any(counters.get(n) for n in CLAIM_COUNTERS)


def persist_counters(path: str, section: str, delta: Mapping[str, Any]) -> None:
    """Add `delta` to `section` of the JSON counters file at `path`, under a file lock."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path + ".lock", "a+") as lock:
        if fcntl is not None:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            data = _read_file(path)
            data.setdefault("version", 1)
            data["updated"] = time.time()
            data[section] = merge_counters(data.get(section) or {}, delta)
            tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
            with open(tmp, "w") as handle:
                json.dump(data, handle, sort_keys=True)
            os.replace(tmp, path)
        finally:
            if fcntl is not None:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def reset_stats(path: str) -> bool:
    """Remove the counters file at `path` under its lock (counting starts again from zero;
    processes still running add only what they count from now on). False if there was
    none."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return False
    with open(path + ".lock", "a+") as lock:
        if fcntl is not None:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            os.remove(path)
            return True
        except FileNotFoundError:
            return False
        finally:
            if fcntl is not None:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def _read_file(path: str) -> dict[str, Any]:
    try:
        with open(path) as handle:
            data = json.load(handle)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring unreadable Kiln stats file %s (%s); starting afresh", path, exc)
        return {}
    return data if isinstance(data, dict) else {}


def read_stats(path: str | None = None) -> dict[str, Any]:
    """The persisted counters of every process (what `kiln stats --json` prints).

    `path` defaults to KILN_STATS_FILE, else <user cache>/kiln/stats.json. A missing file
    gives {}. The store's counters are under "store"; `summarize` adds derived figures.
    """
    path = path or default_stats_file()
    return _read_file(path) if path else {}


def summarize(counters: Mapping[str, Any]) -> dict[str, Any]:
    """Hit rates and latency quantiles (ms, bucket upper bounds) from store counters."""
    hits, misses = counters.get("hits", 0), counters.get("misses", 0)
    summary: dict[str, Any] = {
        "hits": hits,
        "misses": misses,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "tiers": {},
    }
    for name, tier in (counters.get("tiers") or {}).items():
        lookups = tier.get("hits", 0) + tier.get("misses", 0)
        latency = {}
        for op, hist in (tier.get("latency") or {}).items():
            if hist.get("count"):
                latency[op] = {
                    "count": hist["count"],
                    "mean_ms": hist["sum_ms"] / hist["count"],
                    "p50_ms": latency_quantile(hist, 0.5),
                    "p99_ms": latency_quantile(hist, 0.99),
                    "max_ms": hist.get("max_ms"),
                }
        summary["tiers"][name] = {
            "hit_rate": tier.get("hits", 0) / lookups if lookups else None,
            "bytes_read": tier.get("bytes_read", 0),
            "bytes_written": tier.get("bytes_written", 0),
            "errors": tier.get("errors", {}),
            "latency": latency,
        }
    return summary
