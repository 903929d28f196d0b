"""The graph stage of a training step's backward, alone and beside background tuning's
candidate compiles, with and without ``workers.foreground``'s gate (CPU only: the
candidates are Triton kernels cross-compiled for sm_90, the graph the encoder's backward
from bench/coldstart_models.py at smoke sizes). On the H200 host (2026-12-02 09:40) the
forward's tuning ran beside the backward's compile: the backward's request took 1.59 s to
decode against 0.10 s for the forward. Tuning's compiles run in child processes
(``workers.compile_procs``) or, for comparison, on threads of this process. Seconds of
wall time, so a shared machine's load shows in them: compare rows of one run.

    python3 bench/tuning_contention.py [--repeat 2]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

SM90 = {"kind": "cuda", "backend": "cuda", "arch": 90, "warp_size": 32, "sm_count": 132}


def backward_request() -> tuple[bytes, str]:
    """The encoder training step's backward request, as the client sends it (the step
    fails on ``KilnFallbackWarning`` and is compared with eager's)."""
    import warnings

    from coldstart_models import MODELS, max_error

    import kiln.workers.pipeline as pipeline
    from kiln import KilnFallbackWarning

    seen: list[tuple[bytes, str]] = []
    original = pipeline.compile_sources

    def spy(request_bytes: bytes, key: str, **kwargs: Any) -> Any:
        seen.append((request_bytes, key))
        return original(request_bytes, key, **kwargs)

    pipeline.compile_sources = spy  # type: ignore[assignment]
    try:
        case = MODELS["encoder_train"]("cpu", True)
        ref = case.step(case.module)
        with warnings.catch_warnings():
            warnings.simplefilter("error", KilnFallbackWarning)  # eager is not Kiln's
            got = case.step(torch.compile(case.module, backend="kiln"))
    finally:
        pipeline.compile_sources = original  # type: ignore[assignment]
    ok, worst = max_error(got, ref, case.tol)
    if not ok:
        raise SystemExit(f"the compiled step differs from eager (scaled error {worst:.2f})")
    return seen[-1]


def candidate_jobs() -> list[Any]:
    """Every candidate config of a few kernels, for sm_90."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kiln.compiler.decompositions import trace_aten
    from kiln.frontend.config import KilnConfig
    from kiln.frontend.core.compile import build_request
    from kiln.frontend.core.keys import compute_key
    from kiln.workers.pipeline import KernelCache, compile_inprocess, kernel_jobs

    def model(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (torch.softmax(a * 2, -1), (a + b).sum(0), torch.tanh(b).amax(1),
                torch.nn.functional.gelu(a) * b, (a - b).pow(2).mean(-1))

    with FakeTensorMode():
        args = [torch.empty(256, 512, device="cuda") for _ in range(2)]
    request = build_request(trace_aten(model, args), args,
                            KilnConfig.resolve({"farm": "inprocess"}), target=dict(SM90))
    compiled = compile_inprocess(request.to_bytes(), compute_key(request).key,
                                 cache=KernelCache())
    return [job for group in kernel_jobs(compiled, dict(SM90), autotune=True).values()
            for job in group]


def tune(jobs: list[Any]) -> None:
    from kiln.compiler import trace
    from kiln.workers.pipeline import KernelCache

    with trace.background():
        KernelCache().compile_all(jobs)


def row(body: bytes, key: str, jobs: list[Any] | None, gated: bool, children: bool = True
        ) -> float:
    """Seconds of the backward's graph stage; tuning started 0.3 s before it (after the
    forward's first call), the backward announced as ``aot_kiln`` does when ``gated``;
    tuning's compiles in child processes (``workers.compile_procs``) or, without
    ``children``, on threads of this process."""
    from kiln.workers import compile_procs, foreground
    from kiln.workers.pipeline import compile_sources

    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kiln-contention-")
    compile_procs.shutdown()  # started again (or not) with this row's setting
    os.environ[compile_procs.PROCESSES_ENV] = "" if children else "0"
    if children and jobs:  # the child's start (its imports) before the clock
        compile_procs.compile_in_child(jobs[0].spec, jobs[0].config, jobs[0].target)
    gc.collect()  # no row pays for the garbage of the one before
    if gated:
        foreground.expect("backward_bench")
    helper = threading.Thread(target=tune, args=(jobs,)) if jobs else None
    if helper is not None:
        helper.start()
        time.sleep(0.3)
    start = time.perf_counter()
    with foreground.compiling("backward_bench") if gated else contextlib.nullcontext():
        compile_sources(body, key)
    seconds = time.perf_counter() - start
    if helper is not None:
        helper.join()
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("KILN_FARM", "inprocess")
    os.environ.setdefault("KILN_STORE", tempfile.mkdtemp(prefix="kiln-contention-store-"))
    os.environ.setdefault("KILN_KERNEL_THREADS", "2")
    body, key = backward_request()
    jobs = candidate_jobs()
    print(f"{len(jobs)} candidate compiles; kernel threads {os.environ['KILN_KERNEL_THREADS']}")
    for _ in range(args.repeat):
        for label, tuning, gated, children in (
                ("alone", False, False, True),
                ("beside tuning, threads", True, False, False),
                ("beside tuning, children", True, False, True),
                ("beside tuning, gated", True, True, True)):
            seconds = row(body, key, jobs if tuning else None, gated, children)
            print(f"  {label:25s} backward graph stage {seconds:6.2f} s", flush=True)


if __name__ == "__main__":
    main()
