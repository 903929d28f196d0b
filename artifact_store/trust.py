"""Who could have written the bytes Kiln is about to run, and what this client accepts.

The rule (DESIGN.md, "Artifacts and the store"): code is loaded only from bytes whose
digest chains to a signature this client's keyring trusts. Two exceptions, both here:

- an object only this user could have written: the object and every folder above it
  owned by this user (or root) and writable by no one else; a sticky folder such as
  /tmp passes, since others cannot rename or replace what is not theirs in it. A
  remote store (a bucket) never passes: its other writers are not visible from here;
- ``KILN_TRUST_UNSIGNED=1``: accept unsigned artifacts from any store, with a warning at
  the start of every process that sets it.

A third guard is freshness: a manifest carries its publish time (``created``), and a
client refuses a manifest older than one it has already accepted for the same key (an
attacker restoring an older, validly signed artifact). The newest publish time seen is
kept per key in a private folder of the user's cache. Publishes racing for one key land
in any order, so a manifest is stale only when it is older than the newest seen by more
than ROLLBACK_GRACE_S.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path

ENV_TRUST_UNSIGNED = "KILN_TRUST_UNSIGNED"
_TRUE = {"1", "true", "yes", "on"}
ROLLBACK_GRACE_S = 60.0
trust_log = logging.getLogger("kiln.trust")
_warned_trust_unsigned = False
_lock = threading.Lock()


def writable_by_others(path: str | os.PathLike[str]) -> str | None:
    """Why a user other than this one (or root) could have changed ``path``: it, or a
    folder above it, is another user's, or writable by group or others (not sticky).
    None when only this user could have. Levels that do not exist are skipped: there is
    nothing there yet to trust or distrust."""
    current = os.path.realpath(os.fspath(path))
    uid = os.getuid() if hasattr(os, "getuid") else None
    while True:
        reason = _level_reason(current, uid)
        if reason is not None:
            return reason
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current = parent


def _level_reason(path: str, uid: int | None) -> str | None:
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISLNK(info.st_mode):
        return f"{path} is a symbolic link that changed while it was checked"
    if uid is not None and info.st_uid not in (uid, 0):
        return f"{path} is owned by uid {info.st_uid}, not this user ({uid})"
    if info.st_mode & 0o022:
        if stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_ISVTX:
            return None  # sticky: others may add entries, not replace ours
        who = "group and others" if info.st_mode & 0o022 == 0o022 else (
            "its group" if info.st_mode & 0o020 else "others")
        return f"{path} is writable by {who} (mode {stat.filemode(info.st_mode)})"
    return None


def trust_unsigned(env: dict[str, str] | None = None) -> bool:
    """Whether ``KILN_TRUST_UNSIGNED=1`` is set; warns once per process when it is."""
    global _warned_trust_unsigned
    value = (os.environ if env is None else env).get(ENV_TRUST_UNSIGNED, "")
    if value.strip().lower() not in _TRUE:
        return False
    with _lock:
        if not _warned_trust_unsigned:
            _warned_trust_unsigned = True
            trust_log.warning(
                "Kiln: KILN_TRUST_UNSIGNED=1: unsigned artifacts are accepted from every "
                "store, package and farm, including ones other users can write; whoever "
                "can write them can make this process run their code. Unset it and give "
                "clients the builders' public key (KILN_SIGNING_KEY=ed25519-pub:...)")
    return True


class Freshness:
    """The newest publish time this user accepted per key (module docstring), in
    ``folder`` (created 0700; not used if others could write it) and in memory."""

    def __init__(self, folder: Path | None) -> None:
        self._seen: dict[str, float] = {}
        self._folder = folder
        self._lock = threading.Lock()

    def _path(self, key: str) -> Path | None:
        if self._folder is None:
            return None
        return self._folder / key[:2] / key

    def newest(self, key: str) -> float:
        with self._lock:
            known = self._seen.get(key, 0.0)
        path = self._path(key)
        if path is None:
            return known
        try:
            if writable_by_others(path) is None:
                return max(known, float(path.read_text()[:64]))
        except (OSError, ValueError):
            pass
        return known

    def accept(self, key: str, created: float) -> bool:
        """Record ``created`` for ``key``; False if a newer one was accepted before."""
        newest = self.newest(key)
        if created < newest - ROLLBACK_GRACE_S:
            return False
        if created > newest:
            with self._lock:
                self._seen[key] = created
            self._persist(key, created)
        return True

    def _persist(self, key: str, created: float) -> None:
        path = self._path(key)
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
            tmp = path.with_name(f"{key}.{os.getpid()}.tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(repr(created))
            os.replace(tmp, path)
        except OSError as exc:  # memory still holds it for this process
            logging.getLogger(__name__).debug("cannot record %s's publish time: %s", key, exc)
