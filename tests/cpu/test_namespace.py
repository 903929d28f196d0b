"""Kiln's import names live under ``kiln``: a user's own ``compiler.py`` (or ``frontend``,
``workers``, ``artifact_store``) beside their script must change nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, warnings
import torch
import kiln
from kiln import KilnFallbackWarning

warnings.simplefilter("error", KilnFallbackWarning)
torch.manual_seed(0)
def f(a, b):
    return (torch.relu(a) * b + 1.0).sum(dim=-1)
a, b = torch.randn(8, 33), torch.randn(8, 33)
got = torch.compile(f, backend="kiln")(a, b)
torch.testing.assert_close(got, f(a, b), rtol=1.3e-6, atol=1e-5)
import kiln.frontend.core.client as client
counters = [c.counters.snapshot() for c in client._clients.values()]
print(json.dumps({"backend_is_kiln": kiln.backend is kiln.kiln_backend,
                  "mods": sorted(m for m in __import__("sys").modules
                                 if m in ("compiler", "frontend", "workers", "artifact_store")),
                  "counters": counters}))
"""


def test_user_modules_named_like_kiln_folders_change_nothing(tmp_path: Path) -> None:
    for name in ("compiler", "frontend", "workers", "artifact_store"):
        (tmp_path / f"{name}.py").write_text(
            f"raise RuntimeError('the user module {name}.py was imported by Kiln')\n")
    (tmp_path / "user_script.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(KILN_STORE="file://" + str(tmp_path / "store"), KILN_LOCAL_CACHE="off",
               KILN_CACHE_DIR=str(tmp_path / "cache"), KILN_FARM="inprocess",
               KILN_STATS_FILE="off")
    proc = subprocess.run([sys.executable, "user_script.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["backend_is_kiln"]
    assert report["mods"] == []  # none of the user's modules was imported
    assert report["counters"] and report["counters"][0].get("compiles", 0) >= 1, report


def test_import_kiln_is_light_and_lists_its_api() -> None:
    program = ("import sys, kiln; heavy = [m for m in ('torch', 'ray') if m in sys.modules];"
               "assert not heavy, heavy; print(sorted(set(dir(kiln))))")
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr
    assert "backend" in proc.stdout and "main" in proc.stdout
