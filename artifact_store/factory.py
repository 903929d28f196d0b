"""`open_store`: configuration in, a ready `Store` out, whatever the environment holds.

A configuration that cannot be honoured (a malformed variable, a signing key that does
not parse, an URL whose file system is not installed) does not raise into the user's
program: the store it gives is disabled (or keeps only the tiers that work), and one
error says why. `strict=True` raises ConfigError instead, for the CLI and for tests.
A signing key that does not parse disables the whole store rather than dropping the
key: failing open would load unverified code.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .config import StoreConfig, redact_url, shared_reason, url_protocol, user_cache_dir
from .errors import ConfigError, describe_exception
from .faults import TierHealth, shared_pool
from .signing import Keyring
from .stats import StoreStats
from .store import Store, keyring_for
from .tiers import CACHE, PRIMARY, LruBound, Tier
from .trust import Freshness, writable_by_others

logger = logging.getLogger("kiln.artifact_store.store")

_S3_RETRIES = 3


def open_store(
    url: str | os.PathLike[str] | None = None,
    *,
    local_cache: str | os.PathLike[str] | bool | None = None,
    signing_key: str | bytes | None = None,
    require_signed: bool | None = None,
    read_only: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
    timeout: float | None = None,
    local_cache_max_bytes: int | str | None = None,
    stats_file: str | os.PathLike[str] | bool | None = None,
    strict: bool = False,
) -> Store:
    """Open the artifact store. Every None is read from the KILN_* variables (config.py).

    url: any fsspec URL (file://, memory://, s3://, gs://) or a path; default
        <user cache>/kiln/store. local_cache: the local tier's path, or False/"off";
        default <user cache>/kiln/local in front of a store that is not on local disk.
    signing_key / require_signed: see signing.py; a key implies require_signed unless
        KILN_REQUIRE_SIGNED=0. read_only: never write the store (clients in CI).
    storage_options: passed to fsspec for the store. timeout: seconds per remote call.
    """
    try:
        config = StoreConfig.resolve(
            url, local_cache=local_cache, signing_key=signing_key,
            require_signed=require_signed, read_only=read_only,
            storage_options=storage_options, timeout=timeout,
            local_cache_max_bytes=local_cache_max_bytes, stats_file=stats_file,
        )
        keyring = keyring_for(config)
    except ConfigError as exc:
        if strict:
            raise
        logger.error("Kiln artifact store disabled: %s; every graph compiles locally", exc)
        config = StoreConfig(url="", local_cache=None, require_signed=True, read_only=True)
        return Store(config, primary=None, cache=None, keyring=Keyring(),
                     stats=StoreStats(None), disabled_reason=str(exc))
    stats = StoreStats(config.stats_file)
    cache = _open_tier(config, CACHE, strict) if config.local_cache else None
    primary = _open_tier(config, PRIMARY, strict, has_cache=cache is not None)
    shared = shared_reason(config.url) if primary is not None else None
    warned = bool(shared) and not config.trust_unsigned and not config.require_signed \
        and warn_unsigned(config.url, shared or "", bool(keyring))
    _describe_fallbacks(primary, cache)
    if cache is not None:
        cache.bound = LruBound(
            cache, config.local_cache_max_bytes,
            on_evict=lambda n: stats.count("evictions", n),
        )
    store = Store(config, primary=primary, cache=cache, keyring=keyring, stats=stats,
                  freshness=_freshness())
    store.warned_shared = warned
    return store


def _freshness() -> Freshness:
    """The newest publish times this user accepted (trust.Freshness), kept under the
    user's cache folder when only this user can write it."""
    folder = user_cache_dir() / "seen"
    return Freshness(folder if writable_by_others(folder) is None else None)


_warned_unsigned: set[str] = set()


def warn_unsigned(url: str, reason: str, has_keys: bool = False) -> bool:
    """One loud warning per process (and store) that a store others can write is open
    and its unsigned artifacts are refused; True once said."""
    if url in _warned_unsigned:
        return True
    _warned_unsigned.add(url)
    what = ("KILN_REQUIRE_SIGNED=0 is set" if has_keys else "no KILN_SIGNING_KEY is set")
    logging.getLogger("kiln.trust").warning(
        "Kiln: the artifact store %s is shared (%s) and %s: anyone who can write to it "
        "could make this process run their code (artifacts are Python and shared objects "
        "that Kiln loads), so its unsigned artifacts are refused and graphs compile "
        "locally. Give builders (farm, precompile jobs) KILN_SIGNING_KEY=ed25519:<private>, "
        "clients KILN_SIGNING_KEY=ed25519-pub:<public> and KILN_REQUIRE_SIGNED=1 (see "
        "infra/README.md); an unsigned store is for a folder only you can write "
        "(KILN_TRUST_UNSIGNED=1 runs them anyway)",
        redact_url(url), reason, what,
    )
    return True


def _open_tier(
    config: StoreConfig, role: str, strict: bool, *, has_cache: bool = False
) -> Tier | None:
    url = config.local_cache if role == CACHE else config.url
    assert url is not None
    options = {} if role == CACHE else dict(config.storage_options)
    if url_protocol(url) in ("s3", "s3a"):
        _s3_defaults(options, config.timeout_s)
    label = redact_url(url)
    try:
        fs, root = fsspec.core.url_to_fs(url, **options)
    except Exception as exc:
        message = f"cannot open {label}: {describe_exception(exc)}"
        if strict:
            raise ConfigError(message) from exc
        logger.error("Kiln artifact store: %s; continuing without it", message)
        return None
    if url_protocol(url) in ("s3", "s3a") and isinstance(getattr(fs, "retries", None), int):
        # s3fs retries connection errors 5 times with back-off (about a second); a cache
        # that is down should cost less than that. (Per instance: s3fs has no option.)
        fs.retries = min(fs.retries, _S3_RETRIES)
    is_local = isinstance(fs, LocalFileSystem)
    if role == CACHE:
        label = root if is_local else label
    name = "local" if role == CACHE or (is_local and not has_cache) else "remote"
    health = TierHealth(label, logging.getLogger("kiln.artifact_store.store"),
                        fallback="", timeout_s=config.timeout_s)
    return Tier(
        name, fs, root, role=role, label=label, health=health, pool=shared_pool(),
        timeout_s=config.timeout_s, writable=role == CACHE or not config.read_only,
    )


def _describe_fallbacks(primary: Tier | None, cache: Tier | None) -> None:
    """What each tier's outage warning says the user's job does instead."""
    if primary is not None:
        primary.health.fallback = (
            f"serving hits from the local cache {cache.label} and compiling misses locally"
            if cache is not None else "lookups miss and graphs compile locally"
        )
    if cache is not None:
        cache.health.fallback = (
            f"using the store {primary.label} directly" if primary is not None
            else "lookups miss and graphs compile locally"
        )


def _s3_defaults(options: dict[str, Any], timeout_s: float) -> None:
    """Bound botocore's own waiting by the store's timeout (the caller may override).

    botocore's retries back off up to seconds at random; s3fs retries the same errors
    (connection, timeout, throttling) with short back-off, so botocore makes one attempt."""
    config_kwargs = dict(options.get("config_kwargs") or {})
    config_kwargs.setdefault("connect_timeout", min(timeout_s, 5.0))
    config_kwargs.setdefault("read_timeout", timeout_s)
    config_kwargs.setdefault("retries", {"max_attempts": 1, "mode": "standard"})
    options["config_kwargs"] = config_kwargs
