"""Background tuning's kernel compiles run in child processes (``workers.compile_procs``),
off the interpreter whose GIL the program's calls need: the same cubins as compiled here,
errors that name their kernel, and this process's threads again where a child dies.

On the H100 host, ViT-B/16's calls took up to 232 ms (3.4 ms steady) while background
tuning compiled 41 candidates on threads of the program's process."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kiln.compiler import trace
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.errors import KilnCompileError
from kiln.compiler.kernel_compile import compile_kernel
from kiln.compiler.runtime.kernel_files import interpreter_active
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.compile import build_request
from kiln.frontend.core.keys import compute_key
from kiln.workers import compile_procs
from kiln.workers.pipeline import KernelCache, compile_inprocess, kernel_jobs
from tests.unit.test_cubin import SM90, fake_cuda

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


def _jobs(tmp_path: Path) -> list[object]:
    def model(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.softmax(a * 2, -1), (a + b).sum(0)

    args = fake_cuda([torch.randn(64, 256), torch.randn(64, 256)])
    request = build_request(trace_aten(model, args), args,
                            KilnConfig.resolve({"farm": "inprocess"}), target=dict(SM90))
    compiled = compile_inprocess(request.to_bytes(), compute_key(request).key,
                                 cache=KernelCache())
    jobs = [job for per_kernel in kernel_jobs(compiled, dict(SM90), autotune=True).values()
            for job in per_kernel]
    assert len(jobs) >= 3
    return jobs


@pytest.fixture
def children(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
             ) -> Iterator[compile_procs.CompileProcesses]:
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-children"))
    pool = compile_procs.CompileProcesses(2)
    monkeypatch.setattr(compile_procs, "_pool", pool)
    monkeypatch.setattr(compile_procs, "_warned", False)
    try:
        yield pool
    finally:
        pool.close()


def test_background_compiles_run_in_children_with_the_same_cubins(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        children: compile_procs.CompileProcesses) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kcache"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-here"))
    jobs = _jobs(tmp_path)
    here = KernelCache().compile_all(jobs)  # the first output's compiles: this process
    with trace.capture() as events, trace.background():
        behind = KernelCache().compile_all(jobs)
    assert children.compiles == len(jobs) and len(children._children) == 2
    spans = [e for e in events if e["name"] == "kernel compile"]
    assert len(spans) == len(jobs)  # one each, in a child: none on this process's threads
    assert all(e["args"].get("child") is True and e["args"].get("background") for e in spans)
    for mine, theirs in zip(here, behind):
        assert theirs.name == mine.name and theirs.config == mine.config
        assert theirs.binary == mine.binary and theirs.binary[:4] == b"\x7fELF"
        assert theirs.metadata["name"] == mine.metadata["name"]


def test_a_kernel_that_does_not_compile_fails_as_it_does_here(
        tmp_path: Path, children: compile_procs.CompileProcesses) -> None:
    job = _jobs(tmp_path)[0]
    broken = replace(job.spec, source=job.spec.source.replace("tl.load", "tl.no_such_op"))
    with pytest.raises(KilnCompileError, match=job.spec.name) as info:
        children.compile(broken, job.config, job.target)
    with pytest.raises(KilnCompileError) as here:  # the same job compiled in this process
        compile_kernel(broken, job.config, job.target)
    assert "no_such_op" in str(info.value)
    assert str(info.value) == str(here.value)  # the same message, the kernel named as here
    assert children.broken is None  # the child lives on
    assert children.compile(job.spec, job.config, job.target).binary[:4] == b"\x7fELF"


def test_a_dead_child_sends_its_jobs_back_to_this_process(
        tmp_path: Path, children: compile_procs.CompileProcesses,
        caplog: pytest.LogCaptureFixture) -> None:
    jobs = _jobs(tmp_path)
    children.compile(jobs[0].spec, jobs[0].config, jobs[0].target)
    for child in children._children:
        child.proc.kill()
        child.proc.wait()
    with caplog.at_level(logging.WARNING, logger="kiln.workers"), trace.background():
        binaries = KernelCache().compile_all(jobs)
    assert all(b.binary[:4] == b"\x7fELF" for b in binaries)
    warnings = [r for r in caplog.records if "go back to this process" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in caplog.records]
    assert children.broken is not None and compile_procs.pool() is None


def test_zero_processes_keeps_the_compiles_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_procs, "_pool", None)
    monkeypatch.setenv(compile_procs.PROCESSES_ENV, "0")
    assert compile_procs.pool() is None
    monkeypatch.setenv(compile_procs.PROCESSES_ENV, "3")
    assert compile_procs.processes() == 3
