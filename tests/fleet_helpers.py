"""Shared by the tests that start several processes on one store (tests/cpu/
test_fleet_claims.py, test_ddp_ranks.py): their environment and the graphs they stored."""

from __future__ import annotations

import os
from pathlib import Path

from kiln.artifact_store.manifest import decode_manifest

ROOT = Path(__file__).resolve().parents[1]


def fleet_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The default mode (no farm up: no farm file in this cache folder) on a shared
    folder store, with one stats file that every process adds to."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update({"KILN_STORE": f"file://{tmp_path / 'store'}", "KILN_LOCAL_CACHE": "off",
                "KILN_STATS_FILE": str(tmp_path / "stats.json"),
                "XDG_CACHE_HOME": str(tmp_path / "cache"),
                "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **extra})
    return env


def graph_keys(store: Path) -> set[str]:
    """Keys of compiled graphs in a folder store (not AOT entries, not kernels)."""
    keys = set()
    for path in (store / "ac").rglob("*"):
        if path.is_file() and ".tmp-" not in path.name:
            meta = decode_manifest(path.read_bytes()).meta
            if meta.get("kind") not in ("aot", "kernel", "regions"):
                keys.add(path.name)
    return keys
