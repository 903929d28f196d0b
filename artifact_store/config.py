"""Configuration of the artifact store: arguments first, then KILN_* variables, then defaults.

| variable              | meaning                                           | default             |
| --------------------- | ------------------------------------------------- | ------------------- |
| KILN_STORE            | the store, any fsspec URL or a path               | <cache>/store       |
| KILN_LOCAL_CACHE      | local tier in front of a non-file store; `off`    | <cache>/local       |
| KILN_LOCAL_CACHE_SIZE | bound of the local tier (`10G`, `512M`, bytes)    | 10G                 |
| KILN_SIGNING_KEY      | key(s) that sign and verify manifests (signing)   | unset               |
| KILN_REQUIRE_SIGNED   | `1` refuses unsigned or wrongly signed manifests  | `1` if a key is set |
| KILN_TRUST_UNSIGNED   | `1` accepts unsigned artifacts from shared stores | `0` (loud when `1`) |
| KILN_STORE_READ_ONLY  | `1`: never write the store                        | `0`                 |
| KILN_STORE_TIMEOUT    | seconds before a remote operation counts as lost  | 10                  |
| KILN_STORE_OPTIONS    | JSON object of fsspec storage options             | {}                  |
| KILN_STATS_FILE       | JSON counters file; `off` disables                | <cache>/stats.json  |

<cache> is $XDG_CACHE_HOME/kiln, else ~/.cache/kiln (%LOCALAPPDATA%\\kiln on Windows).
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsspec.utils import stringify_path

from .errors import ConfigError
from .trust import trust_unsigned, writable_by_others

ENV_STORE = "KILN_STORE"
ENV_LOCAL_CACHE = "KILN_LOCAL_CACHE"
ENV_LOCAL_CACHE_SIZE = "KILN_LOCAL_CACHE_SIZE"
ENV_SIGNING_KEY = "KILN_SIGNING_KEY"
ENV_REQUIRE_SIGNED = "KILN_REQUIRE_SIGNED"
ENV_READ_ONLY = "KILN_STORE_READ_ONLY"
ENV_TIMEOUT = "KILN_STORE_TIMEOUT"
ENV_OPTIONS = "KILN_STORE_OPTIONS"
ENV_STATS_FILE = "KILN_STATS_FILE"

DEFAULT_LOCAL_CACHE_MAX_BYTES = 10 * 2**30
DEFAULT_TIMEOUT_S = 10.0

_OFF = {"off", "none", "0", "false", "no", "disabled"}
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}
_LOCAL_PROTOCOLS = {"file", "local"}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?b?)\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40, "p": 2**50}


def user_cache_dir() -> Path:
    """Kiln's directory under the user cache directory (XDG_CACHE_HOME honoured)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if xdg and os.path.isabs(xdg):  # the XDG spec says to ignore relative paths
        base = Path(xdg)
    elif sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local")
    else:
        base = Path.home() / ".cache"
    return base / "kiln"


def parse_bool(value: str, name: str) -> bool:
    text = value.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r}: expected 1 or 0")


def parse_size(value: str | int, name: str = "size") -> int:
    """Bytes from `10G`, `512MiB`, `1.5g` or a plain integer (powers of 1024)."""
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{name}={value}: must not be negative")
        return value
    match = _SIZE_RE.match(value)
    if not match:
        raise ConfigError(f"{name}={value!r}: expected a size such as 10G, 512M or 1000000")
    number, unit, _ = match.groups()
    return int(float(number) * _SIZE_UNITS[unit.lower()])


def url_protocol(url: str) -> str:
    """The outermost protocol of an fsspec URL; `file` for a plain path."""
    if "::" in url:
        url = url.split("::", 1)[0]
    if "://" in url:
        return url.split("://", 1)[0].lower()
    return "file"


def is_local_url(url: str) -> bool:
    return "::" not in url and url_protocol(url) in _LOCAL_PROTOCOLS


def normalize_url(url: str) -> str:
    """A plain or `~` path becomes an absolute file:// URL; other URLs are kept."""
    if "://" not in url and "::" not in url:
        return "file://" + os.path.abspath(os.path.expanduser(url))
    if url_protocol(url) in _LOCAL_PROTOCOLS and "::" not in url:
        path = url.split("://", 1)[1]
        return "file://" + os.path.abspath(os.path.expanduser(path))
    return url


def is_private_store(url: str) -> bool:
    """Whether only this user can write the store (see `shared_reason`)."""
    return shared_reason(url) is None


def shared_reason(url: str) -> str | None:
    """Why others could write the store at `url`; None when only this user can:
    memory:// (this process), or a local folder that it and every folder above it are
    this user's alone (trust.writable_by_others; its `ac/` and `cas/` too). A remote
    store (a bucket, a shared disk) always has a reason: whoever can write it would run
    code in every reader of unsigned artifacts."""
    if url_protocol(url) == "memory" and "::" not in url:
        return None
    if not is_local_url(url):
        return f"{redact_url(url)} is a remote store, which others may write"
    path = os.path.realpath(normalize_url(url).split("://", 1)[1])
    if not os.path.exists(path) and not os.path.isdir(nearest_existing(path)):
        return None  # under a file: no store can be made there (missing_folder_reason)
    for level in (os.path.join(path, "ac"), os.path.join(path, "cas"), path):
        reason = writable_by_others(level)
        if reason is not None:
            return reason
    return None


def nearest_existing(path: str) -> str:
    """`path`'s nearest parent that exists (the root at worst)."""
    parent = os.path.dirname(path)
    while not os.path.exists(parent) and parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
    return parent


def missing_folder_reason(path: str) -> str:
    """Why a store folder at `path` cannot be used: a file stands at it or above it, or
    the folder does not exist."""
    if os.path.exists(path):
        return f"no store at {path} ({path} is a file, not a folder)"
    parent = nearest_existing(path)
    if not os.path.isdir(parent):
        return f"no store at {path} ({parent} is a file, not a folder)"
    return f"no store at {path} (the folder does not exist)"


def redact_url(url: str) -> str:
    """The URL without any user:password@ part, for messages."""
    return re.sub(r"://[^/@]*@", "://***@", url)


@dataclass(frozen=True)
class StoreConfig:
    """Everything `open_store` needs, fully resolved (no None meaning 'from env')."""

    url: str
    local_cache: str | None
    local_cache_max_bytes: int = DEFAULT_LOCAL_CACHE_MAX_BYTES
    signing_key: str | bytes | None = field(default=None, repr=False)
    require_signed: bool = False
    read_only: bool = False
    storage_options: Mapping[str, Any] = field(default_factory=dict, repr=False)
    timeout_s: float = DEFAULT_TIMEOUT_S
    stats_file: str | None = None
    trust_unsigned: bool = False

    @classmethod
    def resolve(
        cls,
        url: str | os.PathLike[str] | None = None,
        *,
        local_cache: str | os.PathLike[str] | bool | None = None,
        local_cache_max_bytes: int | str | None = None,
        signing_key: str | bytes | None = None,
        require_signed: bool | None = None,
        read_only: bool | None = None,
        storage_options: Mapping[str, Any] | None = None,
        timeout: float | None = None,
        stats_file: str | os.PathLike[str] | bool | None = None,
        env: Mapping[str, str] | None = None,
    ) -> StoreConfig:
        """Fill every None from `env` (default os.environ), then from defaults."""
        env = os.environ if env is None else env
        cache_root = user_cache_dir()
        raw_url = stringify_path(url) if url is not None else env.get(ENV_STORE, "").strip()
        store_url = normalize_url(raw_url or str(cache_root / "store"))
        key = signing_key if signing_key is not None else (env.get(ENV_SIGNING_KEY) or None)
        if require_signed is None:
            text = env.get(ENV_REQUIRE_SIGNED, "").strip()
            # A client that holds a key refuses what that key did not sign (DESIGN.md).
            require_signed = parse_bool(text, ENV_REQUIRE_SIGNED) if text else key is not None
        if read_only is None:
            read_only = parse_bool(env.get(ENV_READ_ONLY, ""), ENV_READ_ONLY)
        return cls(
            url=store_url,
            local_cache=_resolve_local_cache(local_cache, env, store_url, cache_root),
            local_cache_max_bytes=_resolve_cache_size(local_cache_max_bytes, env),
            signing_key=key,
            require_signed=bool(require_signed),
            read_only=bool(read_only),
            storage_options=_resolve_options(storage_options, env),
            timeout_s=_resolve_timeout(timeout, env),
            stats_file=_resolve_stats_file(stats_file, env, cache_root),
            trust_unsigned=trust_unsigned(dict(env)),
        )


def _resolve_local_cache(
    value: str | os.PathLike[str] | bool | None,
    env: Mapping[str, str],
    store_url: str,
    cache_root: Path,
) -> str | None:
    if value is False:
        return None
    if value is None or value is True:
        text = env.get(ENV_LOCAL_CACHE, "").strip()
        if text.lower() in _OFF:
            return None
        if not text:
            # A local tier in front of a store on local disk would only copy it.
            if is_local_url(store_url) and value is None:
                return None
            text = str(cache_root / "local")
    else:
        text = stringify_path(value).strip()
        if text.lower() in _OFF:
            return None
    cache_url = normalize_url(text)
    return None if cache_url.rstrip("/") == store_url.rstrip("/") else cache_url


def _resolve_cache_size(value: int | str | None, env: Mapping[str, str]) -> int:
    if value is None:
        text = env.get(ENV_LOCAL_CACHE_SIZE, "").strip()
        return parse_size(text, ENV_LOCAL_CACHE_SIZE) if text else DEFAULT_LOCAL_CACHE_MAX_BYTES
    return parse_size(value, "local_cache_max_bytes")


def _resolve_options(value: Mapping[str, Any] | None, env: Mapping[str, str]) -> dict[str, Any]:
    if value is not None:
        return dict(value)
    text = env.get(ENV_OPTIONS, "").strip()
    if not text:
        return {}
    try:
        options = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{ENV_OPTIONS} is not valid JSON: {exc}") from exc
    if not isinstance(options, dict):
        raise ConfigError(f"{ENV_OPTIONS} must be a JSON object of fsspec storage options")
    return options


def _resolve_timeout(value: float | None, env: Mapping[str, str]) -> float:
    source = "timeout"
    if value is None:
        text = env.get(ENV_TIMEOUT, "").strip()
        if not text:
            return DEFAULT_TIMEOUT_S
        source = ENV_TIMEOUT
        try:
            value = float(text)
        except ValueError as exc:
            raise ConfigError(f"{ENV_TIMEOUT}={text!r}: expected seconds") from exc
    if not value > 0:
        raise ConfigError(f"{source}={value}: the store timeout must be positive seconds")
    return float(value)


def _resolve_stats_file(
    value: str | os.PathLike[str] | bool | None, env: Mapping[str, str], cache_root: Path
) -> str | None:
    if value is False:
        return None
    if value is None or value is True:
        text = env.get(ENV_STATS_FILE, "").strip()
        if text.lower() in _OFF:
            return None
        return os.path.expanduser(text) if text else str(cache_root / "stats.json")
    return os.path.expanduser(stringify_path(value))


def default_stats_file() -> str | None:
    """Where `kiln stats --json` reads the counters, under the current environment."""
    return _resolve_stats_file(None, os.environ, user_cache_dir())
