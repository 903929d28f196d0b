"""A graph compiled in process compiles its kernels at once (``KILN_KERNEL_THREADS``
threads; Triton's LLVM and ptxas steps release the GIL), with the same artifact as one
after another; one job asked for twice at once compiles once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.compiler import trace
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.runtime.kernel_files import interpreter_active
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.compile import build_request
from kiln.frontend.core.keys import compute_key
from kiln.workers.pipeline import KERNEL_THREADS_ENV, KernelCache, compile_inprocess, kernel_jobs
from tests.unit.test_cubin import SM90, fake_cuda

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


def _model(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.softmax(a * 2, -1), (a + b).sum(0), torch.tanh(b).amax(1), a.mean(1) * 3


def _request() -> object:
    args = fake_cuda([torch.randn(128, 256), torch.randn(128, 256)])
    gm = trace_aten(_model, args)
    return build_request(gm, args, KilnConfig.resolve({"farm": "inprocess"}), target=dict(SM90))


def test_kernels_compile_at_once_with_the_artifact_of_one_after_another(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kcache"))
    request = _request()
    body, key = request.to_bytes(), compute_key(request).key  # type: ignore[attr-defined]
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-a"))
    monkeypatch.setenv(KERNEL_THREADS_ENV, "4")
    with trace.capture() as events:
        parallel = compile_inprocess(body, key, cache=KernelCache())
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-b"))
    monkeypatch.setenv(KERNEL_THREADS_ENV, "1")
    serial = compile_inprocess(body, key, cache=KernelCache())
    assert len(parallel.binaries) >= 3
    assert list(parallel.binaries) == [s.name for s in parallel.kernels]  # kernel order
    for name, binary in serial.binaries.items():
        assert parallel.binaries[name].binary == binary.binary  # the same cubins
        assert parallel.binaries[name].config == binary.config
    assert parallel.wrapper_source == serial.wrapper_source
    assert parallel.configs == serial.configs
    spans = [e for e in events if e["name"] == "kernel compile"]
    assert len(spans) == len(parallel.binaries)
    assert len({e["tid"] for e in spans}) > 1, "every kernel compiled on one thread"
    first_end = min(e["ts"] + e["dur"] for e in spans)
    assert sum(e["ts"] < first_end for e in spans) > 1, "no two kernel compiles overlapped"


def test_one_job_asked_for_at_once_compiles_once(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kcache"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv(KERNEL_THREADS_ENV, "4")
    request = _request()
    compiled = compile_inprocess(request.to_bytes(),  # type: ignore[attr-defined]
                                 compute_key(request).key, cache=KernelCache())
    job = next(iter(kernel_jobs(compiled, dict(SM90)).values()))[0]
    cache = KernelCache()
    binaries = cache.compile_all([job] * 4)
    assert cache.compiles == 1 and cache.hits == 3
    assert all(b is binaries[0] for b in binaries)
