"""Kernels shared across graphs and models through the store, by content key (source,
config, target, versions): a second model that reuses a kernel compiles nothing for it,
even in another client with an empty kernel cache (a new process, a new machine)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.compiler.decompositions import trace_aten
from kiln.compiler.runtime.kernel_files import interpreter_active
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.client import KilnClient
from kiln.frontend.core.compile import build_request
from kiln.frontend.transports.inprocess import InProcessFarm
from kiln.workers.kernel_store import KernelStore, kernel_store_key
from kiln.workers.pipeline import KernelJob, kernel_jobs
from tests.unit.test_cubin import SM90, fake_cuda

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


def _request(config: KilnConfig, fn: Any) -> Any:
    args = fake_cuda([torch.randn(32, 64), torch.randn(32, 64)])
    return build_request(trace_aten(fn, args), args, config, target=dict(SM90))


def model_a(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (torch.softmax(x * 2, -1),)


def model_b(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.softmax(x * 2, -1), (y.cos() + 1).sum(0)  # model A's kernel, and another


def _client(store: Path) -> KilnClient:
    config = KilnConfig.resolve({"store": str(store), "farm": "inprocess"})
    return KilnClient(config, farm=InProcessFarm())


def test_a_second_model_compiles_nothing_for_a_kernel_the_first_compiled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kcache"))
    first = _client(tmp_path / "store")
    a = first.compile(_request(first.config, model_a))
    assert first.counters.snapshot()["kernels_compiled"] == len(a.compiled.binaries) == 1
    # Another client (an empty kernel cache: another process) and another model.
    second = _client(tmp_path / "store")
    b = second.compile(_request(second.config, model_b))
    assert b.source == "local" and len(b.compiled.binaries) == 2
    counters = second.counters.snapshot()
    assert counters["kernels_from_store"] == 1 and counters["kernels_compiled"] == 1
    shared = next(iter(a.compiled.binaries))
    assert b.compiled.binaries[shared].binary == a.compiled.binaries[shared].binary
    stats = second.store.stats()
    assert stats["hits"] == 0 and stats["kernel_hits"] == 1  # not counted as graph hits
    assert second.local.kernels.store_hits == 1


def test_stored_kernels_are_checked_against_the_job(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kcache"))
    client = _client(tmp_path / "store")
    result = client.compile(_request(client.config, model_b))
    jobs = kernel_jobs(result.compiled, dict(SM90))
    names = list(jobs)
    kernels = KernelStore(client.store)
    job0, job1 = jobs[names[0]][0], jobs[names[1]][0]
    assert kernels.get(job0) is not None
    # A manifest stored under one job's key that holds another job's binary is a miss.
    kernels.put(job1, result.compiled.binaries[names[0]])  # under job1's key, wrong kernel
    assert kernels.get(job1) is None
    other_target = KernelJob(job0.spec, job0.config, {**SM90, "arch": 80})
    assert kernel_store_key(other_target) != kernel_store_key(job0)
    assert kernels.get(other_target) is None
