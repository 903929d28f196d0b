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

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def fault_kind(exc: BaseException) -> str:
    """Classify an exception raised by a backing file system."""
    if isinstance(exc, TimeoutError):
        return FAULT_TIMEOUT
    if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
        return FAULT_FULL
    if isinstance(exc, PermissionError):
        return FAULT_DENIED
    return FAULT_DOWN


def describe_exception(exc: BaseException) -> str:
    """One line naming the exception, for warnings."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    name = type(exc).__name__
    return f"{name}: {text}" if text else name
