"""An AOT package whose kernels are Triton sources run by Triton's interpreter (CPU
graphs with ``cpu_backend=triton-interpret``): built, written, verified, loaded and
compared with eager on random inputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import kiln
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.client import reset_clients
from kiln.frontend.core.compile import target_for
from kiln.frontend.package.archive import build_package, module_tensors, read_package
from tests import fleet_models


@pytest.mark.parametrize("name, shape", [("sdpa_block", (2, 8, 32)), ("mlp", (5, 16))])
def test_package_round_trip_with_interpreted_triton_kernels(
        name: str, shape: tuple[int, ...], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_STORE", f"file://{tmp_path / 'store'}")
    monkeypatch.setenv("KILN_LOCAL_CACHE", "off")
    monkeypatch.setenv("KILN_STATS_FILE", "off")
    monkeypatch.delenv("KILN_SIGNING_KEY", raising=False)
    reset_clients()
    model = getattr(fleet_models, name)()
    config = KilnConfig.resolve({"cpu_backend": "triton-interpret", "signing_key": "hmac:k"})
    weights = module_tensors(model)
    path = tmp_path / f"{name}.kiln"
    path.write_bytes(build_package(model, [torch.randn(shape)], target=target_for(
        torch.device("cpu")), config=config, weights=weights))
    meta, blobs = read_package(path, signing_key="hmac:k")
    kernels = meta["artifact"]["kernels"]
    assert kernels and all(k["backend"] == "triton" and not k.get("binary")
                           for k in kernels)
    assert all("@triton.jit" in bytes(blobs["graph/" + k["source_blob"]]).decode()
               for k in kernels)
    loaded = kiln.load_package(path, signing_key="hmac:k")
    for seed in (1, 2):
        torch.manual_seed(seed)
        x = torch.randn(shape)
        with torch.no_grad():
            torch.testing.assert_close(loaded(x), fleet_models.__dict__[name]()(x),
                                       rtol=1e-4, atol=1e-4)
    reset_clients()
