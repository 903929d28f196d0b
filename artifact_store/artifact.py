"""The unit the store holds: an artifact is a graph key, caller metadata and named blobs."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_KEY_RE = re.compile(r"[A-Za-z0-9_-]{2,256}")
_MAX_NAME_LEN = 1024


@dataclass(frozen=True)
class Artifact:
    """A compiled graph as the store sees it.

    `key` is the graph key (sha256 hex from the frontend's named parts). `manifest` is
    the caller's msgpack-able metadata (target, versions, kernels, stage timings); it comes
    back from `get` as msgpack gives it (tuples as lists). `blobs` maps a logical name
    ("wrapper.py", "kernels/triton_poi_fused_add_0.cubin") to its bytes.
    """

    key: str
    manifest: dict[str, Any]
    blobs: dict[str, bytes]

    @property
    def nbytes(self) -> int:
        return sum(len(data) for data in self.blobs.values())


def check_key(key: object) -> str:
    """The key if it is safe as a path component; ValueError otherwise."""
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(
            f"invalid artifact key {key!r}: expected 2 to 256 characters of [A-Za-z0-9_-] "
            "(the frontend's keys are sha256 hex)"
        )
    return key


def check_blob_name(name: object) -> str:
    """A blob's logical name, refused if a loader writing it under a folder could escape it."""
    if not isinstance(name, str) or not name or len(name) > _MAX_NAME_LEN:
        raise ValueError(f"invalid blob name {name!r}: expected a non-empty string")
    parts = name.split("/")
    if (
        name.startswith("/")
        or "\\" in name
        or "\x00" in name
        or any(part in ("", ".", "..") for part in parts)
    ):
        raise ValueError(
            f"invalid blob name {name!r}: use a relative path of plain components "
            "such as 'kernels/triton_poi_fused_add_0.cubin'"
        )
    return name
