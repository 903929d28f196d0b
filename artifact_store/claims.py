"""Claims: one compile of a key however many processes miss it at once.

A process that misses a key claims it in the store before compiling; others that find a
live claim wait for the artifact instead of compiling the same graph, and take over a
claim whose holder stopped renewing it (killed, hung, its host gone). Bazel's remote
execution runs an action once for every client that asks; this is that rule across
processes with no farm between them.

Layout: ``claims/<key[:2]>/<key>.<generation>`` holds a small JSON object (owner: host,
pid, ...; a token; an expiry; a renewal count). A claim is *created* only where no object
of that name exists, so of the processes racing for one generation exactly one wins:

- local or shared folder: the claim is written to a temporary file and ``link()``-ed to
  its name (fails if it exists; readers never see a half-written claim);
- S3: ``PUT`` with ``If-None-Match: *`` (a conditional write: 412 if the object exists);
- memory: a lock in this process (a memory store is process-local anyway);
- any other backend: check, then write: best effort (two processes may both compile;
  the artifact is the same and its publish is atomic, so this costs time, not results).

A takeover creates the next generation, by the same rule, so two processes taking over
one expired claim cannot both win. Renewal reads the claim, compares its token and
rewrites it; release deletes it (after publish, and after a failed compile, so waiters
compile at once). A waiter judges expiry by its own clock: a claim whose renewal count has
not moved for a whole TTL is dead, whatever the clocks of other hosts say.

Claim objects come from the store: they are parsed as plain data, never run, and one that
does not parse is treated as expired. A hostile writer can at most make others wait up to
their deadline, then compile themselves. A store that is read-only or down makes claims
a no-op: the caller compiles itself; a fault opens the store's circuit breaker (faults.py),
whose one warning per outage is the only one.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from .cas import CLAIMS_DIR, TMP_MARKER
from .errors import describe_exception
from .faults import READ, WRITE, Reporter
from .stats import StoreStats
from .tiers import Tier

logger = logging.getLogger(__name__)

T = TypeVar("T")

CLAIMS_ENV = "KILN_CLAIMS"
TTL_ENV = "KILN_CLAIM_TTL"
WAIT_ENV = "KILN_CLAIM_WAIT"
DEFAULT_TTL_S = 30.0
DEFAULT_WAIT_S = 600.0
FIRST_POLL_S = 0.05
MAX_POLL_S = 1.0
_memory_lock = threading.Lock()

# What each kind of file system guarantees when a claim is created (README: "Claims").
ATOMIC, CONDITIONAL, PROCESS_LOCAL, BEST_EFFORT = (
    "atomic create", "conditional put", "process-local", "best effort")


class ClaimExists(Exception):
    """Another process created this claim first."""


def _env_float(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, "") or default)
    except ValueError:
        return default
    return value if value > 0 else default


def default_owner() -> dict[str, Any]:
    """Who holds a claim: host and pid, and the torchrun rank where there is one."""
    owner: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid()}
    if os.environ.get("RANK"):
        owner["rank"] = os.environ["RANK"]
    return owner


def describe_owner(owner: dict[str, Any] | None) -> str:
    if not owner:
        return "?"
    return f"{owner.get('host', '?')}:{owner.get('pid', '?')}"


@dataclass
class Holder:
    """A claim as read from the store."""

    path: str
    generation: int
    token: str
    owner: dict[str, Any]
    expires_at: float
    renewals: int
    raw: bytes


@dataclass
class ClaimOutcome(Generic[T]):
    """What ``Claims.acquire_or_wait`` did: ``claim`` is held (compile, then release it),
    or ``found`` is the artifact another process published meanwhile; neither: compile
    without a claim (``reason`` says why: deadline, store unavailable, claims off)."""

    claim: Claim | None = None
    found: T | None = None
    reason: str = "claimed"
    waited_s: float = 0.0
    holder: dict[str, Any] | None = None  # whom this process waited on
    took_over: bool = False


class Claim:
    """A claim this process holds; a daemon thread renews it until ``release``."""

    def __init__(self, claims: Claims, key: str, path: str, token: str,
                 owner: dict[str, Any], generation: int) -> None:
        self.claims = claims
        self.key = key
        self.path = path
        self.token = token
        self.owner = owner
        self.generation = generation
        self.lost = False  # taken over by another process (this one stopped renewing)
        self._renewals = 0
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def start_renewing(self, max_hold_s: float) -> None:
        """Renew every third of the TTL, for at most ``max_hold_s`` (a hung compile's
        claim then expires and is taken over)."""
        def loop() -> None:
            ends = time.monotonic() + max_hold_s
            while not self._stop.wait(self.claims.ttl_s / 3):
                if time.monotonic() >= ends or not self.renew():
                    return
        self._renewer = threading.Thread(target=loop, name=f"kiln-claim-{self.key[:8]}",
                                         daemon=True)
        self._renewer.start()

    def renew(self) -> bool:
        """Push the expiry on, if the claim is still this process's; False if lost."""
        self._renewals += 1
        ok = self.claims.rewrite(self, self._renewals)
        self.lost = self.lost or not ok
        return ok

    def release(self) -> None:
        """Stop renewing and delete the claim (if still ours). Never raises."""
        self._stop.set()
        self.claims.delete(self)

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass
class _Watch:
    """What a waiter saw of the current claim, on its own clock."""

    token: str = ""
    renewals: int = -1
    since: float = field(default_factory=time.monotonic)


class Claims:
    """Claims of one store tier (module docstring). Built by ``Store.claims``."""

    def __init__(self, tier: Tier | None, stats: StoreStats, reporter: Reporter, *,
                 writable: bool, ttl_s: float | None = None, wait_s: float | None = None,
                 enabled: bool | None = None) -> None:
        self.tier = tier
        self.stats = stats
        self.reporter = reporter
        self.ttl_s = ttl_s if ttl_s is not None else _env_float(TTL_ENV, DEFAULT_TTL_S)
        self.wait_s = wait_s if wait_s is not None else _env_float(WAIT_ENV, DEFAULT_WAIT_S)
        if enabled is None:
            enabled = os.environ.get(CLAIMS_ENV, "on").lower() not in ("0", "off", "no", "false")
        self.off_reason = None if enabled else f"{CLAIMS_ENV}=off"
        if self.off_reason is None and (tier is None or not writable or not tier.writable):
            self.off_reason = "the store is read-only or not open"

    @property
    def guarantee(self) -> str:
        """How claims are created on this store (module docstring)."""
        if self.tier is None:
            return BEST_EFFORT
        fs = self.tier.io.fs
        if isinstance(fs, LocalFileSystem):
            return ATOMIC
        if isinstance(fs, MemoryFileSystem):
            return PROCESS_LOCAL
        if _is_s3(fs):
            return CONDITIONAL
        return BEST_EFFORT

    # -- the caller's two entry points ----------------------------------------------------

    def acquire_or_wait(self, key: str, ready: Callable[[], T | None],
                        owner: dict[str, Any] | None = None,
                        on_wait: Callable[[dict[str, Any]], None] | None = None
                        ) -> ClaimOutcome[T]:
        """Claim ``key``, or wait (polling ``ready``, with backoff) while another process
        holds a live claim; take the claim over once it expires; give up waiting after
        ``wait_s``. ``on_wait`` hears of the holder once, when waiting starts."""
        owner = owner or default_owner()
        if self.off_reason is not None:
            return ClaimOutcome(reason=f"no claim: {self.off_reason}")
        if not self._healthy():
            return ClaimOutcome(reason="no claim: the store is unavailable")
        start = time.monotonic()
        deadline, poll, watch = start + self.wait_s, FIRST_POLL_S, _Watch()
        outcome: ClaimOutcome[T] = ClaimOutcome()
        while True:
            try:
                claim, holder, took_over = self._attempt(key, owner, watch)
            except Exception as exc:
                return self._unavailable(outcome, exc, start)
            if claim is not None:
                outcome.claim, outcome.took_over = claim, took_over
                return self._claimed(outcome, claim, ready, start)
            if outcome.holder is None and holder is not None:
                outcome.holder = holder.owner
                if on_wait is not None:
                    on_wait(holder.owner)
            found = ready()
            if found is not None:
                outcome.found, outcome.reason = found, "found"
                return self._finish_wait(outcome, start)
            if time.monotonic() >= deadline:
                outcome.reason = "deadline"
                return self._finish_wait(outcome, start)
            time.sleep(min(poll, max(0.0, deadline - time.monotonic())))
            poll = min(MAX_POLL_S, poll * 1.5)

    def try_acquire(self, key: str, owner: dict[str, Any] | None = None) -> Claim | None:
        """One attempt, no waiting (the farm: it compiles what it is asked either way,
        and its claim tells processes with no farm to wait for it). Takes over only a
        claim whose expiry has passed by the holder's clock."""
        if self.off_reason is not None or not self._healthy():
            return None
        try:
            claim, _, took_over = self._attempt(key, owner or default_owner(), None)
        except Exception as exc:
            self._unavailable(ClaimOutcome(), exc, time.monotonic())
            return None
        if claim is not None:
            self.stats.count("claims")
            self.stats.count("claim_takeovers", int(took_over))
            claim.start_renewing(self.wait_s)
        return claim

    # -- one attempt ----------------------------------------------------------------------

    def _attempt(self, key: str, owner: dict[str, Any], watch: _Watch | None
                 ) -> tuple[Claim | None, Holder | None, bool]:
        """Create the next claim if there is none or the current one is dead; else the
        live holder."""
        current = self._current(key)
        if current is not None and not self._dead(current, watch):
            return None, current, False
        generation = current.generation + 1 if current is not None else 1
        token = secrets.token_hex(16)
        path = self._path(key, generation)
        claim = Claim(self, key, path, token, owner, generation)
        try:
            self._create(path, self._encode(claim, 0))
        except ClaimExists:
            return None, self._current(key), False
        # A process that listed the claims before a takeover and read them after it finds
        # none, and creates the first generation again: the newest generation wins.
        newest = self._current(key)
        if newest is not None and newest.generation > generation:
            self._remove(path)
            return None, newest, False
        if current is not None:
            self._remove(current.path)  # the dead generation: ours supersedes it
        return claim, None, current is not None

    def _dead(self, holder: Holder, watch: _Watch | None) -> bool:
        """Expired by the holder's own clock, by more than one TTL of slack, or (for a
        waiter) not renewed for one whole TTL of this process's clock."""
        if time.time() > holder.expires_at + self.ttl_s:
            return True
        if watch is None:
            return time.time() > holder.expires_at
        if (holder.token, holder.renewals) != (watch.token, watch.renewals):
            watch.token, watch.renewals, watch.since = (holder.token, holder.renewals,
                                                        time.monotonic())
            return False
        return time.monotonic() - watch.since > self.ttl_s

    def _claimed(self, outcome: ClaimOutcome[T], claim: Claim, ready: Callable[[], T | None],
                 start: float) -> ClaimOutcome[T]:
        # The artifact may have landed between the last look and this claim (its builder
        # released just before): look once more rather than compile it again.
        found = ready()
        if found is not None:
            claim.release()
            outcome.claim, outcome.found, outcome.reason = None, found, "found"
            return self._finish_wait(outcome, start)
        self.stats.count("claims")
        if outcome.took_over:
            self.stats.count("claim_takeovers")
            outcome.reason = "took over"
            logger.info("kiln: took over the expired claim on %s", claim.key[:16])
        self._finish_wait(outcome, start)
        claim.start_renewing(self.wait_s)
        return outcome

    def _finish_wait(self, outcome: ClaimOutcome[T], start: float) -> ClaimOutcome[T]:
        if outcome.holder is not None:
            outcome.waited_s = time.monotonic() - start
            self.stats.count("claim_waits")
            self.stats.count("claim_wait_seconds", outcome.waited_s)
            if outcome.reason == "deadline":
                self.stats.count("claim_deadlines")
        return outcome

    def _healthy(self) -> bool:
        """Whether the store's circuit breaker lets reads and writes through (a store in
        an outage is skipped, its one warning already given)."""
        health = self.tier.health if self.tier is not None else None
        return health is None or (health.available(READ) and health.available(WRITE))

    def _unavailable(self, outcome: ClaimOutcome[T], exc: BaseException, start: float
                     ) -> ClaimOutcome[T]:
        """A fault: the tier's circuit breaker opens, with the store's one warning per
        outage (the publish that follows is skipped, not warned about again)."""
        self.stats.count("claim_errors")
        if self.tier is not None:
            kind = self.tier.health.failed(WRITE, exc)
            self.stats.error(self.tier.name, kind)
        else:
            self.reporter.warn_once("claims", "Kiln artifact store: cannot claim graphs "
                                    "(%s)", describe_exception(exc))
        outcome.reason = f"no claim: {describe_exception(exc)}"
        return self._finish_wait(outcome, start)

    # -- objects --------------------------------------------------------------------------

    def _folder(self, key: str) -> str:
        assert self.tier is not None
        return f"{self.tier.io.root}/{CLAIMS_DIR}/{key[:2]}"

    def _path(self, key: str, generation: int) -> str:
        return f"{self._folder(key)}/{key}.{generation:08d}"

    def _encode(self, claim: Claim, renewals: int) -> bytes:
        return json.dumps({"key": claim.key, "token": claim.token, "owner": claim.owner,
                           "generation": claim.generation, "renewals": renewals,
                           "expires_at": time.time() + self.ttl_s}, sort_keys=True).encode()

    def _current(self, key: str) -> Holder | None:
        """The newest generation of ``key``'s claim, or None."""
        assert self.tier is not None
        tier, prefix = self.tier, f"{key}."
        entries = tier._call(0, lambda: [e for e in tier.io.listing(
            self._folder(key)[len(tier.io.root) + 1:]) if e.name.startswith(prefix)
            and not e.is_temp])
        for entry in sorted(entries, key=lambda e: e.name, reverse=True):
            raw = tier._call(0, tier.io.read, entry.path)
            if raw is None:  # released or superseded since the listing
                continue
            return _decode(entry.path, entry.name[len(prefix):], raw)
        return None

    def _create(self, path: str, data: bytes) -> None:
        assert self.tier is not None
        self.tier._call(len(data), _create_exclusive, self.tier.io, path, data)

    def rewrite(self, claim: Claim, renewals: int) -> bool:
        """Renew ``claim`` if the object still carries its token (compare, then write)."""
        assert self.tier is not None
        tier = self.tier
        try:
            raw = tier._call(0, tier.io.read, claim.path)
            if raw is None or _decode(claim.path, str(claim.generation), raw).token \
                    != claim.token:
                logger.info("kiln: the claim on %s was taken over", claim.key[:16])
                return False
            tier._call(0, tier.io.write, claim.path, self._encode(claim, renewals))
        except Exception as exc:
            logger.debug("kiln: could not renew the claim on %s: %s", claim.key[:16], exc)
            return True  # a passing fault: try again at the next renewal
        return True

    def delete(self, claim: Claim) -> None:
        """Remove ``claim`` if it still carries its token. Never raises."""
        if self.tier is None:
            return
        tier = self.tier
        try:
            raw = tier._call(0, tier.io.read, claim.path)
            if raw is not None and _decode(claim.path, "0", raw).token == claim.token:
                self._remove(claim.path)
        except Exception as exc:
            logger.debug("kiln: could not release the claim on %s: %s", claim.key[:16], exc)

    def _remove(self, path: str) -> None:
        assert self.tier is not None
        try:
            self.tier._call(0, self.tier.io.remove, path)
        except Exception as exc:
            logger.debug("kiln: could not remove claim %s: %s", path, exc)


def _decode(path: str, generation: str, raw: bytes) -> Holder:
    """A claim read from the store; one that does not parse reads as long expired."""
    try:
        data = json.loads(raw.decode())
        owner = data.get("owner")
        return Holder(path, int(generation), str(data["token"]),
                      owner if isinstance(owner, dict) else {},
                      float(data["expires_at"]), int(data.get("renewals", 0)), raw)
    except Exception:
        gen = int(generation) if generation.isdigit() else 0
        return Holder(path, gen, "", {}, 0.0, 0, raw)


def _is_s3(fs: Any) -> bool:
    protocol = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    return "s3" in protocol and hasattr(fs, "call_s3")


def _create_exclusive(io: Any, path: str, data: bytes) -> None:
    """Create ``path`` with ``data`` unless it exists (ClaimExists), as atomically as the
    file system allows (module docstring)."""
    fs = io.fs
    if isinstance(fs, LocalFileSystem):
        _link_create(fs._strip_protocol(path), data)
    elif _is_s3(fs):
        _s3_create(fs, path, data)
    elif isinstance(fs, MemoryFileSystem):
        with _memory_lock:
            if fs.exists(path):
                raise ClaimExists(path)
            fs.pipe_file(path, data)
    else:
        if io.size(path) is not None:
            raise ClaimExists(path)
        io.write(path, data)


def _link_create(path: str, data: bytes) -> None:
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}{TMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}"
    with open(tmp, "wb") as handle:
        handle.write(data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise ClaimExists(path) from None
    finally:
        os.unlink(tmp)


def _s3_create(fs: Any, path: str, data: bytes) -> None:
    bucket, key, _ = fs.split_path(path)
    try:
        fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, IfNoneMatch="*")
    except Exception as exc:
        if _precondition_failed(exc):
            raise ClaimExists(path) from None
        raise
    fs.invalidate_cache(path.rsplit("/", 1)[0])


def _precondition_failed(exc: BaseException) -> bool:
    """An S3 412 (the object exists) or 409 (a conditional write raced another)."""
    text = f"{type(exc).__name__} {exc}"
    seen: BaseException | None = exc
    while seen is not None:
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = response.get("Error", {}).get("Code")
            if status in (409, 412) or code in ("PreconditionFailed",
                                                 "ConditionalRequestConflict"):
                return True
        seen = seen.__cause__ or seen.__context__
    return "PreconditionFailed" in text or "412" in text
