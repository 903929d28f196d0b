"""Ray's side of the farm's steps: warm compile actors, warm kernel workers, GPU
autotuners. Each is a thin shell over ``workers.pipeline`` / ``workers.autotune``.

Resources: a ``CompileWorker`` reserves no CPU (it runs one graph at a time and is idle
while its kernels compile); the coordinator keeps one ``KernelWorker`` per CPU of the
cluster and lends each to one kernel compile at a time, the part that fans out. An
``Autotuner`` holds one GPU for its lifetime, and no CPU.
"""

from __future__ import annotations

import os
from typing import Any

import ray

from kiln.compiler import trace
from kiln.compiler.codegen.kernel_spec import KernelSpec
from kiln.compiler.ir.template import GemmProblem
from kiln.compiler.kernel_compile import KernelBinary

from . import autotune
from .pipeline import (
    CompileFailure,
    FarmVersionMismatch,
    compile_sources,
    run_kernel_job,
    warm_up,
)


def _warm_compiler() -> None:
    """Imports, and one tiny graph through every stage, once per process."""
    warm_up()


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=3)
class CompileWorker:
    """Runs stages 1 to 6 of the compiler for one request at a time (kernel sources).

    ``max_restarts`` and ``max_task_retries``: a worker killed mid-compile is restarted
    and the compile it was running is retried on it; compile errors are not retried."""

    def __init__(self) -> None:
        self.compiles = 0

    def warm(self) -> int:
        _warm_compiler()
        return os.getpid()

    def pid(self) -> int:
        return os.getpid()

    def compile_sources(self, request_bytes: bytes, key: str, delay: float = 0.0,
                        traced: bool = False, extra_options: dict[str, Any] | None = None
                        ) -> dict[str, Any]:
        """``extra_options``: the matmul choices of max-autotune (not part of the key)."""
        self.compiles += 1
        trace.set_process_name("compile worker")
        try:
            with trace.capture(traced) as events:
                result = compile_sources(request_bytes, key, delay=delay,
                                         extra_options=extra_options).to_dict()
            if traced:
                result["trace"] = events
            return result
        except FarmVersionMismatch:
            raise
        except Exception as e:  # sent back as data: compiler errors do not unpickle
            raise CompileFailure.wrap(e, key) from None


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=3)
class KernelWorker:
    """Compiles kernels, one job at a time (the coordinator's pool lends it to one), in a
    process warmed once: imports and Triton's first compile.

    An actor, not a task: Ray's task processes belong to the job that started them, and
    the job of `kiln farm up` ends once the farm is warm, taking its warm task processes
    with it, so a farm's first request started new ones (6.3 s on the H200 host) whose
    kernels each paid Triton's start-up. Actors the coordinator owns live as long as it
    does. ``num_cpus=0`` as for ``CompileWorker``: the pool, with one worker per CPU of
    the cluster, is what bounds how many compile at once (and a second coordinator on the
    same cluster, as in the tests, still finds room). ``max_task_retries``: a compile
    whose process died runs again on the restarted worker."""

    def warm(self) -> int:
        _warm_compiler()
        return os.getpid()

    def pid(self) -> int:
        return os.getpid()

    def compile(self, spec: dict[str, Any], config: dict[str, Any], target: dict[str, Any],
                traced: bool = False) -> dict[str, Any]:
        """One kernel, one config, one target: the farm's unit of fan-out. ``traced``:
        the result's ``trace`` holds its span."""
        trace.set_process_name("kernel worker")
        try:
            with trace.capture(traced) as events:
                result = run_kernel_job(spec, config, target)
            if traced:
                result["trace"] = events
            return result
        except Exception as e:
            raise CompileFailure.wrap(e, "") from None


@ray.remote(num_gpus=1, num_cpus=0, max_restarts=-1, max_task_retries=1)
class Autotuner:
    """Benchmarks a kernel's candidate binaries on the GPU Ray gives it.

    ``num_cpus=0``: an actor reserves a CPU by default, so a farm with as many GPUs as
    CPUs had none left for the kernel compiles its benchmarks wait on (a deadlock), and
    eight GPUs of a 16-core host would take half the cores from compiling."""

    def arch(self) -> int | None:
        """The GPU's arch number (90 for sm_90); -1 matches any target under the fake
        benchmark of the tests; None without a usable GPU."""
        if autotune.fake_autotune():
            return -1
        return autotune.gpu_arch()

    def describe(self) -> dict[str, Any]:
        """The arch, this process, and the GPU ids Ray bound this actor to (one each:
        real GPUs, or the fake ones of a ``--num-gpus`` on a CPU machine)."""
        trace.set_process_name("GPU autotuner")
        return {"arch": self.arch(), "pid": os.getpid(),
                "gpu_ids": [str(g) for g in ray.get_gpu_ids()]}

    def benchmark(self, spec: dict[str, Any], binaries: list[dict[str, Any]]) -> list[float]:
        """Each candidate's milliseconds; in turns (``workers.gpu_share.DutyCycle``) while
        another process computes on this GPU (a client beside a one-GPU farm)."""
        from . import gpu_share

        return autotune.benchmark(KernelSpec.from_dict(spec),
                                  [KernelBinary.from_dict(b) for b in binaries],
                                  pacer=gpu_share.farm_pacer())

    def share_stats(self) -> dict[str, Any]:
        """What pacing on a shared GPU did (``kiln stats``): turns and their time."""
        from . import gpu_share

        return gpu_share.farm_stats()

    def benchmark_gemm(self, problem: dict[str, Any], specs: list[dict[str, Any]],
                       binaries: list[dict[str, Any] | None]) -> dict[str, Any]:
        """The extern call and each template config of one matmul problem, timed."""
        from . import gpu_share

        return autotune.benchmark_gemm(
            GemmProblem.from_dict(problem), [KernelSpec.from_dict(s) for s in specs],
            [None if b is None else KernelBinary.from_dict(b) for b in binaries],
            pacer=gpu_share.farm_pacer())
