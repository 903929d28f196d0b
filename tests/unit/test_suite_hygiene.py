"""The test suite cleans up after itself and says where it is: a pytest run leaves none
of its session folders in the temp folder; scripts/test.sh sends every temporary file to
one folder it removes, prints a line per test file (spread over xdist's workers, and beside
the Triton interpreter's run) and says how long the run takes."""

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
    assert 'export TMPDIR="$scratch"' in script and "trap cleanup EXIT" in script
    cleanup = script[script.index("cleanup() {"):script.index("trap cleanup EXIT")]
    assert 'rm -rf "$scratch"' in cleanup and 'kill "$interp"' in cleanup
    assert re.search(r"kiln tests: \d+ to \d+ minutes on 2 cores", script)  # said up front
    assert script.count("--file-progress") == 2  # both pytest runs: a line per file
    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"]["addopts"]
    assert "-q" not in addopts.split()  # one line per file, with its progress


def test_file_progress_prints_a_line_per_file_from_xdist_workers(tmp_path: Path) -> None:
    """tests/file_progress.py under xdist (as scripts/test.sh runs the suite): one whole
    line per file once its last test is reported, with its counts and its failures."""
    (tmp_path / "test_one.py").write_text("def test_a():\n    pass\n\n"
                                          "def test_b():\n    raise ValueError('on purpose')\n")
    (tmp_path / "test_two.py").write_text("import pytest\n\n@pytest.mark.skip\n"
                                          "def test_c():\n    pass\n")
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT / 'tests')!r})\n"
        "from file_progress import add_option, configure\n"
        "pytest_addoption = add_option\npytest_configure = configure\n")
    done = subprocess.run([sys.executable, "-m", "pytest", str(tmp_path), "-n", "2",
                           "--file-progress", "-o", "console_output_style=classic",
                           "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "b"),
                           "--rootdir", str(tmp_path), "-c", os.devnull],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": ""},
                          capture_output=True, text=True, timeout=300)
    lines = done.stdout.splitlines()
    assert done.returncode == 1, done.stdout[-3000:]
    one = next(i for i, line in enumerate(lines) if "test_one.py: " in line)
    assert re.search(r"\] test_one.py: 1 failed, 1 passed \(\d+\.\d s\)$", lines[one])
    assert lines[one + 1].strip() == "FAILED test_b (failed)"
    assert any(re.search(r"\] test_two.py: 1 skipped \(", line) for line in lines)
    # no letter per test: the progress is the lines, whole
    assert not [line for line in lines if re.fullmatch(r"[.sFE]+", line.strip())]
