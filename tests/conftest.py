"""Session-wide isolation: every test run gets its own store, local cache and kernel
cache, and compiles in-process unless a test (tests/farm) asks for a farm."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

_ROOT = tempfile.mkdtemp(prefix="kiln_tests_")
os.environ.setdefault("KILN_STORE", "file://" + os.path.join(_ROOT, "store"))
os.environ.setdefault("KILN_LOCAL_CACHE", os.path.join(_ROOT, "local_cache"))
os.environ.setdefault("KILN_CACHE_DIR", os.path.join(_ROOT, "cache"))
os.environ.setdefault("KILN_FARM", "inprocess")


import pytest  # noqa: E402


def _torchvision_importable() -> None:
    """The dev environment's torchvision is PyPI's CUDA build (scripts/setup.sh): next to a
    CPU-only torch its native half does not load, and every later ``import torchvision``,
    from timm or transformers too, raises. Its Python half is made importable once, here,
    before any test imports those (bench/suite/tv_shim.py: the repository root is on the
    path through pyproject's pytest pythonpath); a torchvision that loads, or none at all,
    is left as it is."""
    try:
        from bench.suite.tv_shim import ensure_torchvision

        ensure_torchvision()
    except ImportError:  # no torchvision here: the tests that need it skip
        pass


_torchvision_importable()


@pytest.fixture
def kiln_isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    """No KILN_* settings from the shell; a fresh store; no stats file; compiles in this
    process. The kernel cache (under the user cache folder) is kept, so kernels compile
    once. Shared by tests/cpu and tests/triton_interp."""
    import torch

    from kiln.frontend.core.client import reset_clients

    for name in [n for n in os.environ if n.startswith("KILN_")]:
        if name != "KILN_CACHE_DIR":
            monkeypatch.delenv(name)
    monkeypatch.setenv("KILN_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("KILN_LOCAL_CACHE", "off")
    monkeypatch.setenv("KILN_FARM", "inprocess")
    monkeypatch.setenv("KILN_STATS_FILE", "off")
    reset_clients()
    torch._dynamo.reset()
    yield
    reset_clients()


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's store, caches and kernel files go with the session: nothing of a
    test run is left in the temp folder."""
    import shutil

    shutil.rmtree(_ROOT, ignore_errors=True)
