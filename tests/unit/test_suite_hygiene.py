"""The test suite cleans up after itself and says where it is: a pytest run leaves none
of its session folders in the temp folder; scripts/test.sh sends every temporary file to
one folder it removes, prints a line per test file and says how long the run takes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_pytest_run_leaves_nothing_in_the_temp_folder(tmp_path: Path) -> None:
    temp = tmp_path / "tmp"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    for name in ("KILN_STORE", "KILN_LOCAL_CACHE", "KILN_CACHE_DIR"):
        env.pop(name, None)  # the session's own folders, as in a fresh run
    done = subprocess.run([sys.executable, "-m", "pytest", "tests/store/test_no_torch.py",
                           "-p", "no:cacheprovider", "-q", "--basetemp", str(tmp_path / "b")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    assert sorted(p.name for p in temp.iterdir()) == []


def test_the_suite_script_cleans_up_and_shows_progress() -> None:
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert 'export TMPDIR="$scratch"' in script and "trap 'rm -rf \"$scratch\"' EXIT" in script
    assert re.search(r"kiln tests: \d+ to \d+ minutes on 2 cores", script)  # said up front
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["addopts"]
    assert "-q" not in addopts.split()  # one line per file, with its progress
