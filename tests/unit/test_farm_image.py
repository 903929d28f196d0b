"""The farm image (infra/Dockerfile) builds from what it copies: the files its COPY lines
name install as a wheel with the extras its `pip install` asks for, and those extras
exist. `docker build` itself runs only where docker is installed (it pulls a CUDA base)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "infra" / "Dockerfile"


def _copies() -> list[str]:
    """The repository paths the image's COPY lines take from the build context."""
    found = []
    for line in DOCKERFILE.read_text().splitlines():
        match = re.match(r"^COPY\s+(?!--from)(.+)$", line.strip())
        if match:
            found += match.group(1).split()[:-1]  # the last word is the destination
    return found


def _extras() -> set[str]:
    (spec,) = re.findall(r'pip install "\.\[([^\]]*)\]"', DOCKERFILE.read_text())
    return {name.strip() for name in spec.split(",")}


def test_the_image_installs_the_extras_a_farm_needs() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = _extras()
    assert {"s3", "sign"} <= extras  # an s3:// store; ed25519 keys need cryptography
    assert extras <= set(project["optional-dependencies"])


def test_the_files_the_image_copies_build_a_complete_wheel(tmp_path: Path) -> None:
    context = tmp_path / "context"
    context.mkdir()
    for name in _copies():
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, context / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(source, context / name)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                            "--no-build-isolation", "-q", "-w", str(tmp_path / "out"),
                            str(context)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "out").glob("kiln-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for package in project["tool"]["setuptools"]["packages"]:  # every package, with code
        folder = package.replace(".", "/") + "/"
        assert any(n.startswith(folder) and n.endswith(".py") for n in names), package
    for module in ("kiln/frontend/cli/main.py", "kiln/compiler/versions.py",
                   "kiln/workers/serve/gateway.py", "kiln/artifact_store/store.py"):
        assert module in names


def _docker_runs() -> bool:
    if shutil.which("docker") is None:
        return False
    return subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0


def test_docker_builds_the_image() -> None:
    if not _docker_runs():
        pytest.skip("no docker daemon here")
    built = subprocess.run(["docker", "build", "-f", str(DOCKERFILE), "-t",
                            "kiln-farm:test", str(ROOT)], capture_output=True, text=True,
                           timeout=3600)
    assert built.returncode == 0, built.stderr[-3000:]
