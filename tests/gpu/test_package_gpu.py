"""On the GPU host: what a host without a GPU built is used here.

- ``kiln precompile --gpu h200`` run with no visible GPU (``CUDA_VISIBLE_DEVICES=``) fills
  a store; a client on this GPU then hits every graph (keys equal, attention included:
  the precompile models the fused kernel this GPU picks).
- ``kiln package --gpu sm_90`` built with no visible GPU loads here, runs its cubins and
  matches eager on random inputs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import kiln
from kiln.frontend.core import compile as kiln_compile
from kiln.frontend.core.client import reset_clients
from kiln.frontend.core.fallback import KilnFallbackWarning
from tests import fleet_models

ROOT = Path(__file__).resolve().parents[2]
CASES = [("mlp", (64, 16), torch.float32), ("block", (4, 16, 32), torch.float32),
         ("block_half", (4, 16, 32), torch.float16),
         ("sdpa_block_half", (4, 16, 32), torch.float16),
         ("sdpa_block", (4, 16, 32), torch.float32)]


def without_gpu(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``kiln ARGS`` in a process that sees no GPU, as on a CPU-only CI runner."""
    return subprocess.run([sys.executable, "-m", "kiln.frontend.cli.main", *args], cwd=ROOT,
                          env={**os.environ, **env, "PYTHONPATH": str(ROOT),
                               "CUDA_VISIBLE_DEVICES": ""},
                          capture_output=True, text=True, timeout=600)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    env = {"KILN_STORE": f"file://{tmp_path / 'store'}", "KILN_LOCAL_CACHE": "off",
           "KILN_STATS_FILE": "off", "KILN_FARM": "inprocess"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    reset_clients()
    yield env
    reset_clients()


def shape_text(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape))


@pytest.mark.gpu
@pytest.mark.parametrize("name, shape, dtype", CASES, ids=[c[0] for c in CASES])
def test_gpu_client_hits_every_graph_precompiled_without_a_gpu(
        name: str, shape: tuple[int, ...], dtype: torch.dtype, store: dict[str, str]) -> None:
    result = without_gpu(["precompile", f"tests.fleet_models:{name}", "--gpu", "h200",
                          "--shapes", shape_text(shape), "--dtype",
                          str(dtype).removeprefix("torch."), "--json"], store)
    assert result.returncode == 0, result.stderr[-3000:]
    precompiled = [r["key"] for r in json.loads(result.stdout)["records"]]
    seen: list[Any] = []
    kiln_compile.observers.append(lambda graph, res: seen.append(res))
    torch._dynamo.reset()
    model = getattr(fleet_models, name)().cuda()
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("error", KilnFallbackWarning)
            out = torch.compile(model, backend="kiln", dynamic=False)(x)
            ref = model(x)
    finally:
        kiln_compile.observers.clear()
    tol = 2e-2 if dtype == torch.float16 else 1e-3
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    assert [r.key.key for r in seen] == precompiled
    assert [r.source for r in seen] == ["hit"] * len(precompiled)


@pytest.mark.gpu
@pytest.mark.parametrize("name, shape, dtype", CASES, ids=[c[0] for c in CASES])
def test_package_built_without_a_gpu_matches_eager(
        name: str, shape: tuple[int, ...], dtype: torch.dtype, store: dict[str, str],
        tmp_path: Path) -> None:
    path = tmp_path / f"{name}.kiln"
    result = without_gpu(["package", f"tests.fleet_models:{name}", "--gpu", "sm_90",
                          "--shapes", shape_text(shape), "--dtype",
                          str(dtype).removeprefix("torch."), "--weights", "-o", str(path)],
                         store)
    assert result.returncode == 0, result.stderr[-3000:]
    model = kiln.load_package(path, allow_unsigned=True)
    reference = getattr(fleet_models, name)().cuda()
    tol = 2e-2 if dtype == torch.float16 else 1e-3
    for seed in (0, 1):
        torch.manual_seed(seed)
        x = torch.randn(*shape, device="cuda", dtype=dtype)
        with torch.no_grad():
            torch.testing.assert_close(model(x), reference(x), rtol=tol, atol=tol)
