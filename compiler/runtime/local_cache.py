"""Kiln's local cache on disk: where bytes that become code (kernel sources that are
imported, shared objects that are dlopen'ed, cubins) are written before loading. The
trust boundary of the local disk, in one place:

- the cache folder (``KILN_CACHE_DIR``, else ``$XDG_CACHE_HOME/kiln``) must be owned by
  this user and writable by no one else; Kiln creates its folders with mode 0700. A
  folder others can write (a shared ``/tmp`` path, say) is not used: this process takes a
  private temporary folder instead, removed at exit, with one warning;
- a file named by the digest of its content is compared with the bytes it must hold
  before it is loaded, and rewritten (atomically) when it differs: a poisoned file is
  never loaded, and a torn one is repaired;
- a file named by something else (the C++ build cache, by build key) is used only if it
  is a regular file owned by this user and writable by no one else.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import stat
import tempfile
import threading
from pathlib import Path

log = logging.getLogger("kiln.runtime")

_roots: dict[str, Path] = {}
_lock = threading.Lock()


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
    reason = unsafe_reason(wanted)
    if reason is None:
        return wanted
    private = Path(tempfile.mkdtemp(prefix="kiln-cache-"))
    atexit.register(shutil.rmtree, private, True)
    log.warning("kiln: not using the cache folder %s: %s, and Kiln loads code from it. "
                "This process uses %s instead (removed at exit); chmod go-w the folder or "
                "set KILN_CACHE_DIR to a private one", wanted, reason, private)
    return private


def private_dir(*parts: str) -> Path:
    """A folder under the cache root, created with mode 0700."""
    folder = cache_root().joinpath(*parts)
    folder.mkdir(parents=True, mode=0o700, exist_ok=True)
    return folder


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


def trusted_file(path: Path) -> bool:
    """Whether a cache file not named by its content may be used (module docstring)."""
    try:
        if path.is_symlink() or not path.is_file():
            return False
    except OSError:
        return False
    reason = unsafe_reason(path) or unsafe_reason(path.parent)
    if reason is not None:
        log.warning("kiln: ignoring cached file: %s; it is rebuilt", reason)
        return False
    return True
