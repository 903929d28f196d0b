"""Signing keys and keyrings: HMAC, Ed25519 (writer holds the private key, clients only
the public one), rotation, and what a reader accepts."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest
from store_helpers import make_artifact, store_warnings

from kiln.artifact_store import ConfigError, generate_ed25519_key, open_store, parse_keyring
from kiln.artifact_store.signing import Verdict

BODY = b"manifest body bytes"


def test_hmac_sign_and_verify() -> None:
    farm = parse_keyring("hmac:farm-secret")
    signature = farm.sign(BODY)
    assert signature is not None and signature.alg == "hmac-sha256"
    assert "farm-secret" not in signature.kid and "farm-secret" not in repr(farm.keys[0])
    assert farm.verify(BODY, signature) is Verdict.VALID
    assert farm.verify(BODY + b"x", signature) is Verdict.INVALID
    assert parse_keyring("hmac:other").verify(BODY, signature) is Verdict.UNKNOWN_KEY
    assert farm.verify(BODY, None) is Verdict.UNSIGNED
    # Bytes are HMAC secrets too (the same secret is the same key); a bare string is
    # refused (test_trust.py): a mistyped prefix must not become a secret.
    assert parse_keyring(b"farm-secret").verify(BODY, signature) is Verdict.VALID
    assert not parse_keyring(None) and not parse_keyring("  ")


def test_rotation_signs_with_first_and_verifies_with_all(tmp_path: Path) -> None:
    url = tmp_path / "store"
    assert open_store(url, signing_key="hmac:old").publish(make_artifact(key="a" * 64))
    assert open_store(url, signing_key="hmac:new,hmac:old").publish(make_artifact(key="b" * 64))
    rotated = open_store(url, signing_key="hmac:new,hmac:old")
    assert rotated.get("a" * 64) is not None and rotated.get("b" * 64) is not None
    new_only = open_store(url, signing_key="hmac:new")
    assert new_only.get("a" * 64) is None and new_only.get("b" * 64) is not None
    assert parse_keyring("hmac:a,b").keys[0].kid == parse_keyring("hmac:a,b").signer.kid  # type: ignore[union-attr]
    assert len(parse_keyring("hmac:a,b").keys) == 1  # "b" has no prefix: one secret "a,b"


def test_key_from_file(tmp_path: Path) -> None:
    path = tmp_path / "farm.key"
    path.write_text("hmac:from-a-file\n")
    signature = parse_keyring(f"@{path}").sign(BODY)
    assert parse_keyring("hmac:from-a-file").verify(BODY, signature) is Verdict.VALID
    with pytest.raises(ConfigError, match="cannot read"):
        parse_keyring(f"@{tmp_path / 'missing.key'}")


@pytest.fixture
def ed25519_pair() -> tuple[str, str]:
    pytest.importorskip("cryptography")
    return generate_ed25519_key()


def test_ed25519_writer_signs_client_with_public_key_verifies(
    tmp_path: Path, ed25519_pair: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    private, public = ed25519_pair
    url = tmp_path / "store"
    farm = open_store(url, signing_key=private)
    assert farm.publish(make_artifact())
    client = open_store(url, signing_key=public, read_only=True)
    got = client.get("a" * 64)
    assert got is not None and got.blobs == make_artifact().blobs
    described = client.describe("a" * 64)
    assert described is not None and described["signature"]["alg"] == "ed25519"

    stranger = open_store(url, signing_key=generate_ed25519_key()[1])
    assert stranger.get("a" * 64) is None
    # A client holding only the public key cannot sign, so it does not publish.
    assert stranger.publish(make_artifact(key="b" * 64)) is False
    assert stranger.publish(make_artifact(key="c" * 64)) is False
    warnings = store_warnings(caplog)
    assert len(warnings) == 2
    assert "not among this client's keys" in warnings[0]
    assert "no key that can sign" in warnings[1]


def test_ed25519_key_encodings(tmp_path: Path, ed25519_pair: tuple[str, str]) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    private, public = ed25519_pair
    raw = base64.b64decode(private.split(":", 1)[1])
    key = ed25519.Ed25519PrivateKey.from_private_bytes(raw)
    signature = parse_keyring(private).sign(BODY)
    pem_public = key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    ).decode()
    pem_file = tmp_path / "farm.pub.pem"
    pem_file.write_text(pem_public)
    pub_raw = base64.b64decode(public.split(":", 1)[1])
    for spec in (public, f"ed25519-pub:{pub_raw.hex()}", f"@{pem_file}",
                 f"ed25519-pub:{base64.urlsafe_b64encode(pub_raw).decode().rstrip('=')}"):
        keyring = parse_keyring(spec)
        assert keyring.signer is None, spec
        assert keyring.verify(BODY, signature) is Verdict.VALID, spec
    pem_private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    assert parse_keyring(pem_private).signer is not None
    with pytest.raises(ConfigError, match="32 bytes"):
        parse_keyring("ed25519:" + base64.b64encode(b"short").decode())
    with pytest.raises(ConfigError):
        parse_keyring("ed25519:not base64 at all!")


def test_ed25519_without_cryptography_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("kiln.artifact_store.signing.ed25519_available", lambda: False)
    with pytest.raises(ConfigError, match="cryptography"):
        parse_keyring("ed25519-pub:" + "00" * 32)
    store = open_store(signing_key="ed25519-pub:" + "00" * 32)  # fails closed, no exception
    assert store.disabled_reason is not None
    with pytest.raises(ConfigError):
        open_store(signing_key="ed25519-pub:" + "00" * 32, strict=True)


def test_require_signed_follows_the_key(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert open_store(tmp_path).require_signed is False
    assert open_store(tmp_path, signing_key="hmac:k").require_signed is True
    monkeypatch.setenv("KILN_SIGNING_KEY", "hmac:k")
    assert open_store(tmp_path).require_signed is True
    monkeypatch.setenv("KILN_REQUIRE_SIGNED", "0")
    assert open_store(tmp_path).require_signed is False
    monkeypatch.delenv("KILN_SIGNING_KEY")
    monkeypatch.setenv("KILN_REQUIRE_SIGNED", "1")
    assert open_store(tmp_path).require_signed is True
