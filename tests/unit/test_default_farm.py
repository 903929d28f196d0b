"""KILN_FARM=local (the default) never waits for a farm to start: with no farm up it
compiles in process at once, quietly, and uses a farm only once one answers."""

from __future__ import annotations

import json
import socket
import warnings
from pathlib import Path

import pytest
import torch

from kiln.frontend.config import KilnConfig
from kiln.frontend.core.client import KilnClient, KilnFarmWarning
from kiln.frontend.core.compile import build_request
from kiln.frontend.transports.modes import LocalFarm, farm_for
from kiln.workers.farm_api import FarmNotUp


@pytest.fixture(autouse=True)
def private_farm_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "farm.json"
    monkeypatch.setenv("KILN_FARM_FILE", str(path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("KILN_FARM", raising=False)  # the default, not the suite's inprocess
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return path


def _request() -> object:
    from kiln.compiler.decompositions import trace_aten

    x = torch.randn(8, 16)
    gm = trace_aten(lambda a: torch.relu(a * 2 + 1).sum(-1), [x])
    return build_request(gm, [x], KilnConfig.resolve({}))


def test_no_farm_up_compiles_here_at_once_without_a_warning(tmp_path: Path) -> None:
    config = KilnConfig.resolve({"store": str(tmp_path / "store")})
    assert config.farm == "local" and isinstance(farm_for("local"), LocalFarm)
    client = KilnClient(config, farm=LocalFarm())
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFarmWarning)
        results = [client.compile(_request()) for _ in range(2)]  # type: ignore[arg-type]
    assert [r.source for r in results] == ["local", "hit"]
    counters = client.counters.snapshot()
    assert counters["farm_not_up"] == 1 and counters["compiles_local"] == 1
    assert client.farm_down is None  # a farm brought up later serves the next misses


def test_a_farm_file_whose_address_does_not_answer_is_not_up(private_farm_file: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        private_farm_file.write_text(json.dumps({"address": f"127.0.0.1:{port}"}))
        farm = LocalFarm()
        assert farm.address() is None
        with pytest.raises(FarmNotUp, match="kiln farm up"):
            farm.ray_farm()
        sock.listen()
        farm._checked = -1e9  # the next check (every LOCAL_RECHECK_S) sees it answer
        assert farm.address() == f"127.0.0.1:{port}"
