"""Publish and read back on every backend; the layout on disk; refusals of bad input."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import fsspec
import msgpack
import pytest
from store_helpers import make_artifact, store_warnings

from kiln.artifact_store import Artifact, open_store

pytestmark = pytest.mark.usefixtures("store_key")


def test_publish_get_round_trip(backend: tuple[str, dict[str, Any]]) -> None:
    url, options = backend
    store = open_store(url, storage_options=options, local_cache=False)
    artifact = make_artifact(kernels=4)
    assert store.get(artifact.key) is None
    assert not store.contains(artifact.key)
    assert store.publish(artifact) is True
    got = store.get(artifact.key)
    assert got is not None
    assert got.key == artifact.key
    assert got.blobs == artifact.blobs
    assert got.manifest == artifact.manifest
    assert store.contains(artifact.key)
    assert store.get_manifest(artifact.key) == artifact.manifest
    described = store.describe(artifact.key)
    assert described is not None
    assert described["meta"] == artifact.manifest
    assert set(described["blobs"]) == set(artifact.blobs)


def test_layout_names_blobs_by_digest(tmp_path: Path) -> None:
    """cas/<sha[:2]>/<sha> for blobs, ac/<key[:2]>/<key> for a msgpack manifest that names
    the blobs by digest and size beside the caller's metadata."""
    root = tmp_path / "store"
    store = open_store(f"file://{root}", signing_key="hmac:farm-secret")
    artifact = make_artifact(key="cd" * 32, kernels=2)
    assert store.publish(artifact)
    for name, data in artifact.blobs.items():
        digest = hashlib.sha256(data).hexdigest()
        assert (root / "cas" / digest[:2] / digest).read_bytes() == data, name
    raw = (root / "ac" / "cd" / artifact.key).read_bytes()
    envelope = msgpack.unpackb(raw)
    body = msgpack.unpackb(envelope["body"])
    assert body["key"] == artifact.key
    assert body["meta"] == artifact.manifest
    assert body["blobs"]["wrapper.py"] == {
        "digest": hashlib.sha256(artifact.blobs["wrapper.py"]).hexdigest(),
        "size": len(artifact.blobs["wrapper.py"]),
    }
    assert envelope["sig"]["alg"] == "hmac-sha256"
    assert not list(root.rglob("*.tmp-*")), "temporary files left behind"


def test_identical_blobs_are_stored_once(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = open_store(f"file://{root}")
    shared = b"identical kernel across layers" * 100
    for i in range(3):
        key = f"{i:02d}" * 32
        blobs = {"wrapper.py": key.encode(), "kernels/a.cubin": shared, "kernels/b.cubin": shared}
        assert store.publish(Artifact(key, {"i": i}, blobs))
    assert len(list((root / "cas").rglob("*"))) - len(list((root / "cas").glob("*"))) == 4
    for i in range(3):
        got = store.get(f"{i:02d}" * 32)
        assert got is not None and got.blobs["kernels/b.cubin"] == shared


def test_republish_replaces_manifest(backend: tuple[str, dict[str, Any]]) -> None:
    url, options = backend
    store = open_store(url, storage_options=options, local_cache=False)
    assert store.publish(make_artifact(seed="first"))
    assert store.publish(make_artifact(seed="second"))
    got = store.get("a" * 64)
    assert got is not None and got.manifest["seed"] == "second"
    assert got.blobs == make_artifact(seed="second").blobs


def test_large_and_empty_blobs(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")  # a plain path works as well as file://
    big = bytes(range(256)) * (3 * 2**20 // 256)
    artifact = Artifact("e" * 64, {}, {"big.bin": big, "empty": b""})
    assert store.publish(artifact)
    got = store.get(artifact.key)
    assert got is not None and got.blobs == {"big.bin": big, "empty": b""}
    assert store.publish(Artifact("f" * 64, {"only": "metadata"}, {}))
    assert store.get("f" * 64) == Artifact("f" * 64, {"only": "metadata"}, {})


@pytest.mark.parametrize(
    "artifact, reason",
    [
        (Artifact("../../etc", {}, {}), "invalid artifact key"),
        (Artifact("ab" * 32, {}, {"../escape.py": b"x"}), "invalid blob name"),
        (Artifact("ab" * 32, {}, {"/abs.py": b"x"}), "invalid blob name"),
        (Artifact("ab" * 32, {}, {"k": "not bytes"}), "not bytes"),  # type: ignore[dict-item]
        (Artifact("ab" * 32, {"f": object()}, {}), "not msgpack-able"),
    ],
)
def test_invalid_artifacts_are_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, artifact: Artifact, reason: str
) -> None:
    store = open_store(tmp_path / "store")
    assert store.publish(artifact) is False
    warnings = store_warnings(caplog)
    assert len(warnings) == 1 and reason in warnings[0]
    assert not (tmp_path / "store" / "ac").exists()


def test_invalid_key_lookup_is_a_miss(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = open_store(tmp_path / "store")
    assert store.get("../../../etc/passwd") is None
    assert store.get_manifest("a/b") is None
    assert len(store_warnings(caplog)) == 2


def test_read_only_client_never_writes(tmp_path: Path) -> None:
    root = tmp_path / "store"
    writer = open_store(root)
    assert writer.publish(make_artifact())
    reader = open_store(root, read_only=True)
    assert reader.get("a" * 64) is not None
    before = sorted(p.relative_to(root) for p in root.rglob("*"))
    assert reader.publish(make_artifact(key="b" * 64)) is False
    assert reader.gc(max_age_s=0, grace_s=0)["local"] == {"skipped": "read-only client"}
    assert sorted(p.relative_to(root) for p in root.rglob("*")) == before


def test_read_only_client_fills_only_its_local_tier(
    tmp_path: Path, s3_store: tuple[str, dict[str, Any]]
) -> None:
    url, options = s3_store
    assert open_store(url, storage_options=options, local_cache=False).publish(make_artifact())
    fs, path = fsspec.core.url_to_fs(url, **options)
    remote_before = sorted(fs.find(path))
    reader = open_store(url, storage_options=options, local_cache=tmp_path / "cache",
                        read_only=True)
    assert reader.get("a" * 64) is not None
    assert (tmp_path / "cache" / "ac" / "aa" / ("a" * 64)).exists()
    fs.invalidate_cache()
    assert sorted(fs.find(path)) == remote_before
