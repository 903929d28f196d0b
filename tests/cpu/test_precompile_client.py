"""Precompile, then a client: every graph the client asks for, in the shapes and modes
precompiled, is a hit (counted by the client's own counters through `kiln stats --json`),
and its outputs and gradients match eager. And precompile tells the truth when it could
not store a graph."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import kiln
from kiln.frontend import config as config_module
from kiln.frontend.config import KilnConfigWarning

MODEL = """
import torch


def build_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                               torch.nn.Linear(32, 8), torch.nn.LayerNorm(8))
"""

# A client as a user writes it: one compiled model, called in each shape, under no_grad
# for serving and with backward for training; any eager fallback fails it.
CLIENT = """
import sys, warnings
import torch
import kiln
from model import build_model

warnings.simplefilter("error", kiln.KilnFallbackWarning)
mode = sys.argv[1]
model, reference = build_model(), build_model()
compiled = torch.compile(model, backend="kiln", dynamic=False)
for shape in [(4, 16), (8, 16)]:
    x = torch.randn(*shape)
    if mode == "inference":
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), reference(x), rtol=1e-4, atol=1e-5)
    else:
        compiled(x).square().sum().backward()
        reference(x).square().sum().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5)
        model.zero_grad(); reference.zero_grad()
print("client ok")
"""


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "KILN_STORE": str(tmp_path / "store"), "KILN_FARM": "inprocess",
           "KILN_LOCAL_CACHE": "off", "KILN_CPU_BACKEND": "cpp",
           "KILN_CACHE_DIR": str(tmp_path / "kernels"), "XDG_CACHE_HOME": str(tmp_path / "xdg"),
           "KILN_STATS_FILE": str(tmp_path / "precompile-stats.json")}
    return {**env, **extra}


def _run(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.parametrize("mode", ["inference", "train"])
def test_precompiled_shapes_and_mode_are_all_hits(tmp_path: Path, mode: str) -> None:
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "client.py").write_text(CLIENT)
    env = _env(tmp_path)
    pre = _run(["-m", "kiln.frontend.cli.main", "precompile", "model:build_model", "--shapes",
                "4x16", "8x16", "--mode", mode, "--json"], env, tmp_path)
    assert pre.returncode == 0, pre.stderr[-3000:]
    summary = json.loads(pre.stdout.strip().splitlines()[-1])
    graphs = 2 if mode == "inference" else 4  # forward and backward per shape set
    assert summary["problems"] == [] and summary["eager"] == 0
    assert summary["published"] == summary["graphs"] == graphs
    assert summary["published_bytes"] > 0

    client_env = {**env, "KILN_STATS_FILE": str(tmp_path / "client-stats.json")}
    client = _run(["client.py", mode], client_env, tmp_path)
    assert client.returncode == 0 and "client ok" in client.stdout, client.stderr[-3000:]
    stats = _run(["-m", "kiln.frontend.cli.main", "stats", "--json"], client_env, tmp_path)
    counted = json.loads(stats.stdout)
    assert counted["graphs"] == counted["graph_hits"] == graphs  # 100% hits
    assert (counted["compiles"], counted["load_errors"]) == (0, 0)


def test_precompile_fails_when_a_graph_runs_eagerly(tmp_path: Path) -> None:
    """No C++ compiler: the graph runs eagerly, so nothing is stored; exit 1 naming why."""
    (tmp_path / "model.py").write_text(MODEL)
    env = _env(tmp_path, KILN_CXX=str(tmp_path / "no-such-cxx"))
    pre = _run(["-m", "kiln.frontend.cli.main", "precompile", "model:build_model", "--shapes",
                "4x16"], env, tmp_path)
    assert pre.returncode == 1, pre.stderr[-3000:]
    assert "published 0 artifacts (0 bytes)" in pre.stdout
    assert "1 graph(s) ran eagerly, so nothing was stored for them" in pre.stderr
    assert "no-such-cxx" in pre.stderr and "Traceback" not in pre.stderr


def test_bad_settings_warn_once_and_never_reach_the_program(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """KILN_FARM_TIMEOUT=abc, KILN_AUTOTUNE=banana and a misspelled option: warnings
    naming each, and the model compiles and matches eager."""
    monkeypatch.setattr(config_module, "_warned", set())
    monkeypatch.setenv("KILN_FARM_TIMEOUT", "abc")
    monkeypatch.setenv("KILN_AUTOTUNE", "banana")
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    compiled = torch.compile(model, backend="kiln", options={"cpu_bakend": "cpp"})
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.simplefilter("error", kiln.KilnFallbackWarning)
        out = compiled(x)
    torch.testing.assert_close(out, model(x))
    messages = [str(w.message) for w in caught if w.category is KilnConfigWarning]
    assert any("KILN_FARM_TIMEOUT='abc'" in m and "default 300" in m for m in messages)
    assert any("KILN_AUTOTUNE='banana'" in m and "default 1" in m for m in messages)
    assert any("unknown option 'cpu_bakend' (did you mean cpu_backend?)" in m
               for m in messages)


def test_a_hit_that_fails_to_load_is_a_load_error_not_time_saved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.frontend.config import KilnConfig
    from kiln.frontend.core import compile as kiln_compile
    from kiln.frontend.core.client import client_for, reset_clients

    for name, value in _env(tmp_path, KILN_STATS_FILE="off").items():
        if name.startswith("KILN_"):
            monkeypatch.setenv(name, value)
    reset_clients()
    model, x = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()), torch.randn(4, 8)
    try:
        torch._dynamo.reset()
        with torch.no_grad():
            torch.compile(model, backend="kiln")(x)  # a miss: compiled and published

        def broken_load(*args: object) -> object:
            raise OSError("cannot map the kernel library")

        monkeypatch.setattr(kiln_compile, "load", broken_load)
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            out = torch.compile(model, backend="kiln")(x)  # a hit that does not load
        torch.testing.assert_close(out, model(x))  # eager, loudly
        (fallback,) = [str(w.message) for w in caught if w.category is kiln.KilnFallbackWarning]
        assert "stage load" in fallback and "cannot map the kernel library" in fallback
        counters = client_for(KilnConfig.resolve()).counters.snapshot()
        # The hit fails to load, and so does its repair (a fresh compile): errors, no hit.
        assert counters["load_errors"] >= 1
        assert counters.get("hits", 0) == 0 and counters.get("time_saved_s", 0) == 0
    finally:
        reset_clients()
