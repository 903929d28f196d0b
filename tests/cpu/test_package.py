"""AOT packages on the CPU: `kiln package` writes one file, `kiln.load_package` runs it in
a fresh process with no Dynamo, no AOTAutograd and no compiler, matching eager on random
inputs; digests and signatures refuse damaged or foreign packages; a package for sm_90
is built on this CPU-only host with cubins inside."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kiln
from kiln.compiler.runtime.kernel_files import interpreter_active
from kiln.frontend.core.client import reset_clients
from kiln.frontend.package.archive import PackageError, read_package
from tests import fleet_models

ROOT = Path(__file__).resolve().parents[2]
KEY = "hmac:package-test-secret"

pytestmark = pytest.mark.skipif(interpreter_active(), reason="Triton's interpreter is on")

# Runs in a fresh process: load, run on random inputs, compare with eager, and report
# which heavy modules the load pulled in (beyond what `import torch` imports itself).
LOADER = r"""
import json, sys, time
import torch
before = set(sys.modules)
start = time.perf_counter()
import kiln
from tests import fleet_models
model = kiln.load_package(sys.argv[1], allow_unsigned=True,
                          **({"weights": getattr(fleet_models, sys.argv[2])()}
                             if sys.argv[3] == "given" else {}))
torch.manual_seed(int(sys.argv[4]))
x = torch.randn(*json.loads(sys.argv[5]), dtype=getattr(torch, sys.argv[6]))
out = model(x)
loaded_s = time.perf_counter() - start
heavy = sorted(m for m in set(sys.modules) - before if m.startswith((
    "torch._dynamo", "torch.export", "torch._functorch.aot_autograd", "kiln.compiler.driver",
    "kiln.compiler.graph", "kiln.compiler.scheduler", "kiln.frontend.core.backend")))
with torch.no_grad():
    ref = getattr(fleet_models, sys.argv[2])()(x)
tol = 1e-4 if x.dtype == torch.float32 else 2e-2
torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
print(json.dumps({"heavy": heavy, "loaded_s": loaded_s, "max_err": (out - ref).abs().max().item()}))
"""


@pytest.fixture
def env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    values = {"KILN_STORE": f"file://{tmp_path / 'store'}", "KILN_LOCAL_CACHE": "off",
              "KILN_STATS_FILE": "off", "KILN_FARM": "inprocess"}
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("KILN_SIGNING_KEY", raising=False)
    reset_clients()
    yield values
    reset_clients()


def kiln_cmd(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kiln.frontend.cli.main", *args], cwd=ROOT,
                          env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)


def load_and_compare(path: Path, model: str, shape: list[int], env: dict[str, str],
                     weights: str = "packaged", dtype: str = "float32") -> dict[str, object]:
    result = subprocess.run([sys.executable, "-c", LOADER, str(path), model, weights, "7",
                             json.dumps(shape), dtype], cwd=ROOT,
                            env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


@pytest.mark.parametrize("model", ["block", "sdpa_block"])
def test_round_trip_with_cpp_kernels(model: str, tmp_path: Path, env: dict[str, str]
                                     ) -> None:
    path = tmp_path / f"{model}.kiln"
    built = kiln_cmd(["package", f"tests.fleet_models:{model}", "--shapes", "2x8x32",
                      "--weights", "-o", str(path), "--json"], env)
    assert built.returncode == 0, built.stderr[-3000:]
    assert json.loads(built.stdout)["bytes"] == path.stat().st_size
    meta, blobs = read_package(path, allow_unsigned=True)
    kernels = meta["artifact"]["kernels"]
    assert kernels and all(k["backend"] == "cpp" for k in kernels)
    assert all(bytes(blobs["graph/" + k["binary"]["blob"]])[:4] == b"\x7fELF" for k in kernels)
    assert [kind for kind, _, _ in meta["inputs"]].count("user") == 1
    assert len(meta["weights"]) == len(getattr(fleet_models, model)().state_dict())
    report = load_and_compare(path, model, [2, 8, 32], env)
    assert report["heavy"] == []  # no Dynamo, no export, no AOTAutograd, no compiler


def test_weights_given_at_load(tmp_path: Path, env: dict[str, str]) -> None:
    path = tmp_path / "mlp.kiln"
    built = kiln_cmd(["package", "tests.fleet_models:mlp", "--shapes", "5x16", "-o",
                      str(path)], env)
    assert built.returncode == 0, built.stderr[-3000:]
    # torch.export's own LeafSpec deprecation is not passed on to the user
    assert "FutureWarning" not in built.stderr and "LeafSpec" not in built.stderr
    meta, _ = read_package(path, allow_unsigned=True)
    assert meta["weights"] is None
    load_and_compare(path, "mlp", [5, 16], env, weights="given")
    with pytest.raises(PackageError, match="built without weights"):
        kiln.load_package(path, allow_unsigned=True)
    model = kiln.load_package(path, weights=fleet_models.mlp(), allow_unsigned=True)
    with pytest.raises(ValueError, match=r"expected \(5, 16\) float32"):
        model(torch.randn(6, 16))


def build_signed(tmp_path: Path, env: dict[str, str]) -> Path:
    path = tmp_path / "signed.kiln"
    built = kiln_cmd(["package", "tests.fleet_models:mlp", "--shapes", "5x16", "--weights",
                      "-o", str(path)], {**env, "KILN_SIGNING_KEY": KEY})
    assert built.returncode == 0, built.stderr[-3000:]
    return path


def resign(path: Path, key: str) -> bytes:
    """The package at ``path`` with its manifest signed by ``key`` instead."""
    from kiln.artifact_store import parse_keyring
    from kiln.artifact_store.manifest import decode_manifest, encode_manifest
    from kiln.frontend.package.archive import MAGIC

    data = path.read_bytes()
    start = len(MAGIC) + 8
    length = int.from_bytes(data[len(MAGIC):start], "little")
    record = decode_manifest(data[start:start + length])
    raw = encode_manifest(record.key, record.meta, record.blobs, parse_keyring(key),
                          created=record.created).raw
    return MAGIC + len(raw).to_bytes(8, "little") + raw + data[start + length:]


def test_tampered_and_foreign_packages_are_refused(tmp_path: Path, env: dict[str, str]
                                                   ) -> None:
    path = build_signed(tmp_path, env)
    model = kiln.load_package(path, signing_key=KEY)
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), fleet_models.mlp()(x), rtol=1e-4, atol=1e-4)
    data = bytearray(path.read_bytes())
    wrapper = data.find(b"def call(args)")
    assert wrapper > 0
    data[wrapper:wrapper + 8] = b"def cal2"  # the wrapper's code, changed after signing
    tampered = tmp_path / "tampered.kiln"
    tampered.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="does not match its digest"):
        kiln.load_package(tampered, signing_key=KEY)
    with pytest.raises(PackageError, match="no KILN_SIGNING_KEY is set"):
        kiln.load_package(tampered)  # no key: a signature it cannot check is refused
    with pytest.raises(PackageError, match="signature unknown key"):
        kiln.load_package(path, signing_key="hmac:another-secret")
    data = bytearray(path.read_bytes())
    where = data.find(b"local")  # the manifest's record of how the graph was compiled
    assert 0 < where < 200_000
    data[where:where + 5] = b"lokal"  # still a valid manifest, no longer what was signed
    tampered.write_bytes(bytes(data))
    with pytest.raises(PackageError, match="signature invalid"):
        kiln.load_package(tampered, signing_key=KEY)
    unsigned = tmp_path / "unsigned.kiln"
    assert kiln_cmd(["package", "tests.fleet_models:mlp", "--shapes", "5x16", "--weights",
                     "-o", str(unsigned)], env).returncode == 0
    with pytest.raises(PackageError, match="is unsigned and loading it runs its code"):
        kiln.load_package(unsigned, signing_key=KEY)
    with pytest.raises(PackageError, match="unsigned and loading it runs its code"):
        kiln.load_package(unsigned)
    kiln.load_package(unsigned, allow_unsigned=True)  # asked for: loads
    resigned = tmp_path / "resigned.kiln"  # the attacker's own key: no key configured
    resigned.write_bytes(resign(path, "hmac:attacker"))
    with pytest.raises(PackageError, match="signed by hmac:.* no KILN_SIGNING_KEY"):
        kiln.load_package(resigned)
    with pytest.raises(PackageError, match="signature unknown key"):
        kiln.load_package(resigned, signing_key=KEY)
    truncated = tmp_path / "truncated.kiln"
    truncated.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(PackageError, match="truncated or tampered"):
        kiln.load_package(truncated, signing_key=KEY)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only host's build")
def test_package_for_sm90_built_without_a_gpu(tmp_path: Path, env: dict[str, str]) -> None:
    path = tmp_path / "block_sm90.kiln"
    built = kiln_cmd(["package", "tests.fleet_models:sdpa_block_half", "--shapes", "2x8x32",
                      "--dtype", "float16", "--gpu", "sm_90", "--weights", "-o", str(path)],
                     env)
    assert built.returncode == 0, built.stderr[-3000:]
    meta, blobs = read_package(path, allow_unsigned=True)
    manifest = meta["artifact"]
    assert manifest["target"]["arch"] == 90 and manifest["graph"]["device_type"] == "cuda"
    triton = [k for k in manifest["kernels"] if k["backend"] == "triton"]
    assert triton and all(bytes(blobs["graph/" + k["binary"]["blob"]])[:4] == b"\x7fELF"
                          for k in triton)
    wrapper = bytes(blobs["graph/wrapper.py"]).decode()
    # what an sm_90 GPU runs with this torch (2.11 and later put cuDNN attention first)
    assert "_scaled_dot_product_cudnn_attention" in wrapper
    weights = {name for name, *_ in meta["weights"]}
    assert weights == set(fleet_models.sdpa_block_half().state_dict())
    # loaded on this GPU-less torch: a clear PackageError, not an AssertionError
    with pytest.raises(PackageError, match=r"built for a CUDA GPU sm_90, and this torch has "
                       "no CUDA device"):
        kiln.load_package(path, allow_unsigned=True)  # unsigned: refused before that
