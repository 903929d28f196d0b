"""The coordinator's name and Ray namespace, without Ray or torch: a client's farm process
(``frontend.transports.process``) looks the coordinator up by them before it imports anything
heavier, and the coordinator is created under them (``workers.coordinator``)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

FARM_NAME = "KilnFarm"


def namespace_for(versions: dict[str, Any]) -> str:
    """The Ray namespace of a Kiln's farm: one per compiler version (``versions()``)."""
    digest = hashlib.sha256(json.dumps(versions, sort_keys=True).encode()).hexdigest()
    return f"kiln-{digest[:12]}"
