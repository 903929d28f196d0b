"""Fixtures of the store tests: a real S3 API server on loopback (moto in server mode,
spoken to over HTTP through s3fs), a clean KILN_* environment, a store per backend."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from store_helpers import BUCKET, moto_server, s3_options


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Endpoint URL of a moto S3 server on 127.0.0.1 with one bucket, for the session."""
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture
def s3_store(s3_server: str) -> tuple[str, dict[str, Any]]:
    """A fresh prefix in the test bucket, and the storage options to reach it."""
    return f"s3://{BUCKET}/{uuid.uuid4().hex}", s3_options(s3_server)


@pytest.fixture(params=["file", "memory", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[str, dict[str, Any]]:
    """(url, storage_options) of an empty store on each kind of file system."""
    if request.param == "file":
        return f"file://{tmp_path}/store", {}
    if request.param == "memory":
        return f"memory://kiln-{uuid.uuid4().hex}", {}
    return request.getfixturevalue("s3_store")  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No KILN_* from the developer's shell; the user cache directory under tmp_path."""
    for name in list(os.environ):
        if name.startswith("KILN_"):
            monkeypatch.delenv(name)
    cache = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    return cache


@pytest.fixture
def store_key(monkeypatch: pytest.MonkeyPatch) -> str:
    """A signing key in the environment: a store others can write (a bucket) is read
    only through signatures, so tests of other matters than trust sign what they publish."""
    key = "hmac:store-tests"
    monkeypatch.setenv("KILN_SIGNING_KEY", key)
    return key
