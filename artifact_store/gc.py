"""Garbage collection of a tier: by age, by size, and of what nothing needs any more.

One pass, the same for `Store.gc` on the store and for the local tier's LRU bound:

1. temporary files of interrupted writes, quarantined objects and claims (claims.py)
   older than `grace_s` (a live claim is rewritten every third of its TTL, seconds;
   one this old was left by a process that died holding it, or by a release that
   failed);
2. manifests that do not decode (they are misses for every reader);
3. blobs no manifest names, older than `grace_s` (younger ones may belong to a publish
   in flight, whose manifest comes last);
4. manifests older than `max_age_s` (by modification time: publication on object
   stores, last hit on the local tier), with the blobs only they named;
5. while the total is above `max_bytes`, the oldest manifests, with the blobs only
   they named.

Manifests go before blobs, so a reader never finds a manifest whose blobs were collected
by design. A publish that runs during the pass may reuse a blob the pass means to delete
(it found the blob present and skipped writing it): before deleting blobs, the pass lists
the manifests again and spares every blob named by one it had not read (new, or
rewritten since); the publisher, for its part, checks after writing its manifest that the
blobs it reused are still there, and writes back any that are not (`Tier.write_artifact`).
If a manifest from a newer Kiln is present, its blob references are unknown:
no blob is collected, and the report says so. A read error aborts the pass: collecting
on partial knowledge could delete blobs that a live manifest names.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from .cas import AC_DIR, CAS_DIR, CLAIMS_DIR, QUARANTINE_DIR, Entry
from .errors import IntegrityError, UnsupportedFormat
from .manifest import decode_manifest

if TYPE_CHECKING:
    from .tiers import Tier

DEFAULT_GRACE_S = 3600.0


class _Plan:
    """What one pass deletes, and the size of what remains."""

    def __init__(self, total: int, now: float, grace_s: float) -> None:
        self.total = total
        self.now = now
        self.old = now - grace_s
        self.manifests: list[Entry] = []
        self.blobs: dict[str, Entry] = {}
        self.temps: list[Entry] = []
        self.quarantine: list[Entry] = []
        self.claims: list[Entry] = []
        self.broken: list[Entry] = []
        self.refs: dict[str, set[str]] = {}  # manifest path -> digests it names
        self.refcount: Counter[str] = Counter()
        self.blob_entries: dict[str, Entry] = {}
        self.seen: dict[str, float] = {}  # manifest path -> mtime when the pass read it
        self.spared = 0  # blobs kept because a publish during the pass named them
        self.sweep = True  # False when some manifest's references are unknown

    def drop(self, bucket: list[Entry], entry: Entry) -> None:
        bucket.append(entry)
        self.total -= entry.size

    def drop_blob(self, digest: str) -> None:
        entry = self.blob_entries.get(digest)
        if self.sweep and entry is not None and digest not in self.blobs:
            self.blobs[digest] = entry
            self.total -= entry.size

    def drop_manifest(self, entry: Entry) -> None:
        """The manifest, and the blobs that nothing kept names any more."""
        self.drop(self.manifests, entry)
        for digest in self.refs[entry.path]:
            self.refcount[digest] -= 1
            if self.refcount[digest] <= 0:
                self.drop_blob(digest)


def collect(
    tier: Tier,
    *,
    max_age_s: float | None = None,
    max_bytes: int | None = None,
    trigger_bytes: int | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    dry_run: bool = False,
    now: float | None = None,
) -> dict[str, Any]:
    """Run one pass (module docstring) over `tier`; a report of counts and bytes.

    With `trigger_bytes`, nothing happens unless the tier holds more than that."""
    io = tier.io
    ac = list(io.listing(AC_DIR))
    cas = list(io.listing(CAS_DIR))
    quarantine = list(io.listing(QUARANTINE_DIR))
    claims = list(io.listing(CLAIMS_DIR))
    total = sum(e.size for e in ac + cas + quarantine + claims)
    plan = _Plan(total, time.time() if now is None else now, grace_s)
    if trigger_bytes is not None and total <= trigger_bytes:
        return _report(plan, total, kept=len(ac), blobs_kept=len(cas), dry_run=dry_run)
    for entry in ac + cas:
        if entry.is_temp and entry.mtime < plan.old:
            plan.drop(plan.temps, entry)
    for entry in quarantine:
        if entry.mtime < plan.old:
            plan.drop(plan.quarantine, entry)
    for entry in claims:
        if entry.mtime < plan.old:
            plan.drop(plan.claims, entry)
    plan.blob_entries = {e.name: e for e in cas if not e.is_temp}
    manifests = [e for e in ac if not e.is_temp]
    plan.seen = {e.path: e.mtime for e in manifests}
    _read_refs(tier, manifests, plan)
    kept = _plan_drops(plan, manifests, max_age_s, max_bytes)
    if not dry_run:
        _execute(tier, plan)
    report = _report(plan, total, kept=kept, dry_run=dry_run,
                     blobs_kept=len(plan.blob_entries) - len(plan.blobs))
    if not plan.sweep:
        report["blob_sweep"] = "skipped: manifests from a newer Kiln are present"
    if plan.spared:
        report["blobs_spared"] = plan.spared
    return report


def _plan_drops(
    plan: _Plan, manifests: list[Entry], max_age_s: float | None, max_bytes: int | None
) -> int:
    """Steps 3 to 5 of the module docstring; how many manifests are kept."""
    # Oldest first; equal times (object stores keep seconds) fall back to the path.
    live = sorted((m for m in manifests if m.path in plan.refs), key=lambda e: (e.mtime, e.path))
    plan.refcount = Counter(d for m in live for d in plan.refs[m.path])
    for digest, entry in plan.blob_entries.items():
        if plan.refcount[digest] <= 0 and entry.mtime < plan.old:
            plan.drop_blob(digest)
    kept = []
    for entry in live:
        if max_age_s is not None and entry.mtime < plan.now - max_age_s:
            plan.drop_manifest(entry)
        else:
            kept.append(entry)
    while max_bytes is not None and kept and plan.total > max_bytes:
        plan.drop_manifest(kept.pop(0))
    return len(kept)


def _read_refs(tier: Tier, manifests: list[Entry], plan: _Plan) -> None:
    """Blob digests named by each readable manifest; undecodable ones are dropped."""
    contents = tier.read_many([m.path for m in manifests])
    for entry, raw in zip(manifests, contents):
        if raw is None:  # removed since the listing
            continue
        try:
            plan.refs[entry.path] = decode_manifest(raw).digests()
        except UnsupportedFormat:
            plan.sweep = False
        except IntegrityError:
            plan.drop(plan.broken, entry)


def _execute(tier: Tier, plan: _Plan) -> None:
    # Manifests first: once they are gone no reader looks for these blobs.
    paths = [e.path for e in plan.broken + plan.manifests]
    paths += [e.path for e in plan.temps + plan.quarantine + plan.claims]
    tier.remove_many(paths)
    if plan.blobs:
        _spare_reused(tier, plan)
    tier.remove_many([e.path for e in plan.blobs.values()])


def _spare_reused(tier: Tier, plan: _Plan) -> None:
    """Keep the blobs named by manifests published since the pass read them (a publish
    in flight that reused them); keep every blob if one of those cannot be read."""
    fresh = [e.path for e in tier.io.listing(AC_DIR)
             if not e.is_temp and plan.seen.get(e.path) != e.mtime]
    for raw in tier.read_many(fresh):
        if raw is None:
            continue
        try:
            digests = decode_manifest(raw).digests()
        except (UnsupportedFormat, IntegrityError):
            digests = set(plan.blobs)
        for digest in digests & set(plan.blobs):
            plan.total += plan.blobs.pop(digest).size
            plan.spared += 1


def _report(plan: _Plan, before: int, *, kept: int, blobs_kept: int,
            dry_run: bool) -> dict[str, Any]:
    return {
        "manifests_deleted": len(plan.manifests),
        "broken_manifests_deleted": len(plan.broken),
        "blobs_deleted": len(plan.blobs),
        "temp_files_deleted": len(plan.temps),
        "quarantine_deleted": len(plan.quarantine),
        "claims_deleted": len(plan.claims),
        "manifests_kept": kept,
        "blobs_kept": blobs_kept,
        "bytes_before": before,
        "bytes_after": plan.total,
        "bytes_freed": before - plan.total,
        "dry_run": dry_run,
    }
