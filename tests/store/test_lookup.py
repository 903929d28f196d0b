"""What `Store.lookup` tells apart (for `kiln inspect`): a missing artifact, a damaged one,
one refused for its signature, and a store that cannot be used; and key prefixes."""

from __future__ import annotations

from pathlib import Path

from store_helpers import make_artifact

from kiln.artifact_store import open_store


def test_lookup_tells_missing_from_damaged_from_refused(tmp_path: Path) -> None:
    url = f"file://{tmp_path / 'store'}"
    writer = open_store(url, local_cache=False, signing_key="hmac:farm")
    artifact = make_artifact(key="ab" + "0" * 62)
    assert writer.publish(artifact)
    reader = open_store(url, local_cache=False, signing_key="hmac:farm")
    assert reader.lookup(artifact.key).status == "found"
    assert reader.lookup("cd" + "0" * 62).status == "missing"
    other = open_store(url, local_cache=False, signing_key="hmac:another")
    refused = other.lookup(artifact.key)
    assert refused.status == "refused" and refused.artifact is None
    assert "not among this client's keys" in refused.problems[0][1]
    blob = next(p for p in (tmp_path / "store" / "cas").rglob("*") if p.is_file())
    blob.write_bytes(b"tampered")
    damaged = open_store(url, local_cache=False, signing_key="hmac:farm",
                         read_only=True).lookup(artifact.key)
    assert damaged.status == "damaged" and "sha256" in damaged.problems[0][1].lower()


def test_keys_by_prefix_and_unusable_stores(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store", local_cache=False)
    keys = ["ab" + "1" * 62, "ab" + "2" * 62, "cd" + "3" * 62]
    for key in keys:
        assert store.publish(make_artifact(key=key))
    assert store.keys("ab") == keys[:2] and store.keys("ab1") == keys[:1]
    assert store.keys("a") == keys[:2] and store.keys("") == keys and store.keys("ef") == []
    assert store.unusable_reason() is None
    missing = open_store(tmp_path / "nowhere", local_cache=False)
    assert "does not exist" in (missing.unusable_reason() or "")
    bogus = open_store("bogus://x/y", local_cache=False)
    assert "cannot open bogus://x/y" in (bogus.unusable_reason() or "")
