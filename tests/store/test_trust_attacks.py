"""Issue 33's attacks on the store, each performed as an attacker would: a second user
is modelled by the mode bits that would let them write (the tests run as one user), and
what they write is an artifact whose wrapper would run their code. Each is refused now,
with one message naming the store and the reason, and the honest path still works."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
from store_helpers import make_artifact

from kiln.artifact_store import Artifact, generate_ed25519_key, open_store, trust
from kiln.artifact_store import factory as store_factory
from kiln.artifact_store.signing import ed25519_available

KEY = "e" * 64
EVIL = b"import os\nos.system('touch /tmp/kiln-pwned')\n"
TRUST_LOGGER = "kiln.trust"


def planted() -> Artifact:
    artifact = make_artifact(KEY)
    return Artifact(KEY, artifact.manifest, dict(artifact.blobs, **{"wrapper.py": EVIL}))


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_factory, "_warned_unsigned", set())
    monkeypatch.setattr(trust, "_warned_trust_unsigned", False)


def new_process(caplog: pytest.LogCaptureFixture) -> None:
    """Forget the warnings this process gave (the victim is another process)."""
    store_factory._warned_unsigned.clear()
    caplog.clear()


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_row1_group_writable_store_is_refused_by_default(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    team = tmp_path / "team-store"
    team.mkdir()
    team.chmod(0o775)  # the team's group may write it: any member plants artifacts
    assert open_store(team, stats_file=False).publish(planted())  # the attacker
    new_process(caplog)
    with caplog.at_level(logging.WARNING):
        victim = open_store(team, stats_file=False)  # default settings: no key
        outcome = victim.lookup(KEY)
        assert victim.get(KEY) is None
    assert outcome.status == "refused" and "writable by its group" in outcome.problems[0][1]
    said = messages(caplog)
    assert len(said) == 1, said
    assert str(team) in said[0] and "writable by its group" in said[0]
    assert "refused" in said[0]


def test_row1_unsigned_bucket_is_refused_by_default(
        s3_store: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture) -> None:
    url, options = s3_store
    assert open_store(url, storage_options=options, local_cache=False,
                      stats_file=False).publish(planted())
    new_process(caplog)
    with caplog.at_level(logging.WARNING):
        victim = open_store(url, storage_options=options, local_cache=False,
                            stats_file=False)
        assert victim.get(KEY) is None
    said = messages(caplog)
    assert len(said) == 1 and "remote store" in said[0] and url in said[0]


def test_row1_trust_unsigned_accepts_with_a_warning_at_start(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    team = tmp_path / "team-store"
    team.mkdir()
    team.chmod(0o777)
    honest = make_artifact(KEY)
    assert open_store(team, stats_file=False).publish(honest)
    monkeypatch.setenv("KILN_TRUST_UNSIGNED", "1")
    new_process(caplog)
    with caplog.at_level(logging.WARNING, logger=TRUST_LOGGER):
        got = open_store(team, stats_file=False).get(KEY)
    assert got is not None and got.blobs == honest.blobs
    loud = [m for m in messages(caplog) if "KILN_TRUST_UNSIGNED=1" in m]
    assert len(loud) == 1 and "run their code" in loud[0]


def test_row1_private_folder_store_still_works_unsigned(tmp_path: Path) -> None:
    mine = tmp_path / "mine"
    honest = make_artifact(KEY)
    assert open_store(mine, stats_file=False).publish(honest)
    got = open_store(mine, stats_file=False).get(KEY)
    assert got is not None and got.blobs == honest.blobs


def test_row1_group_writable_subfolder_is_refused(tmp_path: Path) -> None:
    """Only the store's root was checked: a writable ac/<xx>/ let others plant."""
    store = tmp_path / "mine"
    assert open_store(store, stats_file=False).publish(planted())
    (store / "ac" / KEY[:2]).chmod(0o777)
    assert open_store(store, stats_file=False).get(KEY) is None


def test_row2_group_writable_cache_root_is_not_private(
        clean_env: Path, caplog: pytest.LogCaptureFixture) -> None:
    clean_env.mkdir(parents=True, exist_ok=True)
    clean_env.chmod(0o770)  # XDG_CACHE_HOME: its group may write it
    assert open_store(stats_file=False).publish(planted())  # <cache>/kiln/store
    new_process(caplog)
    with caplog.at_level(logging.WARNING):
        victim = open_store(stats_file=False)
        assert victim.get(KEY) is None
    said = messages(caplog)
    assert len(said) == 1 and str(clean_env) in said[0] and "writable" in said[0]


@pytest.mark.skipif(not ed25519_available(), reason="needs cryptography")
def test_row6_public_key_not_required_stripped_signature_is_refused(
        s3_store: tuple[str, dict[str, Any]], caplog: pytest.LogCaptureFixture) -> None:
    url, options = s3_store
    private, public = generate_ed25519_key()
    builder = open_store(url, storage_options=options, signing_key=private,
                         local_cache=False, stats_file=False)
    assert builder.publish(make_artifact(KEY))
    # The attacker replaces it with an unsigned manifest naming their wrapper.
    assert open_store(url, storage_options=options, local_cache=False,
                      stats_file=False).publish(planted())
    new_process(caplog)
    with caplog.at_level(logging.WARNING):
        client = open_store(url, storage_options=options, signing_key=public,
                            require_signed=False, local_cache=False, stats_file=False)
        assert client.get(KEY) is None
    said = messages(caplog)
    assert said and all(url in m for m in said)
    assert "KILN_REQUIRE_SIGNED=0" in said[0] and "refused" in said[0]


def test_row13_restored_older_signed_manifest_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(trust, "ROLLBACK_GRACE_S", 0.0)
    url, key = str(tmp_path / "store"), "hmac:builder"
    builder = open_store(url, signing_key=key, stats_file=False)
    old = make_artifact(KEY, seed="v1")
    assert builder.publish(old)
    manifest = tmp_path / "store" / "ac" / KEY[:2] / KEY
    old_raw = manifest.read_bytes()
    new = make_artifact(KEY, seed="v2")
    assert builder.publish(new)
    client = open_store(url, signing_key=key, stats_file=False)
    got = client.get(KEY)
    assert got is not None and got.blobs == new.blobs
    manifest.write_bytes(old_raw)  # the attacker restores v1, validly signed
    os.utime(manifest)
    with caplog.at_level(logging.WARNING):
        later = open_store(url, signing_key=key, stats_file=False)  # a new process
        assert later.get(KEY) is None
    said = messages(caplog)
    assert len(said) == 1 and "older than" in said[0] and KEY in said[0]
    assert builder.publish(new)  # the builder's republish is newer: accepted again
    got = open_store(url, signing_key=key, stats_file=False).get(KEY)
    assert got is not None and got.blobs == new.blobs


def _max_rss_mib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_row9_huge_sparse_blob_and_manifest_are_not_read(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import time

    url, key = str(tmp_path / "store"), "hmac:builder"
    honest = make_artifact(KEY)
    assert open_store(url, signing_key=key, stats_file=False).publish(honest)
    blobs = sorted(p for p in (tmp_path / "store" / "cas").rglob("*") if p.is_file())
    with open(blobs[0], "r+b") as f:  # a writer of the store: 3 GiB, sparse
        f.truncate(3 * 2**30)
    rss, start = _max_rss_mib(), time.perf_counter()
    with caplog.at_level(logging.WARNING):
        got = open_store(url, signing_key=key, stats_file=False).get(KEY)
    assert got is None
    assert time.perf_counter() - start < 5.0 and _max_rss_mib() - rss < 256
    assert any("damaged" in m for m in messages(caplog))

    assert not any(blob.stat().st_size > 2**20 for blob in
                   (tmp_path / "store" / "cas").rglob("*") if blob.is_file())
    assert open_store(url, signing_key=key, stats_file=False).publish(honest)
    manifest = tmp_path / "store" / "ac" / KEY[:2] / KEY
    with open(manifest, "r+b") as f:
        f.truncate(2 * 2**30)
    rss, start = _max_rss_mib(), time.perf_counter()
    assert open_store(url, signing_key=key, stats_file=False).get(KEY) is None
    assert time.perf_counter() - start < 5.0 and _max_rss_mib() - rss < 256
    assert open_store(url, signing_key=key, stats_file=False).publish(honest)
    got = open_store(url, signing_key=key, stats_file=False).get(KEY)
    assert got is not None and got.blobs == honest.blobs
