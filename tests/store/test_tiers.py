"""The local tier in front of a remote store: fills, LRU bound; gc of the store."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
from store_helpers import make_artifact, store_warnings

from kiln.artifact_store import Artifact, open_store

pytestmark = pytest.mark.usefixtures("store_key")


def key(i: int) -> str:
    return f"{i:064x}"


def sized(i: int, nbytes: int) -> Artifact:
    """An artifact of about `nbytes` whose blobs are its own (nothing shared)."""
    return Artifact(key(i), {"i": i}, {"kernel.bin": os.urandom(nbytes)})


def test_remote_hit_fills_local_tier(tmp_path: Path, s3_store: tuple[str, dict[str, Any]]) -> None:
    url, options = s3_store
    writer = open_store(url, storage_options=options, local_cache=False)
    artifact = make_artifact()
    assert writer.publish(artifact)

    cache = tmp_path / "cache"
    reader = open_store(url, storage_options=options, local_cache=cache)
    assert reader.get_manifest(artifact.key) == artifact.manifest  # no fill from a manifest
    assert not (cache / "ac").exists()
    assert reader.get(artifact.key) is not None
    assert (cache / "ac" / "aa" / artifact.key).exists()
    tiers = reader.stats()["tiers"]
    assert tiers["local"]["misses"] == 1 and tiers["remote"]["hits"] == 1
    assert tiers["local"]["bytes_written"] > artifact.nbytes

    fs, root = fsspec.core.url_to_fs(url, **options)
    fs.rm(root, recursive=True)  # the remote forgets it: the local tier still serves
    again = reader.get(artifact.key)
    assert again is not None and again.blobs == artifact.blobs
    assert reader.stats()["tiers"]["local"]["hits"] == 1


def test_default_local_tier_only_in_front_of_non_file_stores(clean_env: Path) -> None:
    assert open_store().cache is None  # the default store is on local disk already
    memory = open_store(f"memory://kiln-{uuid.uuid4().hex}")
    assert memory.cache is not None
    assert memory.cache.label == str(clean_env / "kiln" / "local")
    assert open_store(f"memory://kiln-{uuid.uuid4().hex}", local_cache="off").cache is None


def test_lru_eviction_keeps_local_tier_bounded(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    store = open_store(f"memory://kiln-{uuid.uuid4().hex}", local_cache=cache,
                       local_cache_max_bytes=100_000)
    assert store.cache is not None and store.cache.bound is not None
    store.cache.bound.grace_s = 0.0
    artifacts = [sized(i, 20_000) for i in range(4)]
    for i, artifact in enumerate(artifacts):
        assert store.publish(artifact)
        os.utime(cache / "ac" / key(i)[:2] / key(i), (1000 + i, 1000 + i))
    assert store.get(key(0)) is not None  # 0 becomes the most recently used
    for i in range(4, 8):
        assert store.publish(sized(i, 20_000))
        os.utime(cache / "ac" / key(i)[:2] / key(i), (2000 + i, 2000 + i))

    total = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file()
                and p.name != ".evict.lock")
    assert total <= 100_000
    present = {i for i in range(8) if (cache / "ac" / key(i)[:2] / key(i)).exists()}
    assert 0 in present  # used recently, so kept
    assert {1, 2} & present == set()  # least recently used went first
    assert 7 in present
    blobs = {p.name for p in (cache / "cas").rglob("*") if p.is_file()}
    assert len(blobs) == len(present)  # blobs of evicted artifacts went with them
    assert store.stats()["evictions"] >= 2
    for i in range(8):  # evicted or not, everything still comes from the remote
        got = store.get(key(i))
        assert got is not None and got.manifest == {"i": i}


def test_gc_by_age(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = open_store(root)
    shared = b"shared kernel" * 50
    for i in range(4):
        blobs = {"own.bin": f"own {i}".encode() * 40, "shared.bin": shared}
        assert store.publish(Artifact(key(i), {"i": i}, blobs))
    now = time.time()
    for i in range(4):  # 0 and 1 were published ten days ago
        age = 10 * 86400 if i < 2 else 60
        os.utime(root / "ac" / key(i)[:2] / key(i), (now - age, now - age))

    report = store.gc(max_age_s=7 * 86400, grace_s=0)["local"]
    assert report["manifests_deleted"] == 2 and report["blobs_deleted"] == 2
    assert report["manifests_kept"] == 2
    assert [store.get(key(i)) is not None for i in range(4)] == [False, False, True, True]
    assert store.get(key(3)).blobs["shared.bin"] == shared  # type: ignore[union-attr]


def test_gc_by_size_drops_oldest_first(backend: tuple[str, dict[str, Any]]) -> None:
    url, options = backend
    store = open_store(url, storage_options=options, local_cache=False)
    for i in range(5):
        assert store.publish(sized(i, 10_000))
        time.sleep(0.01)  # S3 keeps seconds: ties are broken by key, here in the same order
    before = store.gc(grace_s=0, dry_run=True)[store.primary.name]  # type: ignore[union-attr]
    assert before["manifests_deleted"] == 0 and before["bytes_before"] > 50_000
    report = store.gc(max_bytes=25_000, grace_s=0)[store.primary.name]  # type: ignore[union-attr]
    assert report["bytes_after"] <= 25_000
    assert report["manifests_deleted"] == 3 and report["blobs_deleted"] == 3
    assert [store.contains(key(i)) for i in range(5)] == [False, False, False, True, True]
    assert store.get(key(4)) is not None


def test_gc_sweeps_orphans_temps_and_quarantine(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = open_store(root)
    assert store.publish(make_artifact())
    orphan = root / "cas" / "ff" / ("f" * 64)
    orphan.parent.mkdir(parents=True)
    orphan.write_bytes(b"a publish that never wrote its manifest")
    temp = root / "ac" / "aa" / ("a" * 64 + ".tmp-123-abcd")
    temp.write_bytes(b"interrupted write")
    (root / "quarantine").mkdir()
    (root / "quarantine" / "20260101T000000-ac_aa_x").write_bytes(b"damaged")

    young = store.gc()["local"]  # all of it is younger than the default grace period
    assert young["blobs_deleted"] == young["temp_files_deleted"] == 0
    assert orphan.exists()
    report = store.gc(grace_s=0)["local"]
    assert report["blobs_deleted"] == 1 and report["temp_files_deleted"] == 1
    assert report["quarantine_deleted"] == 1 and report["manifests_deleted"] == 0
    assert not orphan.exists() and not temp.exists()
    assert store.get("a" * 64) is not None


def test_gc_removes_undecodable_manifests(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root = tmp_path / "store"
    store = open_store(root)
    assert store.publish(make_artifact())
    (root / "ac" / "aa" / ("a" * 64)).write_bytes(b"\xc1garbage")
    report = store.gc(grace_s=0)["local"]
    assert report["broken_manifests_deleted"] == 1 and report["blobs_deleted"] == 4
    assert not [p for p in (root / "cas").rglob("*") if p.is_file()]
    assert store_warnings(caplog) == []


def test_gc_keeps_every_blob_while_a_newer_manifest_is_present(tmp_path: Path) -> None:
    import msgpack

    root = tmp_path / "store"
    store = open_store(root)
    assert store.publish(make_artifact())
    assert store.publish(make_artifact(key="b" * 64, seed="b"))
    path = root / "ac" / "bb" / ("b" * 64)
    envelope = msgpack.unpackb(path.read_bytes())
    envelope["kiln_manifest"] = 2  # written by a newer Kiln: its references are unknown
    path.write_bytes(msgpack.packb(envelope))
    report = store.gc(max_age_s=0, grace_s=0)["local"]
    assert report["manifests_deleted"] == 1  # the old-format one, by age
    assert report["blobs_deleted"] == 0
    assert "newer" in report["blob_sweep"]
    assert path.exists()
