"""Manifest signatures: HMAC-SHA256 with a shared farm key, or Ed25519.

Loading an artifact runs its code, so a signature is the line between a cache and
remote code execution. A keyring is parsed from one specification string
(`KILN_SIGNING_KEY`, or `signing_key=`):

    hmac:<secret>          shared secret (the text itself); signs and verifies
    ed25519:<private>      Ed25519 private key; signs and verifies (writers, the farm)
    ed25519-pub:<public>   Ed25519 public key; verifies only (clients)
    @<path>                read the specification, or a PEM key, from a file
    -----BEGIN ...         a PEM Ed25519 key (private: signs; public: verifies only)

Anything else is a ConfigError: a mistyped prefix (`ed25519_pub:...`, `hmac-...`) or a
bare string must never become an HMAC secret, which would silently turn a verify-only
client into one that signs with the text of a public key.

Ed25519 keys are 32 raw bytes in base64 or hex, or PEM text. Several specifications
separated by commas (each with a prefix above) form a keyring for key rotation: the first
that can sign signs, every one verifies. Ed25519 needs the optional `cryptography`
package (`pip install kiln[sign]`); HMAC needs nothing.

What is signed is the exact manifest body, after a domain-separation prefix; the body
names its own key, so a signed manifest cannot be replayed under another key.
"""

from __future__ import annotations

import base64
import binascii
import enum
import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from .errors import ConfigError

HMAC_SHA256 = "hmac-sha256"
ED25519 = "ed25519"
_DOMAIN = b"kiln-manifest-v1\x00"
_PREFIXES = ("hmac:", "ed25519:", "ed25519-pub:", "@")


@dataclass(frozen=True)
class Signature:
    """A signature as stored in a manifest envelope."""

    alg: str
    kid: str
    value: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"alg": self.alg, "kid": self.kid, "value": self.value}


class SigningKey(Protocol):
    alg: str
    kid: str
    can_sign: bool

    def sign(self, message: bytes) -> bytes: ...

    def verify(self, message: bytes, value: bytes) -> bool: ...


class Verdict(enum.Enum):
    """What a keyring makes of a manifest's signature."""

    VALID = "valid"
    UNSIGNED = "unsigned"
    UNKNOWN_KEY = "unknown key"
    INVALID = "invalid"


class HmacKey:
    """HMAC-SHA256 with a shared secret: everyone who verifies can also sign."""

    alg = HMAC_SHA256
    can_sign = True

    def __init__(self, secret: bytes) -> None:
        if not secret:
            raise ConfigError("empty HMAC signing key")
        self._secret = secret
        self.kid = "hmac:" + hashlib.sha256(b"kiln-kid\x00" + secret).hexdigest()[:16]

    def sign(self, message: bytes) -> bytes:
        return hmac.new(self._secret, message, hashlib.sha256).digest()

    def verify(self, message: bytes, value: bytes) -> bool:
        return hmac.compare_digest(self.sign(message), value)

    def __repr__(self) -> str:  # never show the secret
        return f"HmacKey({self.kid})"


class Ed25519Key:
    """Ed25519; a key built from the public half only verifies."""

    alg = ED25519

    def __init__(self, private: Any = None, public: Any = None) -> None:
        from cryptography.hazmat.primitives import serialization

        self._private = private
        self._public = public if public is not None else private.public_key()
        raw = self._public.public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )
        self.public_raw: bytes = raw
        self.kid = "ed25519:" + hashlib.sha256(raw).hexdigest()[:16]
        self.can_sign = private is not None

    def sign(self, message: bytes) -> bytes:
        if self._private is None:
            raise ConfigError(f"{self.kid} is a public key: it verifies but cannot sign")
        return bytes(self._private.sign(message))

    def verify(self, message: bytes, value: bytes) -> bool:
        from cryptography.exceptions import InvalidSignature

        try:
            self._public.verify(value, message)
        except InvalidSignature:
            return False
        return True

    def __repr__(self) -> str:
        return f"Ed25519Key({self.kid}, can_sign={self.can_sign})"


class Keyring:
    """The keys a store signs with (the first that can sign) and verifies with (all)."""

    def __init__(self, keys: Sequence[SigningKey] = ()) -> None:
        self.keys = tuple(keys)
        self._by_kid = {key.kid: key for key in self.keys}
        self.signer = next((key for key in self.keys if key.can_sign), None)

    def __bool__(self) -> bool:
        return bool(self.keys)

    def sign(self, body: bytes) -> Signature | None:
        if self.signer is None:
            return None
        return Signature(self.signer.alg, self.signer.kid, self.signer.sign(_DOMAIN + body))

    def verify(self, body: bytes, signature: Signature | None) -> Verdict:
        if signature is None:
            return Verdict.UNSIGNED
        key = self._by_kid.get(signature.kid)
        if key is None or key.alg != signature.alg:
            return Verdict.UNKNOWN_KEY
        if key.verify(_DOMAIN + body, signature.value):
            return Verdict.VALID
        return Verdict.INVALID

    def describe(self) -> str:
        return ", ".join(key.kid for key in self.keys) or "no keys"


def ed25519_available() -> bool:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519  # noqa: F401
    except ImportError:
        return False
    return True


def parse_keyring(spec: str | bytes | None) -> Keyring:
    """Build a keyring from a specification (module docstring); raises ConfigError."""
    if spec is None:
        return Keyring()
    if isinstance(spec, bytes):
        return Keyring([HmacKey(spec)])
    text = spec.strip()
    if not text:
        return Keyring()
    parts = [part.strip() for part in text.split(",")]
    if len(parts) > 1 and all(part.startswith(_PREFIXES) for part in parts):
        return Keyring([_parse_one(part) for part in parts])
    return Keyring([_parse_one(text)])


def _parse_one(spec: str) -> SigningKey:
    if spec.startswith("@"):
        path = Path(spec[1:]).expanduser()
        try:
            content = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"cannot read signing key file {path}: {exc}") from exc
        if content.startswith("-----BEGIN"):
            return _ed25519_from_pem(content)
        return _parse_one(content)
    if spec.startswith("hmac:"):
        return HmacKey(spec[len("hmac:"):].encode())
    if spec.startswith("ed25519-pub:"):
        return _ed25519_from_text(spec[len("ed25519-pub:"):], public=True)
    if spec.startswith("ed25519:"):
        return _ed25519_from_text(spec[len("ed25519:"):], public=False)
    if spec.startswith("-----BEGIN"):
        return _ed25519_from_pem(spec)
    raise ConfigError(_malformed(spec))


def _malformed(spec: str) -> str:
    """Why a key specification is refused, without echoing the secret it may hold."""
    head = spec.split(":", 1)[0] + ":" if ":" in spec[:24] else ""
    what = f"unknown prefix {head!r}" if head else "no prefix"
    return (f"malformed signing key ({what}): expected hmac:<secret>, ed25519:<private>, "
            "ed25519-pub:<public>, @<file> or a PEM key")


def _require_cryptography() -> None:
    if not ed25519_available():
        raise ConfigError(
            "an Ed25519 signing key is configured but the `cryptography` package is not "
            "installed: pip install 'kiln[sign]' (or cryptography), or use an hmac: key"
        )


def _ed25519_from_text(text: str, *, public: bool) -> SigningKey:
    text = text.strip()
    if text.startswith("-----BEGIN"):
        return _ed25519_from_pem(text)
    _require_cryptography()
    from cryptography.hazmat.primitives.asymmetric import ed25519

    raw = _decode_raw_key(text)
    if public:
        return Ed25519Key(public=ed25519.Ed25519PublicKey.from_public_bytes(raw))
    return Ed25519Key(private=ed25519.Ed25519PrivateKey.from_private_bytes(raw))


def _decode_raw_key(text: str) -> bytes:
    raw: bytes | None = None
    if len(text) == 64:
        try:
            raw = bytes.fromhex(text)
        except ValueError:
            raw = None
    if raw is None:
        try:
            padded = text + "=" * (-len(text) % 4)
            raw = base64.b64decode(padded.replace("-", "+").replace("_", "/"), validate=True)
        except (binascii.Error, ValueError) as exc:
            raise ConfigError("Ed25519 key is neither base64 nor hex") from exc
    if len(raw) != 32:
        raise ConfigError(f"Ed25519 key must be 32 bytes, got {len(raw)}")
    return raw


def _ed25519_from_pem(text: str) -> SigningKey:
    _require_cryptography()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    data = text.encode()
    try:
        if "PRIVATE KEY" in text:
            private = serialization.load_pem_private_key(data, password=None)
            if not isinstance(private, ed25519.Ed25519PrivateKey):
                raise ConfigError("PEM signing key is not an Ed25519 key")
            return Ed25519Key(private=private)
        public = serialization.load_pem_public_key(data)
    except ValueError as exc:
        raise ConfigError(f"cannot parse PEM signing key: {exc}") from exc
    if not isinstance(public, ed25519.Ed25519PublicKey):
        raise ConfigError("PEM signing key is not an Ed25519 key")
    return Ed25519Key(public=public)


def generate_ed25519_key() -> tuple[str, str]:
    """A new key pair as specifications: (`ed25519:<private>`, `ed25519-pub:<public>`).

    The first goes to the farm's writers, the second to every client.
    """
    _require_cryptography()
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519

    private = ed25519.Ed25519PrivateKey.generate()
    private_raw = private.private_bytes(
        serialization.Encoding.Raw,
        serialization.PrivateFormat.Raw,
        serialization.NoEncryption(),
    )
    public_raw = Ed25519Key(private=private).public_raw
    return (
        "ed25519:" + base64.b64encode(private_raw).decode(),
        "ed25519-pub:" + base64.b64encode(public_raw).decode(),
    )
