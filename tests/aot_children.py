"""Shared text of the child scripts that test a warm start in a fresh process: the lines
that count AOTAutograd's traces in the child (at torch's own entry point, in ``traces``),
and those that collect its counters; and running one."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

COUNT_AOT_TRACES = """import torch._dynamo.backends.common as common
traces = []
real = common.aot_module_simplified
def counted(*args, **kwargs):
    traces.append(1)
    return real(*args, **kwargs)
common.aot_module_simplified = counted
"""

# The counters of every Kiln client of the child, in ``counts`` (flushed to the stats
# file, where there is one); the child imports ``_clients`` from kiln.frontend.core.client.
COLLECT_COUNTERS = """counts = {}
for client in _clients.values():
    counts.update(client.counters.snapshot())
    client.counters.flush()
"""


def run_child(script: str, env: dict[str, str], timeout: float = 900) -> dict[str, Any]:
    """Run a child script in a fresh Python from the repository root; its last line of
    output, as JSON (it must exit 0)."""
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def manifests(store: Path, kind: str) -> list[tuple[Path, dict[str, Any]]]:
    """Every manifest of ``kind`` in a local store folder, with its file."""
    from kiln.artifact_store.manifest import decode_manifest

    found = []
    for path in (store / "ac").rglob("*"):
        if path.is_file():
            meta = decode_manifest(path.read_bytes()).meta
            if meta.get("kind") == kind:
                found.append((path, meta))
    return found
