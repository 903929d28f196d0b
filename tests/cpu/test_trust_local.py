"""The local disk and the load path as an attacker sees them (issue 14): a poisoned
shared object in the cache, a planted build-cache entry, a cache folder others can
write, a request that names a debug folder, and a signed artifact that does not load.
Each test is the attack; it ran before the fix and is refused (or repaired) now."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from kiln.artifact_store import open_store
from kiln.compiler.request import CompileRequest
from kiln.compiler.runtime import local_cache
from kiln.frontend.core.client import KilnRepairWarning, reset_clients
from kiln.frontend.transports import modes as farm_module
from tests.models import compile_checked

BUILDER_KEY = "hmac:local-builder"


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """A builder's environment: its own store, private cache and signing key."""
    cache = tmp_path / "cache"
    for name, value in {"KILN_STORE": str(tmp_path / "store"), "KILN_LOCAL_CACHE": "off",
                        "KILN_FARM": "inprocess", "KILN_CACHE_DIR": str(cache),
                        "KILN_SIGNING_KEY": BUILDER_KEY, "KILN_CPU_BACKEND": "cpp"}.items():
        monkeypatch.setenv(name, value)
    fresh_process(monkeypatch)
    yield cache
    fresh_process(monkeypatch)


def fresh_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Forget what this process holds in memory (loaded libraries, kernel binaries,
    clients, Dynamo's cache), as a new process would."""
    from kiln.compiler.codegen.cpp import build

    build._loaded.clear()
    monkeypatch.setattr(farm_module, "_farms", {})
    monkeypatch.setattr(local_cache, "_roots", {})
    monkeypatch.setattr(local_cache, "_checked", set())
    reset_clients()
    torch._dynamo.reset()


def model(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a * b).relu() + a.sin()).sum(-1)


def run_checked(fn: Callable[..., torch.Tensor] = model) -> list[warnings.WarningMessage]:
    """Compile with Kiln, compare with eager on fresh inputs; the warnings it gave."""
    return compile_checked(fn, torch.randn(8, 32), torch.randn(8, 32))


CLIENT = """
import json, warnings, torch
from test_trust_local import model
from kiln.frontend.core.fallback import KilnFallbackWarning
args = [torch.randn(8, 32), torch.randn(8, 32)]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = torch.compile(model, backend="kiln")(*args)
print(json.dumps({"close": bool(torch.allclose(out, model(*args), rtol=1.3e-6, atol=1e-5)),
                  "fallbacks": [str(w.message) for w in caught
                                if issubclass(w.category, KilnFallbackWarning)]}))
"""


def run_in_new_process() -> None:
    """``run_checked`` in a fresh interpreter (nothing loaded yet), same environment."""
    here = Path(__file__).resolve().parent  # this module, and the repository (tests.*)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", CLIENT], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result == {"close": True, "fallbacks": []}, proc.stderr[-3000:]


def plant(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Replace ``path`` (a new inode: nothing this process mapped changes)."""
    tmp = path.with_suffix(".planting")
    tmp.write_bytes(data)
    tmp.chmod(mode)
    os.replace(tmp, path)


def exported_kernels(so: Path) -> list[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True,
                         text=True, check=True).stdout
    return [line.split()[-1] for line in out.splitlines() if "cpp_fused" in line]


def poison_library(names: list[str], marker: Path, folder: Path) -> bytes:
    """A shared object exporting ``names`` that only leaves ``marker`` behind."""
    body = "\n".join(f'extern "C" void {name}(...) {{ FILE* f = fopen("{marker}", "w"); '
                     "if (f) fclose(f); }" for name in names)
    src = folder / "poison.cpp"
    src.write_text("#include <cstdio>\n" + body + "\n")
    out = folder / "poison.so"
    subprocess.run(["g++", "-shared", "-fPIC", "-o", str(out), str(src)], check=True)
    return out.read_bytes()


def test_poisoned_loaded_library_is_never_loaded(env: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    run_checked()
    loaded = sorted((env / "cpp" / "loaded").rglob("*.so"))
    assert loaded, "the first run should have loaded its kernels from the cache folder"
    marker = tmp_path / "pwned"
    originals = {}
    for so in loaded:
        originals[so] = so.read_bytes()
        plant(so, poison_library(exported_kernels(so), marker, tmp_path))
    run_in_new_process()  # a signed hit: the library bytes come from the store, checked
    assert not marker.exists(), "the poisoned shared object ran"
    assert all(so.read_bytes() == data for so, data in originals.items())


def test_planted_build_cache_entry_is_neither_loaded_nor_published(
        env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run_checked()
    built = [p for p in (env / "cpp").glob("??/*.so")]
    assert built
    marker = tmp_path / "pwned"
    for so in built:  # planted by someone else: a file others can write
        plant(so, poison_library(exported_kernels(so), marker, tmp_path), 0o666)
    monkeypatch.setenv("KILN_STORE", str(tmp_path / "second-store"))  # a miss: compile
    run_in_new_process()
    assert not marker.exists(), "the planted shared object ran"
    poison = (tmp_path / "poison.so").read_bytes()
    published = [p.read_bytes() for p in (tmp_path / "second-store" / "cas").rglob("*")
                 if p.is_file()]
    assert published and poison not in published, "the planted object was published"


def test_cache_folder_others_can_write_is_not_used(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    shared = tmp_path / "shared-cache"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("KILN_CACHE_DIR", str(shared))
    monkeypatch.setattr(local_cache, "_roots", {})
    with caplog.at_level(logging.WARNING, logger="kiln.runtime"):
        root = local_cache.cache_root()
        assert local_cache.cache_root() == root
    assert root != shared and (root.stat().st_mode & 0o077) == 0
    messages = [r.getMessage() for r in caplog.records if "not using the cache" in
                r.getMessage()]
    assert len(messages) == 1 and "writable by other users" in messages[0]


def test_debug_dir_in_a_request_writes_nothing(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.compiler.decompositions import trace_aten
    from kiln.compiler.keys import compute_key
    from kiln.frontend.core.serialize import make_request
    from kiln.workers.pipeline import compile_inprocess

    monkeypatch.delenv("KILN_DEBUG", raising=False)
    args = [torch.randn(4, 8), torch.randn(4, 8)]
    honest = make_request(trace_aten(model, args), args, options={}, target={"kind": "cpu"})
    evil_dir = tmp_path / "chosen-by-the-caller"
    hostile = CompileRequest(honest.graph, honest.inputs,
                             {"debug": "1", "debug_dir": str(evil_dir), "logs": "output_code"},
                             honest.target, honest.versions)
    compiled = compile_inprocess(hostile.to_bytes(), compute_key(hostile).key)
    assert compiled.kernels and not evil_dir.exists()


BROKEN_WRAPPERS = {
    "SyntaxError": b"def call(args:\n",
    "AttributeError": b"import os\ncall = os.no_such_function\n",
}


@pytest.mark.parametrize("kind", sorted(BROKEN_WRAPPERS))
def test_signed_artifact_that_fails_to_load_is_quarantined_and_rebuilt(
        env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    run_checked()
    store = open_store(signing_key=BUILDER_KEY, stats_file=False)
    # the graph's artifact (kernels shared through the store have entries of their own)
    entries = [store.get(p.name) for p in (tmp_path / "store" / "ac").rglob("*") if p.is_file()]
    (good,) = [a for a in entries if a is not None and "wrapper.py" in a.blobs]
    key = good.key
    broken = dict(good.blobs, **{"wrapper.py": BROKEN_WRAPPERS[kind]})
    assert store.publish(type(good)(key, good.manifest, broken))  # signed: passes checks

    fresh_process(monkeypatch)
    caught = run_checked()
    repairs = [w for w in caught if issubclass(w.category, KilnRepairWarning)]
    assert len(repairs) == 1 and key in str(repairs[0].message)
    assert kind in str(repairs[0].message)
    assert list((tmp_path / "store" / "quarantine").iterdir())
    repaired = open_store(signing_key=BUILDER_KEY, stats_file=False).get(key)
    assert repaired is not None and repaired.blobs["wrapper.py"] == good.blobs["wrapper.py"]

    fresh_process(monkeypatch)
    again = run_checked()  # the republished artifact loads: no warning
    assert not [w for w in again if issubclass(w.category, KilnRepairWarning)]



def test_client_with_the_public_key_compiles_a_miss_but_does_not_publish(
        env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every publishing client held the signing key, so any of them could forge for the
    others. A client holding the public key uses what it compiled and publishes nothing."""
    from kiln.artifact_store import ed25519_available, generate_ed25519_key

    if not ed25519_available():
        pytest.skip("needs cryptography")
    private, public = generate_ed25519_key()
    monkeypatch.setenv("KILN_SIGNING_KEY", public)
    fresh_process(monkeypatch)
    run_checked()
    assert not (tmp_path / "store" / "ac").exists()  # nothing published
    monkeypatch.setenv("KILN_SIGNING_KEY", private)  # a builder (precompile job)
    fresh_process(monkeypatch)
    run_checked()
    assert [p for p in (tmp_path / "store" / "ac").rglob("*") if p.is_file()]
