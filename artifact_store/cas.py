"""Object I/O on one fsspec file system: the layout, atomic writes, listings.

Layout under a store's root:

    cas/<sha[:2]>/<sha256>     blobs, named by the sha256 of their content
    ac/<key[:2]>/<key>         manifests (action cache), named by graph key
    quarantine/...             manifests and blobs that failed verification

Each write is atomic. On a local file system the bytes go to a temporary file in the
same folder, which is then renamed over the target (rename is atomic on POSIX and
Windows); on an object store one PUT creates the whole object. Either way a reader sees
the old object, the new one, or nothing, never a mix, however many writers race. There
is no fsync: a file torn by a power cut fails its digest and is treated as a miss.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

CAS_DIR = "cas"
AC_DIR = "ac"
QUARANTINE_DIR = "quarantine"
CLAIMS_DIR = "claims"  # claims.py: one compile of a key across processes
TMP_MARKER = ".tmp-"


class TooLarge(Exception):
    """An object bigger than its reader allows: not read (`ObjectIO.read`'s `limit`)."""

    def __init__(self, path: str, size: int, limit: int) -> None:
        super().__init__(f"{path} holds {size} bytes or more, more than the {limit} "
                         "allowed: not read")
        self.size = size


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Entry:
    """One stored object from a listing."""

    path: str
    size: int
    mtime: float

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]

    @property
    def is_temp(self) -> bool:
        return TMP_MARKER in self.name


def entry_mtime(info: dict[str, Any]) -> float:
    """Modification time from an fsspec info dict, whatever the backend calls it."""
    for field in ("mtime", "LastModified", "last_modified", "updated", "mtime_ns", "created"):
        value = info.get(field)
        if value is None:
            continue
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, (int, float)):
            return value / 1e9 if field == "mtime_ns" else float(value)
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return 0.0


class ObjectIO:
    """Reads and atomic writes of whole objects under `root` of one file system."""

    def __init__(self, fs: AbstractFileSystem, root: str) -> None:
        self.fs = fs
        self.root = root.rstrip("/")
        self.is_local = isinstance(fs, LocalFileSystem)
        # fsspec's own local file system (not a subclass that changes its I/O) is read
        # with open(): a warm hit reads ~100 blobs, and cat_file costs ~10 us more each.
        self._plain_reads = type(fs) is LocalFileSystem

    def blob_path(self, digest: str) -> str:
        return f"{self.root}/{CAS_DIR}/{digest[:2]}/{digest}"

    def manifest_path(self, key: str) -> str:
        return f"{self.root}/{AC_DIR}/{key[:2]}/{key}"

    def quarantine_path(self, path: str) -> str:
        stamp = time.strftime("%Y%m%dT%H%M%S")
        relative = path[len(self.root) + 1:] if path.startswith(self.root + "/") else path
        flat = relative.replace("/", "_")
        return f"{self.root}/{QUARANTINE_DIR}/{stamp}-{secrets.token_hex(3)}-{flat}"

    def read(self, path: str, limit: int | None = None) -> bytes | None:
        """The object's bytes, or None if it does not exist. With `limit`, an object of
        more bytes raises TooLarge before it is read (a file's size from its open
        descriptor; a remote object is read up to one byte past the limit)."""
        if self._plain_reads:
            try:
                with open(path, "rb") as f:
                    if limit is not None:
                        size = os.fstat(f.fileno()).st_size
                        if size > limit:
                            raise TooLarge(path, size, limit)
                    return f.read() if limit is None else f.read(limit + 1)
            except (FileNotFoundError, IsADirectoryError):
                return None
        try:
            if limit is None:
                data = self.fs.cat_file(path)
            else:
                data = self.fs.cat_file(path, start=0, end=limit + 1)
        except FileNotFoundError:
            return None
        except IsADirectoryError:
            return None
        if limit is not None and len(data) > limit:
            raise TooLarge(path, len(data), limit)
        return bytes(data)

    def size(self, path: str) -> int | None:
        """Size of an object, or None if it does not exist (never from a stale listing)."""
        try:
            try:
                info = self.fs.info(path, refresh=True)
            except TypeError:
                info = self.fs.info(path)
        except FileNotFoundError:
            return None
        if info.get("type") == "directory":
            return None
        return int(info.get("size") or 0)

    def write(self, path: str, data: bytes) -> None:
        """Write one whole object atomically (module docstring)."""
        if not self.is_local:
            self.fs.pipe_file(path, data)
            return
        try:
            self._write_local(path, data)
        except FileNotFoundError:
            # The folder is new, or was removed under us by a cleanup: make it, once more.
            parent = path.rsplit("/", 1)[0]
            self.fs.makedirs(parent, exist_ok=True)
            self._write_local(path, data)

    def _write_local(self, path: str, data: bytes) -> None:
        tmp = f"{path}{TMP_MARKER}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            with self.fs.open(tmp, "wb") as handle:
                handle.write(data)
            # os.replace, not fs.mv: shutil.move falls back to copy-and-delete on Windows
            # when the target exists, which a reader could see half done.
            os.replace(self.fs._strip_protocol(tmp), self.fs._strip_protocol(path))
        except BaseException:
            self._remove_quietly(tmp)
            raise

    def remove(self, path: str) -> bool:
        """Delete an object; False if it was already gone."""
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            return False
        return True

    def move(self, src: str, dst: str) -> None:
        if self.is_local:
            self.fs.makedirs(dst.rsplit("/", 1)[0], exist_ok=True)
        self.fs.mv(src, dst)

    def touch(self, path: str) -> None:
        """Mark an object as just used (local files: mtime), for LRU eviction."""
        if self.is_local:
            os.utime(self.fs._strip_protocol(path), None)

    def listing(self, folder: str) -> Iterator[Entry]:
        """Every object under `root/folder`, with size and modification time."""
        base = f"{self.root}/{folder}"
        if self.is_local:
            yield from self._scan_local(self.fs._strip_protocol(base))
            return
        try:
            self.fs.invalidate_cache(base)
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            return
        for path, info in found.items():
            if info.get("type", "file") != "directory":
                yield Entry(path, int(info.get("size") or 0), entry_mtime(info))

    def _scan_local(self, base: str) -> Iterator[Entry]:
        # os.scandir is several times faster than fsspec's find on big local caches.
        try:
            entries = list(os.scandir(base))
        except (FileNotFoundError, NotADirectoryError):
            return
        for entry in entries:
            try:
                if entry.is_dir(follow_symlinks=False):
                    yield from self._scan_local(entry.path)
                    continue
                stat = entry.stat(follow_symlinks=False)
            except FileNotFoundError:  # removed by a concurrent eviction
                continue
            yield Entry(entry.path.replace(os.sep, "/"), stat.st_size, stat.st_mtime)

    def _remove_quietly(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except Exception:
            pass
