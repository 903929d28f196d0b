"""The store the rest of Kiln calls: `open_store(...)` and `Store`.

A lookup tries the local tier, then the store at KILN_STORE; a verified remote hit fills
the local tier. Nothing raises out of a public method: a fault is a miss (`get` returns
None) or a refusal (`publish` returns False), with one warning per outage or per damaged
artifact, and the caller compiles as if the store were not there.

What a read accepts (in this order):
1. a manifest that decodes, names the requested key and whose signature the keyring
   accepts (see `_signature_ok`);
2. blobs whose size and sha256 match the manifest.
Anything else is a miss. Damaged objects (undecodable manifest, missing or corrupt blob)
are removed from a tier this client may write (deleted from the local tier, moved to
quarantine/ in the store), so the next publish writes them afresh. Signature failures
remove nothing: another client with another key may read them rightly.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from .artifact import Artifact, check_blob_name, check_key
from .cas import AC_DIR, sha256_hex
from .claims import Claims
from .config import StoreConfig, missing_folder_reason, redact_url
from .errors import ConfigError, IntegrityError, UnsupportedFormat, describe_exception
from .faults import READ, WRITE, Reporter
from .gc import DEFAULT_GRACE_S, collect
from .manifest import BlobRef, ManifestRecord, decode_manifest, encode_manifest
from .signing import Keyring, Verdict, parse_keyring
from .stats import StoreStats
from .tiers import CACHE, Tier
from .trust import Freshness

logger = logging.getLogger(__name__)
QUEUE_DIR = "queue"


def _is_key(name: str) -> bool:
    try:
        check_key(name)
    except ValueError:
        return False
    return True


class _Prepared:
    """An artifact ready to write: blobs by digest and the encoded, signed manifest."""

    def __init__(self, key: str, blobs: dict[str, bytes], record: ManifestRecord) -> None:
        self.key = key
        self.blobs = blobs
        self.record = record


class BlobObserver(Protocol):
    """Told of a lookup's verified bytes as they arrive (the client starts loading cubins
    while the other blobs are still read): `manifest` with the verified manifest's
    metadata, then `blob` for each blob once it matched its digest. Their errors are
    logged and ignored; the lookup's result does not depend on them."""

    def manifest(self, meta: dict[str, Any]) -> None: ...

    def blob(self, name: str, data: bytes) -> None: ...


@dataclass
class Lookup:
    """Why a lookup found what it found, for tools that must tell the cases apart
    (`kiln inspect`): `problems` names each refusal, one (kind, detail) per tier.
    `observer` hears of the verified manifest and blobs as they are read."""

    artifact: Artifact | None = None
    problems: list[tuple[str, str]] = field(default_factory=list)
    observer: BlobObserver | None = None

    # kinds of problem, worst first
    KINDS = ("damaged", "refused", "unsupported", "unavailable", "invalid")

    @property
    def status(self) -> str:
        """"found", "missing", or the worst problem's kind."""
        if self.artifact is not None:
            return "found"
        kinds = [kind for kind, _ in self.problems]
        return next((k for k in self.KINDS if k in kinds), "missing")

    def note(self, kind: str, detail: str) -> None:
        self.problems.append((kind, detail))


class Store:
    """Content-addressed artifact store with a local tier in front of a remote one.

    Build it with `open_store`. Thread-safe; one per process is plenty."""

    def __init__(
        self,
        config: StoreConfig,
        *,
        primary: Tier | None,
        cache: Tier | None,
        keyring: Keyring,
        stats: StoreStats,
        disabled_reason: str | None = None,
        freshness: Freshness | None = None,
    ) -> None:
        self.config = config
        self.primary = primary
        self.cache = cache
        self.keyring = keyring
        self.require_signed = config.require_signed
        self.read_only = config.read_only
        self.disabled_reason = disabled_reason
        self.trust_unsigned = config.trust_unsigned
        self.freshness = freshness if freshness is not None else Freshness(None)
        self.warned_shared = False  # open_store said so already
        self._tiers = [t for t in (cache, primary) if t is not None]
        self._stats = stats
        self._reporter = Reporter(logger)
        self._finalizer = weakref.finalize(self, stats.flush)
        self._claims: Claims | None = None

    def refuses_unsigned(self, key: str) -> str | None:
        """Why an unsigned artifact under ``key`` would be refused here (signatures
        required, or a tier others can write and KILN_TRUST_UNSIGNED unset); None where
        this store accepts one (the trust rule of ``_signature_problem``)."""
        if self.require_signed:
            return "signatures are required"
        if self.trust_unsigned:
            return None
        for tier in self._tiers:
            shared = tier.shared_reason(key)
            if shared is not None:
                return f"others can write it: {shared}"
        return None

    @property
    def url(self) -> str:
        return redact_url(self.config.url)

    @property
    def can_publish(self) -> bool:
        """Whether this process is a builder for the store: it may write (not read-only)
        and either holds a key that signs, or the store is unsigned and signatures are
        not required. A client holding only a public key verifies and reads."""
        if self.read_only or self.primary is None:
            return False
        if self.keyring.signer is not None:
            return True
        return not self.keyring and not self.require_signed

    @property
    def claims(self) -> Claims:
        """Claims on keys in the store (claims.py): one compile per key across processes.
        Only a builder claims (others could not publish what they compile); a read-only
        or disabled store gives claims that are a no-op."""
        if self._claims is None:
            self._claims = Claims(self.primary, self._stats, self._reporter,
                                  writable=self.can_publish)
        return self._claims

    def quarantine(self, key: str, reason: str) -> None:
        """Set aside `key`'s artifact, which verified but failed to load (a compiler
        bug, or a builder's key used to sign bad code): removed from the local tier,
        moved to quarantine/ in the store where this client may write. Never raises."""
        for tier in self._tiers:
            try:
                raw = tier.read_manifest(key)
            except Exception as exc:
                self._fault(tier, READ, exc)
                continue
            if raw is not None:
                logger.debug("%s: quarantining %s: %s", tier.label, key, reason)
                tier.discard(key, raw)
        self._stats.count("integrity_failures")

    def __repr__(self) -> str:
        tiers = ", ".join(f"{t.name}={t.label}" for t in self._tiers) or "disabled"
        return f"Store({tiers}, read_only={self.read_only}, keys={self.keyring.describe()})"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush this process's counters to the stats file."""
        self._stats.flush()

    # Reads

    def get(self, key: str, *, kind: str = "", observer: BlobObserver | None = None
            ) -> Artifact | None:
        """The verified artifact for `key`, or None (a miss, whatever the reason).

        `kind` (e.g. "kernel") counts the lookup as `<kind>_hits` / `<kind>_misses`
        instead of the graph `hits` / `misses` that `kiln stats` reports. `observer`
        (`BlobObserver`) hears of verified bytes as they are read."""
        return self.lookup(key, kind=kind, observer=observer).artifact

    def lookup(self, key: str, *, kind: str = "", observer: BlobObserver | None = None
               ) -> Lookup:
        """`get`, telling a missing artifact from a damaged, refused or unreadable one."""
        outcome = Lookup(observer=observer)
        op = f"{kind}_get" if kind else "get"
        found = self._lookup(op, key, with_blobs=True, outcome=outcome)
        prefix = f"{kind}_" if kind else ""
        self._stats.count(prefix + ("hits" if found else "misses"))
        if found is not None:
            record, blobs = found
            outcome.artifact = Artifact(key=key, manifest=record.meta, blobs=blobs or {})
        return outcome

    def keys(self, prefix: str = "", errors: list[str] | None = None) -> list[str]:
        """Keys with a manifest in any tier that start with `prefix` (hex), sorted; for
        tools that accept a key's first characters. Never raises: a tier that cannot be
        listed adds nothing, and says why in `errors` when given."""
        folder = f"{AC_DIR}/{prefix[:2]}" if len(prefix) >= 2 else AC_DIR
        found: set[str] = set()
        for tier in self._tiers:
            try:
                names = [e.name for e in tier.io.listing(folder) if not e.is_temp]
            except Exception as exc:
                self._fault(tier, READ, exc)
                if errors is not None:
                    errors.append(f"{tier.label}: {describe_exception(exc)}")
                continue
            found.update(n for n in names if n.startswith(prefix))
        return sorted(found)

    # Work queues: `queue/<name>/<key>`, empty markers in the store (not the local tier)
    # naming a key that some worker should revisit (the GPU autotune queue). A marker
    # carries no content to trust: the worker fetches and verifies the artifact itself.

    def enqueue(self, queue: str, key: str) -> bool:
        """Add `key` to `queue` in the store; False if it cannot be written. Raises only
        ValueError, for a name or key that is not a safe path component."""
        tier = self.primary
        if tier is None:
            return False
        path = self._queue_path(tier, queue, key)
        if self.read_only or not tier.writable:
            return False
        try:
            tier.io.write(path, b"")
        except Exception as exc:
            self._fault(tier, WRITE, exc)
            return False
        return True

    def queued(self, queue: str) -> list[str]:
        """The keys in `queue`, oldest first. Never raises: an unreadable store has none."""
        tier = self.primary
        if tier is None:
            return []
        try:
            entries = [e for e in tier.io.listing(f"{QUEUE_DIR}/{check_key(queue)}")
                       if not e.is_temp]
        except Exception as exc:
            self._fault(tier, READ, exc)
            return []
        names = (e.name for e in sorted(entries, key=lambda e: e.mtime))
        return [name for name in names if _is_key(name)]

    def dequeue(self, queue: str, key: str) -> None:
        """Remove `key` from `queue` (nothing if it is not there); ValueError as enqueue."""
        tier = self.primary
        if tier is None:
            return
        path = self._queue_path(tier, queue, key)
        if self.read_only:
            return
        try:
            tier.io.remove(path)
        except Exception as exc:
            self._fault(tier, WRITE, exc)

    @staticmethod
    def _queue_path(tier: Tier, queue: str, key: str) -> str:
        return f"{tier.io.root}/{QUEUE_DIR}/{check_key(queue)}/{check_key(key)}"

    def unusable_reason(self) -> str | None:
        """Why this store cannot be used at all (disabled, its URL would not open, a store
        on local disk that does not exist); None when it can be."""
        if self.disabled_reason is not None:
            return self.disabled_reason
        if self.primary is None:
            return f"cannot open {self.url} (see the error above)"
        if self.primary.io.is_local and not self.primary.io.fs.isdir(self.primary.io.root):
            return missing_folder_reason(self.primary.io.root)
        return None

    def get_manifest(self, key: str) -> dict[str, Any] | None:
        """The caller's metadata of `key`'s artifact (the `manifest` it was published
        with), after verifying the signature; no blob is fetched or checked."""
        found = self._lookup("manifest", key, with_blobs=False)
        return None if found is None else found[0].meta

    def describe(self, key: str) -> dict[str, Any] | None:
        """The whole verified manifest as a plain dict: metadata, blobs by digest and
        size, creation time, signer; None on a miss (for `kiln inspect`)."""
        found = self._lookup("manifest", key, with_blobs=False)
        return None if found is None else found[0].describe()

    def contains(self, key: str) -> bool:
        """Whether a verified manifest exists for `key` (its blobs are checked by `get`)."""
        return self.get_manifest(key) is not None

    def _lookup(
        self, op: str, key: str, *, with_blobs: bool, outcome: Lookup | None = None
    ) -> tuple[ManifestRecord, dict[str, bytes] | None] | None:
        outcome = outcome if outcome is not None else Lookup()
        try:
            check_key(key)
        except ValueError as exc:
            self._reporter.warn_once(f"key:{key!r}", "Kiln artifact store: %s", exc)
            outcome.note("invalid", str(exc))
            return None
        try:
            return self._lookup_tiers(op, key, with_blobs, outcome)
        except Exception as exc:  # a bug here must still not reach the user's program
            self._reporter.once(
                logging.ERROR, f"internal:{op}", "Kiln artifact store: %s(%s) failed "
                "unexpectedly (%s); treating it as a miss", op, key, describe_exception(exc),
                exc_info=True,
            )
            outcome.note("error", f"{op} failed unexpectedly: {describe_exception(exc)}")
            return None

    def _lookup_tiers(
        self, op: str, key: str, with_blobs: bool, outcome: Lookup
    ) -> tuple[ManifestRecord, dict[str, bytes] | None] | None:
        missed: list[Tier] = []
        for tier in self._tiers:
            if not tier.health.available(READ):
                outcome.note("unavailable", f"{tier.label} is unavailable")
                continue
            start = time.perf_counter()
            found = self._read_from(tier, key, with_blobs, outcome)
            nbytes = found[0].nbytes if found and with_blobs else 0
            self._stats.lookup(tier.name, op, found is not None,
                               time.perf_counter() - start, nbytes)
            if found is not None:
                if with_blobs and missed:
                    self._fill(missed, key, found[0], found[1] or {})
                return found
            missed.append(tier)
        return None

    def _read_from(
        self, tier: Tier, key: str, with_blobs: bool, outcome: Lookup
    ) -> tuple[ManifestRecord, dict[str, bytes] | None] | None:
        try:
            raw = tier.read_manifest(key)
        except IntegrityError as exc:  # too big to be a manifest: not read
            self._damaged(tier, key, b"", exc, outcome)
            return None
        except Exception as exc:
            self._fault(tier, READ, exc)
            outcome.note("unavailable", f"{tier.label}: {describe_exception(exc)}")
            return None
        tier.health.succeeded(READ)
        if raw is None:
            return None
        record = self._verify(tier, key, raw, outcome)
        if record is None or not with_blobs:
            return None if record is None else (record, None)
        observer = self._observing(outcome.observer, record)
        try:
            blobs = tier.read_blobs(record.blobs, observer)
        except IntegrityError as exc:
            self._damaged(tier, key, raw, exc, outcome,
                          {ref.digest: ref.size for ref in record.blobs.values()})
            return None
        except Exception as exc:
            self._fault(tier, READ, exc)
            outcome.note("unavailable", f"{tier.label}: {describe_exception(exc)}")
            return None
        tier.touch(key)
        return record, blobs

    def _observing(self, observer: BlobObserver | None, record: ManifestRecord
                   ) -> Callable[[str, bytes], None] | None:
        """The observer told of a verified manifest; its `blob`, errors swallowed."""
        if observer is None:
            return None
        try:
            observer.manifest(record.meta)
        except Exception as exc:  # an observer's fault never changes a lookup
            logger.debug("Kiln artifact store: blob observer failed: %s", exc)
            return None

        def blob(name: str, data: bytes) -> None:
            try:
                observer.blob(name, data)
            except Exception as exc:
                logger.debug("Kiln artifact store: blob observer failed on %s: %s", name, exc)
        return blob

    def _verify(self, tier: Tier, key: str, raw: bytes, outcome: Lookup
                ) -> ManifestRecord | None:
        try:
            record = decode_manifest(raw)
        except UnsupportedFormat as exc:
            outcome.note("unsupported", f"{tier.label}: {exc}")
            self._reporter.warn_once(
                f"format:{tier.name}:{key}", "Kiln artifact store %s: artifact %s: %s; "
                "treating it as a miss (upgrade Kiln to use it)", tier.label, key, exc,
            )
            return None
        except IntegrityError as exc:
            self._damaged(tier, key, raw, exc, outcome)
            return None
        if record.key != key:
            self._damaged(tier, key, raw, IntegrityError(
                f"the manifest stored under {key} is for key {record.key}"), outcome)
            return None
        problem, shared = self._signature_problem(tier, record)
        if problem is None:
            problem = self._stale(record)
        if problem is not None:
            self._refused(tier, key, problem, shared, outcome)
            return None
        return record

    def _refused(self, tier: Tier, key: str, problem: str, shared: bool,
                 outcome: Lookup) -> None:
        self._stats.count("signature_failures")
        outcome.note("refused", f"{tier.label}: {problem}")
        if shared:  # one message per store: every artifact in it is refused alike
            level = logging.DEBUG if self.warned_shared else logging.WARNING
            self._reporter.once(
                level, f"shared:{tier.name}", "Kiln artifact store %s: refusing its "
                "unsigned artifacts (%s, e.g. %s): they are compiled locally. Give this "
                "client the builders' key (KILN_SIGNING_KEY=ed25519-pub:...), or set "
                "KILN_TRUST_UNSIGNED=1 to run them anyway", tier.label, problem, key)
            return
        hint = "" if "older than" in problem else \
            "; check that KILN_SIGNING_KEY matches the farm's key"
        self._reporter.warn_once(
            f"signature:{tier.name}:{key}", "Kiln artifact store %s: refusing artifact "
            "%s: %s. It is treated as a miss and compiled locally%s", tier.label, key,
            problem, hint,
        )

    def _signature_problem(self, tier: Tier, record: ManifestRecord
                           ) -> tuple[str | None, bool]:
        """Why the keyring refuses this manifest (None if it is accepted), and whether
        the reason is that others could have written it.

        Valid signatures pass; invalid ones never do. An unsigned manifest, or one
        signed by a key this client does not hold when it holds none, passes only when
        signatures are not required and either only this user could have written it
        (every folder level checked: trust.writable_by_others) or KILN_TRUST_UNSIGNED=1.
        A signature by an unknown key never passes a client that holds keys."""
        verdict = self.keyring.verify(record.body, record.signature)
        if verdict is Verdict.VALID:
            return None, False
        if verdict is Verdict.INVALID:
            return "its signature is invalid (forged, or altered after signing)", False
        if verdict is Verdict.UNKNOWN_KEY:
            assert record.signature is not None
            what = (f"it is signed by {record.signature.kid}, which is not among this "
                    f"client's keys ({self.keyring.describe()})")
            if self.keyring:
                return what, False
        else:
            what = "it is unsigned"
        if self.require_signed:
            return f"{what} and signatures are required", False
        shared = tier.shared_reason(record.key)
        if shared is None or self.trust_unsigned:
            return None, False
        return f"{what} and others can write it: {shared}", True

    def _stale(self, record: ManifestRecord) -> str | None:
        """Why an accepted manifest is a rollback (trust.Freshness); None if it is not."""
        if self.freshness.accept(record.key, record.created):
            return None
        return ("it is older than the artifact this user already accepted for that key "
                f"(published {record.created:.0f}, newest seen "
                f"{self.freshness.newest(record.key):.0f}): a restored old manifest")

    def _damaged(self, tier: Tier, key: str, raw: bytes, exc: IntegrityError,
                 outcome: Lookup, sizes: Mapping[str, int] | None = None) -> None:
        if tier.role == CACHE and exc.missing and not exc.corrupt:
            # Evicted under us by another process: refetch from the store, quietly.
            logger.debug("%s: %s is incomplete (%s); refetching", tier.label, key, exc)
            tier.discard(key, raw)
            return
        self._stats.count("integrity_failures")
        outcome.note("damaged", f"{tier.label}: {exc}")
        if not tier.writable:
            action = "left in place (read-only client)"
        else:
            action = "deleted" if tier.role == CACHE else "moved to quarantine/"
        self._reporter.warn_once(
            f"integrity:{tier.name}:{key}", "Kiln artifact store %s: artifact %s is damaged "
            "(%s); it is treated as a miss and %s, and the next publish replaces it",
            tier.label, key, exc, action,
        )
        tier.discard(key, raw, exc.missing + exc.corrupt, sizes)

    def _fault(self, tier: Tier, op: str, exc: BaseException) -> None:
        kind = tier.health.failed(op, exc)
        self._stats.error(tier.name, kind)

    def _fill(self, tiers: list[Tier], key: str, record: ManifestRecord,
              blobs: Mapping[str, bytes]) -> None:
        by_digest = {record.blobs[name].digest: data for name, data in blobs.items()}
        for tier in tiers:
            if tier.role == CACHE:
                self._write(tier, key, by_digest, record.raw)

    # Writes

    def publish(self, artifact: Artifact) -> bool:
        """Write blobs, then the signed manifest. True once the store (KILN_STORE) holds
        the whole artifact; False otherwise (read-only client, fault, invalid artifact),
        never an exception. The local tier is written too, when there is one."""
        if self.read_only:
            logger.debug("read-only store: not publishing %s", getattr(artifact, "key", "?"))
            return False
        try:
            prepared = self._prepare(artifact)
        except Exception as exc:
            self._stats.count("publish_failures")
            self._reporter.warn_once(
                f"invalid:{getattr(artifact, 'key', '?')}", "Kiln artifact store: cannot "
                "publish artifact %s: %s", getattr(artifact, "key", "?"), exc,
            )
            return False
        if prepared is None:
            self._stats.count("publish_failures")
            return False
        stored = False
        try:
            if self.primary is not None:
                stored = self._write(self.primary, prepared.key, prepared.blobs,
                                     prepared.record.raw)
            if self.cache is not None:
                self._write(self.cache, prepared.key, prepared.blobs, prepared.record.raw)
        except Exception as exc:
            self._reporter.once(
                logging.ERROR, "internal:publish", "Kiln artifact store: publish(%s) failed "
                "unexpectedly (%s)", prepared.key, describe_exception(exc), exc_info=True,
            )
        self._stats.count("publishes" if stored else "publish_failures")
        return stored

    def _prepare(self, artifact: Artifact) -> _Prepared | None:
        key = check_key(artifact.key)
        if not isinstance(artifact.blobs, Mapping) or not isinstance(artifact.manifest, Mapping):
            raise ValueError("blobs and manifest must be dicts")
        by_digest: dict[str, bytes] = {}
        refs: dict[str, BlobRef] = {}
        for name, data in artifact.blobs.items():
            check_blob_name(name)
            if not isinstance(data, (bytes, bytearray, memoryview)):
                raise ValueError(f"blob {name!r} is {type(data).__name__}, not bytes")
            content = bytes(data)
            digest = sha256_hex(content)
            by_digest[digest] = content
            refs[name] = BlobRef(digest, len(content))
        if self.require_signed and self.keyring.signer is None:
            self._reporter.warn_once(
                "cannot-sign", "Kiln artifact store: not publishing: signatures are required "
                "but KILN_SIGNING_KEY holds no key that can sign (%s); set the farm's "
                "private or HMAC key, or KILN_STORE_READ_ONLY=1 on clients",
                self.keyring.describe(),
            )
            return None
        record = encode_manifest(key, artifact.manifest, refs, self.keyring)
        self.freshness.accept(key, record.created)  # what this user published is newest
        return _Prepared(key, by_digest, record)

    def _write(self, tier: Tier, key: str, blobs: Mapping[str, bytes], manifest: bytes) -> bool:
        if not tier.writable or not tier.health.available(WRITE):
            return False
        start = time.perf_counter()
        try:
            written = tier.write_artifact(blobs, key, manifest)
        except Exception as exc:
            self._fault(tier, WRITE, exc)
            return False
        tier.health.succeeded(WRITE)
        self._stats.write(tier.name, time.perf_counter() - start, written)
        return True

    # Maintenance

    def gc(
        self,
        max_age_s: float | None = None,
        max_bytes: int | None = None,
        *,
        grace_s: float = DEFAULT_GRACE_S,
        dry_run: bool = False,
    ) -> dict[str, Any]:
        """Collect the store by age and size (see gc.py), and trim the local tier to its
        bound. A report per tier name; {"error": ...} entries instead of exceptions."""
        report: dict[str, Any] = {}
        if self.primary is not None:
            if self.read_only:
                report[self.primary.name] = {"skipped": "read-only client"}
            else:
                report[self.primary.name] = self._guarded_gc(
                    self.primary, max_age_s=max_age_s, max_bytes=max_bytes,
                    grace_s=grace_s, dry_run=dry_run,
                )
        if self.cache is not None and self.cache.bound is not None and not dry_run:
            try:
                report[self.cache.name] = self.cache.bound.evict()
            except Exception as exc:
                report[self.cache.name] = {"error": describe_exception(exc)}
        return report

    def _guarded_gc(self, tier: Tier, **options: Any) -> dict[str, Any]:
        if not tier.health.available(READ):
            return {"error": f"{tier.label} is unavailable (see the warning above); retry later"}
        try:
            result = collect(tier, **options)
        except Exception as exc:
            logger.warning("Kiln artifact store %s: gc failed: %s", tier.label,
                           describe_exception(exc))
            return {"error": describe_exception(exc)}
        return result

    def stats(self) -> dict[str, Any]:
        """This process's counters since the store opened (layout in stats.py)."""
        snapshot = self._stats.snapshot()
        snapshot["url"] = self.url
        snapshot["tier_labels"] = {t.name: t.label for t in self._tiers}
        snapshot["stats_file"] = self._stats.path
        return snapshot

    def flush_stats(self) -> bool:
        return self._stats.flush()


def keyring_for(config: StoreConfig) -> Keyring:
    """The keyring of a configuration; ConfigError if the key cannot be used."""
    keyring = parse_keyring(config.signing_key)
    if config.require_signed and not keyring:
        logger.warning(
            "Kiln artifact store: KILN_REQUIRE_SIGNED=1 but no KILN_SIGNING_KEY is set: every "
            "manifest will be refused and every graph compiled locally"
        )
    return keyring


__all__ = ["ConfigError", "Lookup", "Store", "keyring_for"]
