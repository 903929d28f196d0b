"""A small real file system that fills up: a tmpfs of a few MiB, mounted without root.

A helper process enters its own user and mount namespaces (`unshare --user
--map-root-user --mount`), mounts a tmpfs of `size` bytes on a folder there and sleeps;
this process writes to it through `/proc/<pid>/root/<folder>`, so writes past its size
fail with ENOSPC from the kernel, as on a full disk. Used by the disk-full test
(tests/store/test_disk_full.py) and the chaos run (bench/chaos.py).
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import tempfile
import types
from pathlib import Path
from typing import Any

CHUNK = 1 << 16


class SmallFilesystem:
    """A tmpfs of `size` bytes reachable at `path`; `fill` and `free` it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._anchor = Path(tempfile.mkdtemp(prefix="kiln-smallfs-"))
        command = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                   f"mount -t tmpfs -o size={size} tmpfs {self._anchor} && echo ready "
                   "&& exec sleep 86400"]
        self._proc = subprocess.Popen(command, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None
        if self._proc.stdout.readline().strip() != "ready":
            error = self._proc.stderr.read() if self._proc.stderr else ""
            self.close()
            raise OSError(f"cannot mount a tmpfs in a user namespace: {error.strip()}")
        self.path = Path(f"/proc/{self._proc.pid}/root{self._anchor}")
        self._filler = self.path / "filler"

    def available(self) -> int:
        stats = os.statvfs(self.path)
        return stats.f_bavail * stats.f_frsize

    def fill(self, leave: int = 0) -> None:
        """Write a filler file until the disk is full, then give back `leave` bytes
        (rounded to the file system's pages)."""
        with open(self._filler, "ab", buffering=0) as handle:
            block = b"\0" * CHUNK
            try:
                while True:
                    handle.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
            size = os.fstat(handle.fileno()).st_size
        os.truncate(self._filler, max(0, size - leave))

    def free(self) -> None:
        """Space returns: remove the filler."""
        self._filler.unlink(missing_ok=True)

    def close(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        shutil.rmtree(self._anchor, ignore_errors=True)

    def __enter__(self) -> SmallFilesystem:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def moto_tempfile(folder: Path) -> Any:
    """A stand-in for `moto.s3.models.tempfile` that puts every object's bytes in a file
    in `folder` from the first byte (moto keeps them in SpooledTemporaryFiles: memory up
    to 5 MiB, then a file in the temp folder). With it, an S3 server's disk is
    `folder`'s file system: `moto.s3.models.tempfile = moto_tempfile(path)`."""

    def spooled(*args: Any, **kwargs: Any) -> Any:
        return tempfile.SpooledTemporaryFile(max_size=1, dir=str(folder))

    return types.SimpleNamespace(SpooledTemporaryFile=spooled)


def small_filesystem_problem() -> str | None:
    """Why a SmallFilesystem cannot be made here (no unshare, user namespaces off);
    None if it can."""
    if shutil.which("unshare") is None:
        return "no `unshare` (util-linux) on this machine"
    try:
        SmallFilesystem(1 << 20).close()
    except OSError as exc:
        return str(exc)
    return None
