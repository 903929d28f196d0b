"""Tiers: one place artifacts live (a local disk cache, or the store itself), with the
I/O rules for it.

A tier reads and verifies, writes blobs first and the manifest last, and removes what
failed verification. Remote tiers run every call on a daemon thread with a deadline
(`timeout_s` plus time for the bytes at a modest bandwidth), so a store that hangs costs
one timeout; the store's circuit breaker (faults.TierHealth) skips it after that.

Roles:
- "cache": the local tier in front of a remote store; bounded, least recently used
  artifacts evicted (whole artifacts: manifest first, then blobs nothing else names);
  what fails verification is deleted, since the remote holds the truth.
- "primary": the store at KILN_STORE; unbounded (see `gc`); what fails verification is
  moved to quarantine/ for inspection, if this client may write.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from .cas import AC_DIR, CAS_DIR, ObjectIO, TooLarge, sha256_hex
from .errors import IntegrityError
from .faults import DaemonPool, TierHealth
from .gc import collect
from .manifest import BlobRef
from .trust import writable_by_others

try:
    import fcntl
except ImportError:
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

CACHE = "cache"
PRIMARY = "primary"
MIN_BANDWIDTH = 8e6  # bytes/s granted on top of the timeout before a transfer is "slow"
SMALL_BLOB = 64 * 1024  # below this a remote PUT is as cheap as asking whether it exists
_BATCH = 64
PARALLEL_HASH_BYTES = 4 * 2**20  # local reads hash on several threads above this
_CORRUPT = b"\x00<corrupt>"  # marker object, compared by identity
MAX_MANIFEST_BYTES = 16 * 2**20  # a manifest names blobs; anything bigger is hostile


class Tier:
    """A filesystem root in one role (module docstring)."""

    def __init__(
        self,
        name: str,
        fs: AbstractFileSystem,
        root: str,
        *,
        role: str,
        label: str,
        health: TierHealth,
        pool: DaemonPool,
        timeout_s: float,
        writable: bool = True,
    ) -> None:
        self.name = name
        self.io = ObjectIO(fs, root)
        self.role = role
        self.label = label
        self.health = health
        self.pool = pool
        self.timeout_s = timeout_s
        self.writable = writable
        # Local disks and in-process memory answer or fail at once; only others can hang.
        self.uses_threads = not (self.io.is_local or isinstance(fs, MemoryFileSystem))
        self.bound: LruBound | None = None

    def __repr__(self) -> str:
        return f"Tier({self.name}, {self.role}, {self.label})"

    def deadline(self, nbytes: int = 0) -> float:
        return self.timeout_s + nbytes / MIN_BANDWIDTH

    def _call(self, nbytes: int, fn: Callable[..., Any], *args: Any) -> Any:
        if not self.uses_threads:
            return fn(*args)
        return self.pool.run(self.deadline(nbytes), fn, *args)

    def shared_reason(self, key: str) -> str | None:
        """Why someone other than this user could have written `key`'s manifest here
        (trust.writable_by_others, on every folder level); None if only this user could."""
        if isinstance(self.io.fs, MemoryFileSystem):
            return None  # this process's memory
        if not self.io.is_local:
            return f"{self.label} is a remote store, which others may write"
        return writable_by_others(self.io.fs._strip_protocol(self.io.manifest_path(key)))

    # Reads

    def read_manifest(self, key: str) -> bytes | None:
        """The manifest's bytes; IntegrityError, unread, if it is bigger than any
        manifest may be (MAX_MANIFEST_BYTES)."""
        try:
            return self._call(0, self.io.read, self.io.manifest_path(key),  # type: ignore[no-any-return]
                              MAX_MANIFEST_BYTES)
        except TooLarge as exc:
            raise IntegrityError(str(exc), corrupt=()) from None

    def read_blobs(self, refs: Mapping[str, BlobRef],
                   observer: Callable[[str, bytes], None] | None = None) -> dict[str, bytes]:
        """Every blob a manifest names, each checked against its digest; `observer`
        is told of each (by name) once it matched its digest, as the blobs arrive.

        IntegrityError naming what is missing or corrupt (`missing`/`corrupt` hold
        digests); other exceptions are faults of the tier. Blobs are fetched and hashed
        on pool threads when the tier is remote, or when there are megabytes to hash
        (hashlib releases the GIL, so several cores share the work)."""
        sizes = {ref.digest: ref.size for ref in refs.values()}
        digests = sorted(sizes)
        total = sum(sizes.values())
        calls = [(self._fetch_verified, (digest, sizes[digest])) for digest in digests]
        seen = _verified(observer, refs)
        if self.uses_threads or (total >= PARALLEL_HASH_BYTES and len(digests) > 1):
            results = self.pool.run_all(self.deadline(total), calls)
            for digest, data in zip(digests, results):  # (all at once)
                seen(digest, data)
        else:
            results = []
            for fetch, args in calls:  # each told as it arrives
                results.append(fetch(*args))
                seen(args[0], results[-1])
        by_digest = dict(zip(digests, results))
        missing = sorted(n for n, r in refs.items() if by_digest[r.digest] is None)
        corrupt = sorted(n for n, r in refs.items() if by_digest[r.digest] is _CORRUPT)
        if missing or corrupt:
            parts = []
            if missing:
                parts.append(f"missing blobs {missing}")
            if corrupt:
                parts.append(f"blobs failing their sha256 {corrupt}")
            raise IntegrityError(
                "; ".join(parts),
                missing=tuple(sorted({refs[n].digest for n in missing})),
                corrupt=tuple(sorted({refs[n].digest for n in corrupt})),
            )
        return {name: by_digest[ref.digest] for name, ref in refs.items()}  # type: ignore[misc]

    def _fetch_verified(self, digest: str, size: int) -> bytes | None:
        """The blob if it matches its digest; None if absent; _CORRUPT otherwise. A blob
        bigger than the manifest says is not read (a writer of the store could plant a
        huge sparse file)."""
        try:
            data = self.io.read(self.io.blob_path(digest), size)
        except TooLarge:
            return _CORRUPT
        if data is None:
            return None
        if len(data) != size or sha256_hex(data) != digest:
            return _CORRUPT
        return data

    def read_many(self, paths: list[str]) -> list[bytes | None]:
        """Objects in bulk (gc): None for one that does not exist; any other failure
        raises, since a caller deciding what to delete must not guess."""
        if not self.uses_threads:
            return [self.io.read(path) for path in paths]
        out: list[bytes | None] = []
        for start in range(0, len(paths), _BATCH):
            calls = [(self.io.read, (path,)) for path in paths[start:start + _BATCH]]
            out.extend(self.pool.run_all(self.deadline(), calls))
        return out

    def remove_many(self, paths: list[str]) -> None:
        """Delete objects (gc, eviction); ones already gone are fine."""
        if not self.uses_threads:
            for path in paths:
                self.io.remove(path)
            return
        for start in range(0, len(paths), _BATCH):
            batch = paths[start:start + _BATCH]
            self.pool.run_all(self.deadline(), [(self.io.remove, (path,)) for path in batch])

    # Writes

    def write_artifact(self, blobs: Mapping[str, bytes], key: str, manifest: bytes) -> int:
        """Blobs (by digest) first, the manifest last; the bytes actually written."""
        items = sorted(blobs.items())
        sizes = self._put_blobs(items)
        self._call(len(manifest), self.io.write, self.io.manifest_path(key), manifest)
        written = sum(sizes) + len(manifest)
        # Blobs found present were not written: a gc pass may have collected them since
        # (gc.py); write back any that are gone, now that the manifest protects them.
        reused = [item for item, size in zip(items, sizes) if size == 0 and item[1]]
        gone = [item for item in reused
                if self._call(0, self.io.size, self.io.blob_path(item[0])) is None]
        if gone:
            logger.info("%s: %d reused blobs were collected during the publish of %s; "
                        "written again", self.label, len(gone), key)
            written += sum(self._put_blobs(gone, force=True))
        if self.bound is not None:
            self.bound.note_write(written)
        return written

    def _put_blobs(self, items: list[tuple[str, bytes]], force: bool = False) -> list[int]:
        """Bytes written per blob: 0 for one found present (and `force` off)."""
        if self.uses_threads:
            total = sum(len(data) for _, data in items)
            calls = [(self._put_blob, (*item, force)) for item in items]
            return list(self.pool.run_all(self.deadline(total), calls))
        return [self._put_blob(digest, data, force) for digest, data in items]

    def _put_blob(self, digest: str, data: bytes, force: bool = False) -> int:
        path = self.io.blob_path(digest)
        if not force and self._blob_present(path, digest, data):
            return 0
        self.io.write(path, data)
        return len(data)

    def _blob_present(self, path: str, digest: str, data: bytes) -> bool:
        if self.io.is_local:
            if self.io.size(path) != len(data):
                return False
            existing = self.io.read(path)
            if existing is None or sha256_hex(existing) != digest:
                return False  # damaged: rewrite it
            self.io.touch(path)  # recently used again: keep it through eviction's grace
            return True
        if len(data) < SMALL_BLOB:
            return False
        return self.io.size(path) == len(data)

    def touch(self, key: str) -> None:
        """Record a hit for LRU eviction (cache tier on local disk only)."""
        if self.role == CACHE and self.io.is_local:
            try:
                self.io.touch(self.io.manifest_path(key))
            except OSError:
                pass

    # Removal of what failed verification

    def discard(self, key: str, seen: bytes, digests: tuple[str, ...] = (),
                sizes: Mapping[str, int] | None = None) -> None:
        """Remove a manifest that failed verification (if it is still the one we read)
        and blobs that still fail their digest (or their size in `sizes`, unread).
        Never raises."""
        if not self.writable:
            return
        try:
            path = self.io.manifest_path(key)
            if self._call(0, self.io.read, path, MAX_MANIFEST_BYTES) == seen:
                self._drop(path)
            for digest in digests:
                blob = self.io.blob_path(digest)
                expected = (sizes or {}).get(digest)
                if expected is not None and self._call(0, self.io.size, blob) != expected:
                    self._drop(blob)
                    continue
                data = self._call(0, self.io.read, blob, expected)
                if data is not None and sha256_hex(data) != digest:
                    self._drop(blob)
        except Exception as exc:
            logger.debug("%s: could not remove damaged %s: %s", self.label, key, exc)

    def _drop(self, path: str) -> None:
        if self.role == CACHE:
            self._call(0, self.io.remove, path)
        else:
            self._call(0, self.io.move, path, self.io.quarantine_path(path))


class LruBound:
    """Keeps a cache tier under `max_bytes` by evicting least recently used artifacts.

    Each process keeps an estimate of the tier's size (one listing at its first write,
    then its own writes added); when it passes the bound, an eviction (under a file lock,
    so one process at a time) measures the truth and removes the least recently used
    artifacts down to `low_water` of the bound."""

    def __init__(
        self, tier: Tier, max_bytes: int, *, low_water: float = 0.8, grace_s: float = 60.0,
        on_evict: Callable[[int], None] | None = None,
    ) -> None:
        self.tier = tier
        self.max_bytes = max_bytes
        self.low_water = low_water
        self.grace_s = grace_s
        self.on_evict = on_evict
        self._estimate: int | None = None

    def note_write(self, nbytes: int) -> None:
        """Account for a write; evict if the bound is passed. Never raises: a failed
        eviction leaves the tier too big, which is no reason to fail the write."""
        try:
            if self._estimate is None:
                self._estimate = self.measure()
            else:
                self._estimate += nbytes
            if self._estimate > self.max_bytes:
                self.evict()
        except Exception as exc:
            logger.warning("Kiln local cache %s: eviction failed (%s); it may exceed its "
                           "bound of %d bytes (KILN_LOCAL_CACHE_SIZE)", self.tier.label,
                           exc, self.max_bytes)

    def measure(self) -> int:
        io = self.tier.io
        return sum(e.size for folder in (AC_DIR, CAS_DIR) for e in io.listing(folder))

    def evict(self) -> dict[str, Any]:
        """Trim to the low-water mark if over the bound; the gc report."""
        with _EvictionLock(self.tier.io) as locked:
            if not locked:
                return {"skipped": "another process is evicting"}
            report = collect(
                self.tier,
                max_bytes=int(self.max_bytes * self.low_water),
                trigger_bytes=self.max_bytes,
                grace_s=self.grace_s,
            )
        self._estimate = report.get("bytes_after", self._estimate)
        evicted = int(report.get("manifests_deleted", 0))
        if evicted and self.on_evict is not None:
            self.on_evict(evicted)
        return report


class _EvictionLock:
    """Non-blocking exclusive lock on <root>/.evict.lock; yields whether it was taken."""

    def __init__(self, io: ObjectIO) -> None:
        self._path = os.path.join(io.fs._strip_protocol(io.root), ".evict.lock")
        self._handle: Any = None
        self._is_local = io.is_local

    def __enter__(self) -> bool:
        if not self._is_local or fcntl is None:
            return True
        try:
            os.makedirs(os.path.dirname(self._path), exist_ok=True)
            self._handle = open(self._path, "a+")
            fcntl.flock(self._handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            if self._handle is not None:
                self._handle.close()
                self._handle = None
            return False
        return True

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            fcntl.flock(self._handle.fileno(), fcntl.LOCK_UN)
            self._handle.close()


def _verified(observer: Callable[[str, bytes], None] | None, refs: Mapping[str, BlobRef]
              ) -> Callable[[str, Any], None]:
    """``seen(digest, result)``: tells ``observer`` the names of a blob that matched its
    digest (not a missing or corrupt one); a no-op without an observer."""
    if observer is None:
        return lambda digest, data: None
    names: dict[str, list[str]] = {}
    for name, ref in refs.items():
        names.setdefault(ref.digest, []).append(name)

    def seen(digest: str, data: Any) -> None:
        if data is not None and data is not _CORRUPT:
            for name in names[digest]:
                observer(name, data)

    return seen
