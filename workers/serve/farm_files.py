"""The files of `kiln farm up`: its address file (``farm.json``: the Ray head, the gateway)
and its auth token (a private file, mode 0600). The farm writes them; clients read them."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from kiln.artifact_store import user_cache_dir


def farm_file() -> Path:
    return Path(os.environ.get("KILN_FARM_FILE") or user_cache_dir() / "farm.json")

def read_farm_file() -> dict[str, Any] | None:
    try:
        data = json.loads(farm_file().read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("address") else None

def write_farm_file(info: dict[str, Any]) -> Path:
    path = farm_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, path)
    return path

def farm_token_file() -> Path:
    return farm_file().with_name("farm-token")

def farm_token(create: bool = False) -> str | None:
    """The Ray auth token of `kiln farm up`'s cluster (a private file, mode 0600): made
    once and kept, so clients configured with it survive a restart of the farm."""
    path = farm_token_file()
    try:
        token = path.read_text().strip()
        if token:
            return token
    except OSError:
        pass
    if not create:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(32)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token
