"""Roles and attacks on a shared store (issue 14), on the real S3 API server: a writer
of the bucket forging an unsigned manifest, a client that holds only the public key, the
warning an unsigned shared store gives, and gc racing a publish that reuses a blob."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any

import pytest
from store_helpers import make_artifact

from kiln.artifact_store import Artifact, generate_ed25519_key, open_store
from kiln.artifact_store import factory as store_factory
from kiln.artifact_store.gc import collect
from kiln.artifact_store.signing import ed25519_available

needs_ed25519 = pytest.mark.skipif(not ed25519_available(), reason="needs cryptography")
TRUST_LOGGER = "kiln.trust"
KEY = "f" * 64


def forged(artifact: Artifact) -> Artifact:
    """The same key and manifest with the wrapper swapped for the attacker's."""
    blobs = dict(artifact.blobs, **{"wrapper.py": b"import os\nos.system('id')\n"})
    return Artifact(artifact.key, artifact.manifest, blobs)


@needs_ed25519
def test_forged_unsigned_manifest_is_refused_by_a_fleet_client(
        s3_store: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture) -> None:
    url, options = s3_store
    private, public = generate_ed25519_key()
    builder = open_store(url, storage_options=options, signing_key=private,
                         local_cache=False, stats_file=False)
    assert builder.can_publish and builder.publish(make_artifact(KEY))
    # Anyone with write access to the bucket: no key, so an unsigned manifest.
    attacker = open_store(url, storage_options=options, local_cache=False, stats_file=False)
    assert attacker.publish(forged(make_artifact(KEY)))

    client = open_store(url, storage_options=options, signing_key=public,
                        local_cache=False, stats_file=False)
    assert client.require_signed and not client.can_publish
    assert client.get(KEY) is None
    assert "it is unsigned and signatures are required" in caplog.text
    # The builder's own (signed) republish is accepted again.
    assert builder.publish(make_artifact(KEY))
    got = client.get(KEY)
    assert got is not None and got.blobs == make_artifact(KEY).blobs


def test_unsigned_shared_store_warns_once_per_process(
        s3_store: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    url, options = s3_store
    monkeypatch.setattr(store_factory, "_warned_unsigned", set())
    with caplog.at_level(logging.WARNING, logger=TRUST_LOGGER):
        for _ in range(3):
            store = open_store(url, storage_options=options, local_cache=False,
                               stats_file=False)
    loud = [r.getMessage() for r in caplog.records if r.name == TRUST_LOGGER]
    assert len(loud) == 1
    assert "no KILN_SIGNING_KEY" in loud[0] and "run their code" in loud[0]
    assert "KILN_REQUIRE_SIGNED=1" in loud[0]
    assert store.can_publish  # unsigned: no roles to tell apart, as the warning says


def test_private_stores_do_not_warn_a_shared_folder_does(
        monkeypatch: pytest.MonkeyPatch, clean_env: Any, tmp_path: Any,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(store_factory, "_warned_unsigned", set())
    with caplog.at_level(logging.WARNING, logger=TRUST_LOGGER):
        default = open_store(stats_file=False)  # under the user's own cache
        open_store("memory://kiln-private", stats_file=False)
        open_store(tmp_path / "mine", stats_file=False)  # a folder only this user writes
    assert not [r for r in caplog.records if r.name == TRUST_LOGGER]
    assert default.can_publish
    shared = tmp_path / "team"
    shared.mkdir()
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING, logger=TRUST_LOGGER):
        open_store(shared, stats_file=False)
    assert len([r for r in caplog.records if r.name == TRUST_LOGGER]) == 1


@needs_ed25519
def test_fleet_setting_refuses_unsigned_even_without_a_key(
        s3_store: tuple[str, dict[str, Any]]) -> None:
    url, options = s3_store
    open_store(url, storage_options=options, local_cache=False,
               stats_file=False).publish(make_artifact(KEY))
    fleet = open_store(url, storage_options=options, local_cache=False, stats_file=False,
                       require_signed=True)
    assert fleet.get(KEY) is None and not fleet.can_publish


def test_gc_spares_a_blob_that_a_publish_during_the_pass_reuses(
        s3_store: tuple[str, dict[str, Any]]) -> None:
    """gc reads the manifests, a publish reuses an old artifact's big blob (found
    present, not rewritten), then gc deletes the old artifact and its blobs: the fresh
    artifact was left naming a deleted blob, and was quarantined as damaged."""
    url, options = s3_store
    store = open_store(url, storage_options=options, local_cache=False, stats_file=False,
                       signing_key="hmac:gc-tests")
    shared = bytes(range(256)) * 1024  # 256 KiB: a remote publish skips it when present
    old = make_artifact("a" * 64, kernels=1)
    old = Artifact(old.key, old.manifest, dict(old.blobs, **{"kernels/big.cubin": shared}))
    new = make_artifact("b" * 64, kernels=1, seed="new")
    new = Artifact(new.key, new.manifest, dict(new.blobs, **{"kernels/big.cubin": shared}))
    assert store.publish(old)
    tier = store.primary
    assert tier is not None
    read_many = tier.read_many
    published = threading.Event()

    def read_then_publish(paths: list[str]) -> list[bytes | None]:
        found = read_many(paths)
        if not published.is_set():  # once: the pass has read the manifests
            published.set()
            assert store.publish(new)
        return found

    tier.read_many = read_then_publish  # type: ignore[method-assign]
    # Everything already there is "older than max_age" for this pass.
    report = collect(tier, max_age_s=0.0, grace_s=0.0, now=time.time() + 5.0)
    tier.read_many = read_many  # type: ignore[method-assign]
    assert published.is_set() and report["manifests_deleted"] >= 1
    got = store.get(new.key)
    assert got is not None and got.blobs == new.blobs
    assert store.stats()["integrity_failures"] == 0


def test_publisher_writes_back_a_reused_blob_collected_under_it(
        s3_store: tuple[str, dict[str, Any]]) -> None:
    """The other order: gc deletes the blob after the publish found it present but
    before the manifest is written. The publisher checks, and writes it back."""
    url, options = s3_store
    store = open_store(url, storage_options=options, local_cache=False, stats_file=False,
                       signing_key="hmac:gc-tests")
    shared = bytes(range(256)) * 1024
    first = make_artifact("c" * 64, kernels=1)
    first = Artifact(first.key, first.manifest, dict(first.blobs, **{"k/big.cubin": shared}))
    assert store.publish(first)
    tier = store.primary
    assert tier is not None
    blob_path = tier.io.blob_path(hashlib.sha256(shared).hexdigest())
    write = tier.io.write

    def write_after_gc(path: str, data: bytes) -> None:
        if "/ac/" in path:  # the manifest: gc struck just before it
            tier.io.remove(blob_path)
        write(path, data)

    tier.io.write = write_after_gc  # type: ignore[method-assign]
    second = make_artifact("d" * 64, kernels=1, seed="second")
    second = Artifact(second.key, second.manifest,
                      dict(second.blobs, **{"k/big.cubin": shared}))
    try:
        assert store.publish(second)
    finally:
        tier.io.write = write  # type: ignore[method-assign]
    got = store.get(second.key)
    assert got is not None and got.blobs == second.blobs
