"""Errors of the artifact store, and how a failure of a backing store is classified.

None of these escape `Store`'s public methods: a fault becomes a miss (`get` returns None)
or a refusal (`publish` returns False) with one warning. They exist so the layers below
the store can say precisely what went wrong, and so `StoreConfig.resolve` can refuse a
configuration it cannot honour (the CLI shows that message as is).
"""

from __future__ import annotations

import errno


class StoreError(Exception):
    """Base class of artifact store errors."""


class ConfigError(StoreError, ValueError):
    """A setting (argument or KILN_* variable) that the store cannot honour."""


class IntegrityError(StoreError):
    """Stored bytes that do not match what the manifest promises: missing, corrupt,
    undecodable, or a manifest stored under another key."""

    def __init__(self, message: str, *, missing: tuple[str, ...] = (),
                 corrupt: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.missing = missing
        self.corrupt = corrupt


class UnsupportedFormat(StoreError):
    """A well-formed manifest written by a newer Kiln: a miss, but never quarantined."""


# Kinds of fault of a backing store, as reported in warnings and counted in stats.
FAULT_DOWN = "down"
FAULT_TIMEOUT = "timeout"
FAULT_FULL = "full"
FAULT_DENIED = "denied"
FAULT_REJECTED = "rejected"  # a write the server answered with an error of its own

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
# What S3-compatible servers answer when their disks or quotas are full (HTTP 507 is
# "Insufficient Storage"; MinIO, Ceph and others name it in the error code).
_FULL_STATUS = 507
_FULL_CODES = {"XMinioStorageFull", "InsufficientStorage", "InsufficientCapacity",
               "QuotaExceeded", "XMinioAdminBucketQuotaExceeded", "StorageFull"}


def server_answer(exc: BaseException) -> tuple[int, str] | None:
    """(HTTP status, error code) when `exc`, or an exception it was raised from, carries
    an error response of an object store's server (botocore's ClientError keeps it in
    `.response`; s3fs re-raises it as an OSError caused by it); None otherwise."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        response = getattr(current, "response", None)
        if isinstance(response, dict):
            meta = response.get("ResponseMetadata") or {}
            error = response.get("Error") or {}
            status = meta.get("HTTPStatusCode") if isinstance(meta, dict) else None
            code = error.get("Code") if isinstance(error, dict) else None
            if isinstance(status, int):
                return status, str(code or "")
        current = current.__cause__ or current.__context__
    return None


def fault_kind(exc: BaseException, op: str = "read") -> str:
    """Classify an exception raised by a backing file system during `op` ("read" or
    "write"). A write that the server answered with an error of its own (not a
    permission, not a full disk it names) is "rejected": the server is up and may
    still serve reads."""
    if isinstance(exc, TimeoutError):
        return FAULT_TIMEOUT
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
        return FAULT_FULL
    if isinstance(exc, PermissionError):
        return FAULT_DENIED
    answer = server_answer(exc)
    if answer is not None:
        status, code = answer
        if status == _FULL_STATUS or code in _FULL_CODES:
            return FAULT_FULL
        if status == 403:
            return FAULT_DENIED
        if op == "write" and status >= 400:
            return FAULT_REJECTED
    return FAULT_DOWN


def describe_exception(exc: BaseException) -> str:
    """One line naming the exception, for warnings."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    name = type(exc).__name__
    return f"{name}: {text}" if text else name
