"""Kiln's artifact store: content-addressed blobs and signed manifests on any fsspec URL,
with a bounded local tier in front of a remote one and verified reads.

    from kiln.artifact_store import Artifact, open_store

    store = open_store()                       # KILN_STORE, KILN_LOCAL_CACHE, ... from env
    store.publish(Artifact(key, {"target": ...}, {"wrapper.py": b"..."}))   # -> bool
    art = store.get(key)                       # -> Artifact | None, every blob verified

No method of a store raises: a fault is a miss or a refused publish, with one warning.
This package knows nothing of torch (and never imports it).
"""

from .artifact import Artifact
from .config import StoreConfig, default_stats_file, user_cache_dir
from .errors import ConfigError, IntegrityError, StoreError
from .factory import open_store
from .signing import Keyring, ed25519_available, generate_ed25519_key, parse_keyring
from .stats import read_stats, reset_stats, summarize
from .store import Store

__all__ = [
    "Artifact",
    "ConfigError",
    "IntegrityError",
    "Keyring",
    "Store",
    "StoreConfig",
    "StoreError",
    "default_stats_file",
    "ed25519_available",
    "generate_ed25519_key",
    "open_store",
    "parse_keyring",
    "read_stats",
    "reset_stats",
    "summarize",
    "user_cache_dir",
]
