"""Session-wide isolation: every test run gets its own store, local cache and kernel
cache, and compiles in-process unless a test (tests/farm) asks for a farm. Under
pytest-xdist each worker gets its own store and local cache (as if it ran alone); the
kernel cache, keyed by content, is the controller's, shared, so a kernel compiles once."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_ROOT = tempfile.mkdtemp(prefix="kiln_tests_")
# Set by this file in xdist's controller, whose environment its workers inherit (not a
# KILN_ name: an unknown KILN_* variable is warned about).
_CONTROLLERS = os.environ.get("TESTS_KILN_SESSION_ROOT")
for _name, _value in (("KILN_STORE", "file://" + os.path.join(_ROOT, "store")),
                      ("KILN_LOCAL_CACHE", os.path.join(_ROOT, "local_cache"))):
    if _CONTROLLERS and _CONTROLLERS in os.environ.get(_name, ""):
        os.environ[_name] = _value
    os.environ.setdefault(_name, _value)
os.environ["TESTS_KILN_SESSION_ROOT"] = _ROOT
os.environ.setdefault("KILN_CACHE_DIR", os.path.join(_ROOT, "cache"))
os.environ.setdefault("KILN_FARM", "inprocess")


import pytest  # noqa: E402
from file_progress import add_option, configure  # noqa: E402


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


def pytest_addoption(parser: pytest.Parser) -> None:
    add_option(parser)


def pytest_configure(config: pytest.Config) -> None:
    configure(config)


# Under pytest-xdist (scripts/test.sh) a unit of work is a test file, as with `--dist
# loadfile`, so that a file's module fixtures are made once; tests/farm is one unit: its
# files share the session's Ray cluster (started once), and its tests, which start Ray
# clusters and time their farms, do not run beside each other. The unit is the longest, so
# it goes first; the other workers fill in with the short files meanwhile.
FARM_UNIT = "tests/farm/"


def unit_of_work(nodeid: str) -> str:
    return FARM_UNIT if nodeid.startswith(FARM_UNIT) else nodeid.split("::", 1)[0]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class FileScheduling(LoadScopeScheduling):
        """xdist's scope scheduling (units handed out in collection order) by file."""

        def _split_scope(self, nodeid: str) -> str:
            return unit_of_work(nodeid)

    return FileScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """In xdist's workers: tests/farm first (see ``unit_of_work``)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: unit_of_work(item.nodeid) != FARM_UNIT)


def pytest_unconfigure(config: pytest.Config) -> None:
    """The session's store, caches and kernel files go with the session: nothing of a
    test run is left in the temp folder."""
    import shutil

    shutil.rmtree(_ROOT, ignore_errors=True)
