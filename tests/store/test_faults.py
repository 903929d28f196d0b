"""A store that is down, slow or full: a miss or False, one warning, never an exception;
the local tier keeps serving."""

from __future__ import annotations

import errno
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from store_helpers import free_port, make_artifact, s3_options, store_warnings

from kiln.artifact_store import open_store

KEY = "a" * 64


class FullFileSystem(LocalFileSystem):
    """A local disk with no space left: reads work, every write fails with ENOSPC."""

    protocol = ("fullfs",)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        if any(flag in mode for flag in "wax+"):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        return super()._open(path, mode, **kwargs)


class FlakyFileSystem(MemoryFileSystem):
    """In-memory store whose operations fail while `broken` is set; `fail_writes_after`
    lets that many writes through, then fails the rest."""

    protocol = ("flakyfs",)
    broken = False
    fail_writes_after: int | None = None
    writes = 0

    def cat_file(self, path: str, start: Any = None, end: Any = None, **kwargs: Any) -> bytes:
        if type(self).broken:
            raise ConnectionError("flaky: connection reset by peer")
        return super().cat_file(path, start, end, **kwargs)  # type: ignore[no-any-return]

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        cls = type(self)
        cls.writes += 1
        if cls.broken or (cls.fail_writes_after is not None and cls.writes > cls.fail_writes_after):
            raise ConnectionError("flaky: connection reset by peer")
        super().pipe_file(path, value, mode, **kwargs)


fsspec.register_implementation("fullfs", FullFileSystem, clobber=True)
fsspec.register_implementation("flakyfs", FlakyFileSystem, clobber=True)


@pytest.fixture
def flaky() -> Iterator[type[FlakyFileSystem]]:
    FlakyFileSystem.broken = False
    FlakyFileSystem.fail_writes_after = None
    FlakyFileSystem.writes = 0
    yield FlakyFileSystem
    FlakyFileSystem.broken = False
    FlakyFileSystem.fail_writes_after = None


@pytest.fixture
def black_hole() -> Iterator[str]:
    """An endpoint that accepts connections and never answers (a hung server)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join()
    for conn in held:
        conn.close()
    listener.close()


def _seeded_cache(path: Path) -> None:
    """A local tier that already holds the artifact (as after an earlier remote hit)."""
    assert open_store(path).publish(make_artifact())


def test_remote_down_degrades_to_local_tier(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    _seeded_cache(cache)
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    store = open_store(f"s3://bucket/{uuid.uuid4().hex}", storage_options=s3_options(closed),
                       local_cache=cache, timeout=3.0)
    start = time.monotonic()
    assert store.get("b" * 64) is None  # local miss, remote down: a miss
    got = store.get(KEY)
    assert got is not None and got.blobs == make_artifact().blobs  # local tier serves
    assert store.publish(make_artifact(key="c" * 64)) is False  # the store did not get it
    assert store.get("c" * 64) is not None  # but this machine keeps it
    assert store.get("d" * 64) is None
    assert time.monotonic() - start < 5.0  # one timeout at most, then the circuit is open
    warnings = store_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "unreachable" in warnings[0] and "local cache" in warnings[0]
    assert sum(store.stats()["tiers"]["remote"]["errors"].values()) == 1


def test_remote_down_without_local_tier_is_a_miss(caplog: pytest.LogCaptureFixture) -> None:
    closed = f"http://127.0.0.1:{free_port()}"
    store = open_store(f"s3://bucket/{uuid.uuid4().hex}", storage_options=s3_options(closed),
                       local_cache=False, timeout=3.0)
    assert store.get(KEY) is None
    assert store.get_manifest(KEY) is None
    assert store.publish(make_artifact()) is False
    assert store.gc(max_age_s=0)["remote"].get("error")
    warnings = store_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "lookups miss and graphs compile locally" in warnings[0]


def test_remote_that_hangs_times_out(
    tmp_path: Path, black_hole: str, caplog: pytest.LogCaptureFixture
) -> None:
    cache = tmp_path / "cache"
    _seeded_cache(cache)
    store = open_store(f"s3://bucket/{uuid.uuid4().hex}", storage_options=s3_options(black_hole),
                       local_cache=cache, timeout=0.5)
    start = time.monotonic()
    assert store.get("b" * 64) is None
    assert time.monotonic() - start < 3.0
    assert store.get(KEY) is not None
    assert store.get("b" * 64) is None
    warnings = store_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "did not answer within 0.5 s" in warnings[0]
    assert store.stats()["tiers"]["remote"]["errors"] == {"timeout": 1}


def test_full_store_refuses_publish_and_still_serves(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    remote = tmp_path / "remote"
    assert open_store(remote).publish(make_artifact())  # written before the disk filled
    store = open_store(f"fullfs://{remote}", local_cache=tmp_path / "cache")
    assert store.publish(make_artifact(key="b" * 64)) is False
    assert store.publish(make_artifact(key="c" * 64)) is False
    warnings = store_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert "is full" in warnings[0] and "No space left" in warnings[0]
    assert store.get("b" * 64) is not None  # the local tier kept what could not be shared
    assert store.get(KEY) is not None  # old artifacts still read from the full store
    assert store.stats()["tiers"]["remote"]["errors"] == {"full": 1}
    assert not list(remote.rglob("*.tmp-*"))


def test_full_local_tier_does_not_block_the_store(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    url = f"memory://kiln-{uuid.uuid4().hex}"
    store = open_store(url, local_cache=f"fullfs://{tmp_path}/cache")
    assert store.publish(make_artifact()) is True
    got = store.get(KEY)  # the remote hit cannot fill the local tier: still a hit
    assert got is not None and got.blobs == make_artifact().blobs
    warnings = store_warnings(caplog)
    assert len(warnings) == 1 and "is full" in warnings[0]


def test_each_outage_is_reported_once_and_recovery_noticed(
    flaky: type[FlakyFileSystem], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="kiln.artifact_store")
    store = open_store(f"flakyfs://kiln-{uuid.uuid4().hex}", local_cache=False)
    assert store.primary is not None
    store.primary.health.cooldown_s = 0.05
    assert store.publish(make_artifact())
    flaky.broken = True
    for _ in range(5):
        assert store.get(KEY) is None
        time.sleep(0.06)
    assert len(store_warnings(caplog)) == 1
    flaky.broken = False
    time.sleep(0.06)
    assert store.get(KEY) is not None
    assert any("works again" in r.getMessage() for r in caplog.records)
    flaky.broken = True
    assert store.get(KEY) is None
    assert len(store_warnings(caplog)) == 2  # a new outage, a new warning


def test_failed_publish_never_leaves_a_manifest(
    flaky: type[FlakyFileSystem], caplog: pytest.LogCaptureFixture
) -> None:
    url = f"flakyfs://kiln-{uuid.uuid4().hex}"
    store = open_store(url, local_cache=False)
    flaky.fail_writes_after = 2  # two of four blobs land, then the connection drops
    assert store.publish(make_artifact(kernels=3)) is False
    assert flaky.writes == 3
    fs, root = fsspec.core.url_to_fs(url)
    assert not fs.exists(f"{root}/ac/aa/{KEY}")
    flaky.fail_writes_after = None
    reader = open_store(url, local_cache=False)
    assert reader.get(KEY) is None  # a plain miss: nothing damaged is visible
    assert len(store_warnings(caplog)) == 1


def test_unexpected_errors_never_reach_the_caller(
    flaky: type[FlakyFileSystem], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = open_store(f"flakyfs://kiln-{uuid.uuid4().hex}", local_cache=False)
    assert store.publish(make_artifact())

    def explode(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a bug deep inside")

    monkeypatch.setattr("kiln.artifact_store.store.decode_manifest", explode)
    monkeypatch.setattr("kiln.artifact_store.store.encode_manifest", explode)
    assert store.get(KEY) is None
    assert store.get_manifest(KEY) is None
    assert store.publish(make_artifact(key="b" * 64)) is False
    assert store_warnings(caplog)


def test_misconfiguration_disables_the_store_without_raising(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KILN_SIGNING_KEY", "ed25519:not-a-key")
    store = open_store()
    assert store.disabled_reason and "Ed25519" in store.disabled_reason
    assert store.get(KEY) is None and store.publish(make_artifact()) is False
    assert "disabled" in store_warnings(caplog)[0]
    monkeypatch.setenv("KILN_SIGNING_KEY", "hmac:ok")
    monkeypatch.setenv("KILN_LOCAL_CACHE_SIZE", "lots")
    assert open_store().disabled_reason
    store = open_store("nosuchprotocol://x/y")
    assert store.get(KEY) is None and store.publish(make_artifact()) is False
