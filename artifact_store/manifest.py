"""Manifests: the action-cache entry that names an artifact's blobs by digest.

On disk a manifest is a msgpack envelope around the exact bytes that were signed:

    {"kiln_manifest": 1, "body": <msgpack bytes>, "sig": None | {"alg", "kid", "value"}}
    body = {"format": 1, "key": <graph key>, "created": <unix time>,
            "blobs": {<name>: {"digest": <sha256 hex>, "size": <bytes>}},
            "meta": <the caller's metadata>}

Signing the body's bytes, not a re-encoding of them, keeps verification independent of
how msgpack orders or sizes things. The body names its key so that a signed manifest
copied under another key is refused.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgpack

from .artifact import check_blob_name, check_key
from .errors import IntegrityError, UnsupportedFormat
from .signing import Keyring, Signature

FORMAT_VERSION = 1
_TAG = "kiln_manifest"
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
MAX_BLOB_BYTES = 4 * 2**30  # no blob is read past this, whatever a manifest claims


@dataclass(frozen=True)
class BlobRef:
    """A blob as a manifest names it."""

    digest: str
    size: int


@dataclass(frozen=True)
class ManifestRecord:
    """A decoded manifest; `raw` is the envelope exactly as stored (copied between tiers
    byte for byte, so the writer's signature travels with it)."""

    key: str
    meta: dict[str, Any]
    blobs: dict[str, BlobRef]
    created: float
    signature: Signature | None
    body: bytes
    raw: bytes

    @property
    def nbytes(self) -> int:
        return sum(ref.size for ref in self.blobs.values())

    def digests(self) -> set[str]:
        return {ref.digest for ref in self.blobs.values()}

    def describe(self) -> dict[str, Any]:
        """Plain-dict view for `Store.describe` and the CLI."""
        return {
            "key": self.key,
            "meta": self.meta,
            "blobs": {n: {"digest": r.digest, "size": r.size} for n, r in self.blobs.items()},
            "bytes": self.nbytes,
            "created": self.created,
            "signature": (
                None if self.signature is None
                else {"alg": self.signature.alg, "kid": self.signature.kid}
            ),
        }


def encode_manifest(
    key: str,
    meta: Mapping[str, Any],
    blobs: Mapping[str, BlobRef],
    keyring: Keyring,
    *,
    created: float | None = None,
) -> ManifestRecord:
    """Build, sign (if the keyring can) and encode a manifest.

    ValueError if the metadata is not msgpack-able."""
    created = time.time() if created is None else created
    body_obj = {
        "format": FORMAT_VERSION,
        "key": key,
        "created": created,
        "blobs": {name: {"digest": r.digest, "size": r.size} for name, r in blobs.items()},
        "meta": dict(meta),
    }
    try:
        body = msgpack.packb(body_obj, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(
            f"artifact {key}: manifest metadata is not msgpack-able ({exc}); use dicts, "
            "lists, str, bytes, int, float, bool and None"
        ) from exc
    signature = keyring.sign(body)
    envelope = {
        _TAG: FORMAT_VERSION,
        "body": body,
        "sig": None if signature is None else signature.to_wire(),
    }
    raw = msgpack.packb(envelope, use_bin_type=True)
    return ManifestRecord(key, dict(meta), dict(blobs), created, signature, body, raw)


def decode_manifest(raw: bytes) -> ManifestRecord:
    """Decode and structurally validate a manifest (signatures are the caller's job).

    IntegrityError for bytes that are not a valid manifest; UnsupportedFormat for a
    manifest written by a newer format."""
    envelope = _unpack(raw, "manifest")
    if not isinstance(envelope, dict) or not isinstance(envelope.get(_TAG), int):
        raise IntegrityError("not a Kiln manifest")
    if envelope[_TAG] > FORMAT_VERSION:
        raise UnsupportedFormat(
            f"manifest format {envelope[_TAG]} is newer than this Kiln ({FORMAT_VERSION})"
        )
    body = envelope.get("body")
    if not isinstance(body, bytes):
        raise IntegrityError("manifest envelope has no body")
    signature = _decode_signature(envelope.get("sig"))
    obj = _unpack(body, "manifest body")
    if not isinstance(obj, dict):
        raise IntegrityError("manifest body is not a map")
    try:
        key = check_key(obj.get("key"))
        blobs = _decode_blobs(obj.get("blobs"))
    except ValueError as exc:
        raise IntegrityError(f"malformed manifest: {exc}") from exc
    meta = obj.get("meta")
    created = obj.get("created")
    if not isinstance(meta, dict) or not isinstance(created, (int, float)):
        raise IntegrityError("malformed manifest: meta or created missing")
    return ManifestRecord(key, meta, blobs, float(created), signature, body, bytes(raw))


def _unpack(data: bytes, what: str) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises many types on garbage
        raise IntegrityError(f"{what} is not valid msgpack ({type(exc).__name__})") from exc


def _decode_signature(obj: Any) -> Signature | None:
    if obj is None:
        return None
    if (
        isinstance(obj, dict)
        and isinstance(obj.get("alg"), str)
        and isinstance(obj.get("kid"), str)
        and isinstance(obj.get("value"), bytes)
    ):
        return Signature(obj["alg"], obj["kid"], obj["value"])
    raise IntegrityError("malformed manifest signature")


def _decode_blobs(obj: Any) -> dict[str, BlobRef]:
    if not isinstance(obj, dict):
        raise ValueError("blobs is not a map")
    blobs = {}
    for name, ref in obj.items():
        check_blob_name(name)
        if not isinstance(ref, dict):
            raise ValueError(f"blob {name!r} has no digest")
        digest, size = ref.get("digest"), ref.get("size")
        if not isinstance(digest, str) or not _DIGEST_RE.fullmatch(digest):
            raise ValueError(f"blob {name!r} has an invalid digest")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"blob {name!r} has an invalid size")
        if size > MAX_BLOB_BYTES:
            raise ValueError(f"blob {name!r} claims {size} bytes, more than the "
                             f"{MAX_BLOB_BYTES} a blob may hold")
        blobs[name] = BlobRef(digest, size)
    return blobs
