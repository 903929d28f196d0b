"""Kiln's local cache on disk: where bytes that become code (kernel sources that are
imported, shared objects that are dlopen'ed, cubins) are written before loading. The
trust boundary of the local disk, in one place:

- the cache folder (``KILN_CACHE_DIR``, else ``$XDG_CACHE_HOME/kiln``) and every folder
  above it must be this user's (or root's) and writable by no one else (a sticky folder
  such as /tmp passes); every folder Kiln makes below it is created with mode 0700, one
  level at a time, and checked the same way. A cache others can write (a shared ``/tmp``
  path, say) is not used: this process takes a private temporary folder instead,
  removed at exit, with one warning;
- a file named by the digest of its content is compared with the bytes it must hold
  before it is loaded, and rewritten (atomically) when it differs: a poisoned file is
  never loaded, and a torn one is repaired. Shared objects are loaded through the
  descriptor whose bytes were compared (``open_verified``), not by path;
- a file named by something else (the C++ build cache, by build key) is used only with
  a valid seal: an HMAC of its name and digest under a key kept outside the cache
  (``$XDG_CONFIG_HOME/kiln/build-cache.key``), so a cache restored from elsewhere (a CI
  cache) or planted by someone is rebuilt, never loaded or published.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import hmac
import logging
import os
import secrets
import shutil
import stat
import tempfile
import threading
from pathlib import Path

log = logging.getLogger("kiln.runtime")

_roots: dict[str, Path] = {}
_checked: set[Path] = set()  # folders made or checked private by this process
_lock = threading.Lock()
_SEAL_SUFFIX = ".seal"


def configured_root() -> Path:
    """The cache folder the environment names (not yet checked)."""
    root = os.environ.get("KILN_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kiln"


def unsafe_reason(path: Path) -> str | None:
    """Why ``path`` may not hold code this process loads; None if it may."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(info.st_mode):
        info = os.stat(path)
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"{path} is owned by uid {info.st_uid}, not this user ({os.getuid()})"
    if info.st_mode & 0o022:
        return f"{path} is writable by other users (mode {stat.filemode(info.st_mode)})"
    return None


def ancestors_reason(path: Path) -> str | None:
    """Why a folder above ``path`` lets others rename what is under it; None if none
    does (each is this user's or root's, and not writable by others unless sticky)."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    for folder in Path(os.path.realpath(path)).parents:
        try:
            info = os.stat(folder)
        except OSError:
            continue
        if uid is not None and info.st_uid not in (uid, 0):
            return f"{folder} is owned by uid {info.st_uid}"
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            return f"{folder} is writable by other users (mode {stat.filemode(info.st_mode)})"
    return None


def cache_root() -> Path:
    """The checked, private cache folder (module docstring); created on first use."""
    wanted = configured_root()
    with _lock:
        if str(wanted) not in _roots:
            _roots[str(wanted)] = _checked_root(wanted)
        return _roots[str(wanted)]


def _checked_root(wanted: Path) -> Path:
    if not wanted.exists():
        wanted.mkdir(parents=True, mode=0o700, exist_ok=True)
    reason = unsafe_reason(wanted) or ancestors_reason(wanted)
    if reason is None:
        return wanted
    return _fallback_root(wanted, reason)


def _fallback_root(wanted: Path, reason: str) -> Path:
    private = Path(tempfile.mkdtemp(prefix="kiln-cache-"))
    atexit.register(shutil.rmtree, private, True)
    log.warning("kiln: not using the cache folder %s: %s, and Kiln loads code from it. "
                "This process uses %s instead (removed at exit); chmod go-w the folder or "
                "set KILN_CACHE_DIR to a private one", wanted, reason, private)
    return private


def private_dir(*parts: str) -> Path:
    """A folder under the cache root, each level created with mode 0700 and checked
    (module docstring); a level others could write sends this process to a private
    temporary cache folder, with one warning."""
    root = cache_root()
    folder = root.joinpath(*parts)
    if folder in _checked:
        return folder
    reason = _make_private(root, parts)
    if reason is None:
        return folder
    with _lock:
        wanted = configured_root()
        if _roots.get(str(wanted)) == root:
            _roots[str(wanted)] = _fallback_root(root, reason)
    return private_dir(*parts)


def _make_private(root: Path, parts: tuple[str, ...]) -> str | None:
    """Create ``root/parts...`` one level at a time (0700); why a level is unsafe."""
    folder = root
    for part in parts:
        folder = folder / part
        if folder in _checked:
            continue
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            pass
        try:
            info = os.lstat(folder)
        except OSError as e:
            return f"{folder} cannot be checked ({e})"
        if not stat.S_ISDIR(info.st_mode):
            return f"{folder} is not a folder (a symbolic link or a file)"
        reason = unsafe_reason(folder)
        if reason is not None:
            return reason
        _checked.add(folder)
    return None


def atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def verified_file(path: Path, data: bytes) -> Path:
    """``path`` holding exactly ``data``: checked before use, (re)written if it differs."""
    try:
        current = path.read_bytes() if path.is_file() and not path.is_symlink() else None
    except OSError:
        current = None
    if current != data:
        if current is not None:
            log.warning("kiln: cached file %s did not hold the bytes named by its digest; "
                        "rewritten before loading", path)
        if path.is_symlink():
            path.unlink()
        atomic_write(path, data)
    return path


def open_verified(path: Path, data: bytes) -> int:
    """A descriptor of ``path`` (never through a symbolic link) whose bytes, read
    through it, are ``data``; OSError if they are not. Loading through the descriptor
    (``/proc/self/fd/N``) loads what was compared, whatever is renamed over the path
    meanwhile."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    try:
        with os.fdopen(os.dup(fd), "rb") as f:
            if f.read(len(data) + 1) != data:
                raise OSError(f"{path} changed after it was checked")
    except BaseException:
        os.close(fd)
        raise
    return fd


@functools.lru_cache(maxsize=1)
def _seal_key() -> bytes:
    """This user's key for build-cache seals, outside the cache folder; a key of this
    process alone when it cannot be kept (then the build cache lasts one process)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"),
                                                               ".config")
    path = Path(base) / "kiln" / "build-cache.key"
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("kiln: not using the build-cache key %s (%s): C++ kernels built by "
                    "other processes are rebuilt", path, e)
        return secrets.token_bytes(32)
    try:
        path.parent.mkdir(parents=True, mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(32))
        return _read_key(path)
    except OSError as e:
        log.debug("kiln: cannot keep a build-cache key at %s: %s", path, e)
        return secrets.token_bytes(32)


def _read_key(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if hasattr(os, "getuid") and info.st_uid != os.getuid() or info.st_mode & 0o077:
            raise OSError("it is not this user's alone (owner or mode)")
        key = f.read(64)
    if len(key) != 32:
        raise OSError("it is not a 32-byte key")
    return key


def _seal_of(path: Path, data: bytes) -> bytes:
    message = path.name.encode() + b"\0" + hashlib.sha256(data).digest()
    return hmac.new(_seal_key(), message, hashlib.sha256).digest()


def seal(path: Path, data: bytes) -> None:
    """Record that this user built ``path`` holding ``data`` (module docstring)."""
    atomic_write(path.with_name(path.name + _SEAL_SUFFIX), _seal_of(path, data))


def sealed_bytes(path: Path) -> bytes | None:
    """The bytes of build-cache file ``path`` if its seal is valid; None (to rebuild)
    otherwise, with a warning when a seal does not match."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            data = f.read()
        mark = path.with_name(path.name + _SEAL_SUFFIX).read_bytes()
    except OSError:
        return None
    if hmac.compare_digest(mark, _seal_of(path, data)):
        return data
    log.warning("kiln: ignoring cached build %s: its seal does not match (built "
                "elsewhere, or changed since); it is rebuilt", path)
    return None
