"""The store's disk fills up during a publish, on a real file system that runs out of
space (a small tmpfs, tests/smallfs.py): the publish fails with one warning naming the
store and the cause, no part of the new artifact becomes visible, the artifacts published
before still read and verify, and once space returns the next publish succeeds.

Two stores: a shared folder (file://, the kernel's ENOSPC), and the S3 API server (moto)
whose objects live on that disk (it answers the failed PUT with HTTP 500)."""

from __future__ import annotations

import hashlib
import random
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from store_helpers import moto_server, s3_options, store_warnings

from kiln.artifact_store import Artifact, Store, generate_ed25519_key, open_store
from kiln.artifact_store.signing import ed25519_available

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.smallfs import SmallFilesystem, moto_tempfile, small_filesystem_problem  # noqa: E402

pytestmark = pytest.mark.skipif(not ed25519_available(), reason="needs cryptography")
OLD, NEW = "a" * 64, "b" * 64
BUCKET = f"kiln-disk-full-{uuid.uuid4().hex[:8]}"  # moto's state is per process
COOLDOWN_S = 0.2


@pytest.fixture(scope="module")
def disk() -> Iterator[SmallFilesystem]:
    problem = small_filesystem_problem()
    if problem is not None:
        pytest.skip(f"no small file system to fill: {problem}")
    with SmallFilesystem(4 << 20) as fs:
        yield fs


@pytest.fixture(scope="module")
def keys() -> tuple[str, str]:
    return generate_ed25519_key()


def new_artifact() -> Artifact:
    """Four small blobs that sort (by digest, the order they are written in) before one
    of 512 KiB: with 64 KiB left, the publish writes blobs, then hits ENOSPC."""
    rng = random.Random(14)
    big = rng.randbytes(512 << 10)
    big_digest = hashlib.sha256(big).hexdigest()
    small: list[bytes] = []
    while len(small) < 4:
        data = rng.randbytes(4096)
        if hashlib.sha256(data).hexdigest() < big_digest:
            small.append(data)
    blobs = {f"kernel_{i}.so": data for i, data in enumerate(small)}
    blobs["wrapper.py"] = big
    return Artifact(key=NEW, manifest={"graph": "new"}, blobs=blobs)


def old_artifact() -> Artifact:
    rng = random.Random(1)
    return Artifact(key=OLD, manifest={"graph": "old"},
                    blobs={"wrapper.py": rng.randbytes(3000), "k.so": rng.randbytes(9000)})


def builder(url: str, private: str, **options: Any) -> Store:
    store = open_store(url, signing_key=private, local_cache=False, stats_file=False,
                       **options)
    assert store.primary is not None
    store.primary.health.cooldown_s = COOLDOWN_S
    return store


def reader(url: str, public: str, **options: Any) -> Store:
    return open_store(url, signing_key=public, require_signed=True, local_cache=False,
                      stats_file=False, read_only=True, **options)


def publish_into_full_disk(disk: SmallFilesystem, store: Store, fresh: Callable[[], Store],
                           caplog: pytest.LogCaptureFixture,
                           while_full: Callable[[], None] = lambda: None) -> list[str]:
    """The common part: an old artifact, the disk filled, the new one refused; the old
    one still read; space back, the new one published. The warnings, for the caller."""
    assert store.publish(old_artifact())
    disk.fill(leave=64 << 10)
    try:
        assert store.publish(new_artifact()) is False
        assert store.publish(new_artifact()) is False  # skipped: no second warning
        warnings = store_warnings(caplog)
        assert fresh().get(NEW) is None and NEW not in fresh().keys()
        old = fresh().get(OLD)  # published before: read and verified, disk full or not
        assert old is not None and old.blobs == old_artifact().blobs
        assert store.get(OLD) is not None  # the builder's reads go on too
        while_full()
    finally:
        disk.free()
    time.sleep(COOLDOWN_S * 2)
    assert store.publish(new_artifact()) is True
    got = fresh().get(NEW)
    assert got is not None and got.blobs == new_artifact().blobs
    return warnings


def test_shared_folder_fills_during_a_publish(disk: SmallFilesystem, keys: tuple[str, str],
                                              caplog: pytest.LogCaptureFixture) -> None:
    private, public = keys
    root = disk.path / "store"
    url = f"file://{root}"
    store = builder(url, private)

    def cut_short() -> None:
        # The publish wrote the four small blobs and failed on the big one: no manifest,
        # so nothing of it is visible; and no temporary file is left behind.
        assert len(blobs()) == 2 + 4 and not list(root.rglob("*.tmp-*"))

    def blobs() -> list[Path]:
        return [p for p in (root / "cas").rglob("*") if p.is_file()]

    warnings = publish_into_full_disk(disk, store, lambda: reader(url, public), caplog,
                                      cut_short)
    assert len(warnings) == 1, warnings
    assert f"{root} is full" in warnings[0] and "No space left on device" in warnings[0]
    assert store.stats()["tiers"][store.primary.name]["errors"] == {"full": 1}
    assert len(blobs()) == 2 + 5 and not list(root.rglob("*.tmp-*"))


@pytest.fixture
def s3_on_disk(disk: SmallFilesystem, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A moto S3 server on loopback whose objects are files on `disk`."""
    import moto.s3.models as moto_models

    monkeypatch.setattr(moto_models, "tempfile", moto_tempfile(disk.path))
    with moto_server(BUCKET) as endpoint:
        yield endpoint


def test_s3_server_disk_fills_during_a_publish(s3_on_disk: str, disk: SmallFilesystem,
                                               keys: tuple[str, str],
                                               caplog: pytest.LogCaptureFixture) -> None:
    private, public = keys
    url, options = f"s3://{BUCKET}/disk-full", s3_options(s3_on_disk)
    store = builder(url, private, storage_options=options)
    warnings = publish_into_full_disk(
        disk, store, lambda: reader(url, public, storage_options=options), caplog)
    assert len(warnings) == 1, warnings
    assert f"{url} rejected a write" in warnings[0] and "Internal Server Error" in warnings[0]
    assert "lookups go on" in warnings[0]
    assert store.stats()["tiers"][store.primary.name]["errors"] == {"rejected": 1}
