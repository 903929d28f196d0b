"""A user's program whose store sits on a disk that is full (a real small file system,
tests/smallfs.py): the graph compiles here and runs, matching eager, with one warning
from the store and no fallback to eager; nothing is published. Once space returns, the
next process publishes."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

from kiln.artifact_store import open_store
from kiln.frontend.core.client import reset_clients

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.models import compile_checked  # noqa: E402
from tests.smallfs import SmallFilesystem, small_filesystem_problem  # noqa: E402

KEY = "hmac:disk-full-builder"


def model(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a * b).relu() + a.cos()).sum(-1)


def compile_and_check() -> None:
    compile_checked(model, torch.randn(8, 32), torch.randn(8, 32))


def store_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith("kiln.artifact_store") and r.levelno >= logging.WARNING]


def test_program_runs_on_while_the_store_disk_is_full(
        kiln_isolated: None, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    problem = small_filesystem_problem()
    if problem is not None:
        pytest.skip(f"no small file system to fill: {problem}")
    with SmallFilesystem(8 << 20) as disk:
        url = f"file://{disk.path}/store"
        monkeypatch.setenv("KILN_STORE", url)
        monkeypatch.setenv("KILN_SIGNING_KEY", KEY)
        reset_clients()
        disk.fill()
        compile_and_check()
        said = store_warnings(caplog)
        assert len(said) == 1 and "is full" in said[0] and "No space left" in said[0], said
        assert open_store(url, signing_key=KEY, stats_file=False).keys() == []
        disk.free()  # space returns; the next process publishes what it compiles
        reset_clients()
        torch._dynamo.reset()
        caplog.clear()
        compile_and_check()
        assert store_warnings(caplog) == []
        assert len(open_store(url, signing_key=KEY, stats_file=False).keys()) >= 1
