"""The store knows nothing of torch: importing and using it must not import torch."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from store_helpers import ROOT

PROGRAM = """
import sys
import kiln.artifact_store
from kiln.artifact_store import Artifact, open_store
store = open_store(sys.argv[1], signing_key="hmac:k")
assert store.publish(Artifact("ab" * 32, {"k": 1}, {"w.py": b"x"}))
assert store.get("ab" * 32) is not None
heavy = sorted(m for m in ("torch", "triton", "numpy", "ray") if m in sys.modules)
assert not heavy, heavy
"""


def test_artifact_store_does_not_import_torch(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(ROOT), KILN_STATS_FILE="off")
    result = subprocess.run([sys.executable, "-c", PROGRAM, str(tmp_path / "store")],
                            env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
