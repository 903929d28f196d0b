"""Benchmark a kernel's compiled candidates on this process's GPU (an ``Autotuner``
actor's work; no Ray here). Scratch buffers and timing are the compiler's own
(``compiler.autotune``): each argument as large as the graph's buffer was, floats random,
integers zero; the median of CUDA-event timings. A candidate that fails to load or launch
is timed as infinity and never chosen.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

from kiln.compiler.codegen.kernel_spec import KernelSpec
from kiln.compiler.ir.template import GemmProblem
from kiln.compiler.kernel_compile import KernelBinary

log = logging.getLogger("kiln.autotune")

# Test hook: time candidates with a deterministic fake instead of a GPU (plumbing tests).
FAKE_AUTOTUNE_ENV = "KILN_TEST_FAKE_AUTOTUNE"


# With the fake: milliseconds each candidate keeps the (fake) GPU busy, a stand-in for
# the time a real benchmark takes (the multi-GPU scheduling tests and bench on CPU).
FAKE_AUTOTUNE_MS_ENV = "KILN_TEST_FAKE_AUTOTUNE_MS"


def fake_autotune() -> bool:
    return os.environ.get(FAKE_AUTOTUNE_ENV, "") == "1"


def fake_gpu_work(candidates: int) -> None:
    """Hold this process for ``KILN_TEST_FAKE_AUTOTUNE_MS`` per candidate (default 0)."""
    import time

    try:
        ms = max(0.0, float(os.environ.get(FAKE_AUTOTUNE_MS_ENV, "0") or 0))
    except ValueError:
        ms = 0.0
    if ms:
        time.sleep(ms * candidates / 1000.0)


def fake_timings(configs: list[dict[str, Any]], sizes: Sequence[int] = ()) -> list[float]:
    """Deterministic stand-in: the candidate with the most warps is 'fastest'; at a size
    (a bucket's launch: ``sizes[0]`` is xnumel), the largest XBLOCK that xnumel fills."""
    def warps(c: dict[str, Any]) -> float:
        return 1.0 / (1 + int(c.get("num_warps", 1)))

    if not sizes:
        return [warps(c) + i * 1e-6 for i, c in enumerate(configs)]
    block = [int(c.get("XBLOCK", 1)) for c in configs]
    return [float(b > sizes[0]) + 1.0 / b + 1e-3 * warps(c) + i * 1e-6
            for i, (b, c) in enumerate(zip(block, configs))]


def gpu_arch() -> int | None:
    """This process's GPU as an arch number (90 for sm_90); None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def benchmark(spec: KernelSpec, binaries: list[KernelBinary], sizes: Sequence[int] = (),
              arg_bytes: Sequence[int] = (), pacer: Any = None) -> list[float]:
    """Milliseconds per candidate on this GPU (infinity where a candidate fails). A kernel
    with dynamic sizes runs at one bucket's launch: its integer ``sizes`` arguments, on
    scratch buffers of ``arg_bytes``. ``pacer``: the GPU runs a program too, and each
    group of launches waits for its turn (``workers.gpu_share``)."""
    if fake_autotune():
        for _ in binaries:  # the fake's GPU time in turns, as a real benchmark's would be
            with pacer.turn() if pacer is not None else contextlib.nullcontext():
                fake_gpu_work(1)
        return fake_timings([b.config for b in binaries], sizes)
    import torch

    from kiln.compiler.autotune import time_candidates

    device = torch.device("cuda", torch.cuda.current_device())
    return time_candidates(spec, binaries, device, sizes, tuple(arg_bytes) or None, pacer)


def fake_gemm_timings(count: int) -> dict[str, Any]:
    """Deterministic stand-in for a GEMM benchmark: the first template config wins."""
    return {"extern_ms": 1.0, "template_ms": [0.9 + 0.01 * i for i in range(count)],
            "round_trip_ms": 0.05}


def benchmark_gemm(problem: GemmProblem, specs: list[KernelSpec],
                   binaries: list[KernelBinary | None], pacer: Any = None) -> dict[str, Any]:
    """Milliseconds of the extern call and of each template config (infinity where one
    fails) for ``problem`` on this GPU, and of a round trip of its output through memory
    (what an unfused epilogue costs the extern call). ``pacer``: the GPU is shared, and
    each timing takes turns (``workers.gpu_share``)."""
    if fake_autotune():
        for _ in range(1 + len(specs)):
            with pacer.turn() if pacer is not None else contextlib.nullcontext():
                fake_gpu_work(1)
        return fake_gemm_timings(len(specs))
    from kiln.compiler.runtime.cudagraphs import GPU_WORK_LOCK

    with GPU_WORK_LOCK:  # never during a CUDA graph capture of this process
        return _benchmark_gemm(problem, specs, binaries, pacer)


def _benchmark_gemm(problem: GemmProblem, specs: list[KernelSpec],
                    binaries: list[KernelBinary | None], pacer: Any = None
                    ) -> dict[str, Any]:
    import torch

    from kiln.compiler.autotune import time_launch, time_sliced
    from kiln.compiler.runtime.triton_launcher import TritonLauncher

    def timed(run: Any, args: list[Any]) -> float:
        return time_launch(run, args) if pacer is None else time_sliced(run, args, pacer)

    device = torch.device("cuda", torch.cuda.current_device())
    a, b, out = gemm_operands(problem, device)
    extern = torch.bmm if problem.op == "bmm" else torch.mm
    ca, cb = a.to(problem.torch_dtype), b.to(problem.torch_dtype)
    with library_precision(problem):
        extern_ms = timed(lambda x, y, o: extern(x, y, out=o), [ca, cb, out])
    expected = out.float()
    template_ms = []
    for spec, binary in zip(specs, binaries):
        try:
            assert binary is not None, "the config did not compile"
            launcher = TritonLauncher(spec, binary.config, "binary", binary)
            out.zero_()
            launcher.run(a, b, out)
            check_product(out, expected, problem)
            template_ms.append(timed(launcher.run, [a, b, out]))
        except Exception as e:  # a config that cannot run here is never chosen
            log.warning("kiln autotune: GEMM template %s config %s failed: %s", spec.name,
                        spec.configs[0], e)
            template_ms.append(math.inf)
    copy = torch.empty_like(out)
    round_trip_ms = timed(lambda src, dst: dst.copy_(src), [out, copy])
    return {"extern_ms": extern_ms, "template_ms": template_ms, "round_trip_ms": round_trip_ms}


@contextlib.contextmanager
def library_precision(problem: GemmProblem) -> Iterator[None]:
    """The library call as the compiled graph makes it: an fp32 product in TF32 exactly
    where the problem allows it (the user's flag, which the problem records), whatever
    this process's own flag says; restored after."""
    import torch

    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    matmul.allow_tf32 = problem.allow_tf32
    try:
        yield
    finally:
        matmul.allow_tf32 = before


def check_product(out: Any, expected: Any, problem: GemmProblem) -> None:
    """A fast config must also be right: its product against the library's (a K-long
    sum in the inputs' precision), else it is never chosen."""
    scale = float(expected.abs().max()) + 1.0
    rel = {"float16": 1e-2, "bfloat16": 5e-2}.get(problem.dtype, 2e-2 if problem.allow_tf32
                                                    else 1e-3)
    error = float((out.float() - expected).abs().max())
    if not error <= rel * scale:
        raise ValueError(f"wrong product: max error {error:.3g} against the library's")


def gemm_operands(problem: GemmProblem, device: Any) -> tuple[Any, Any, Any]:
    """Random operands with the problem's strides and dtypes, and its output."""
    import torch

    p = problem
    from kiln.compiler.ir.template import dtype_from_name

    def make(rows: int, cols: int, stride: tuple[int, int, int], dtype: str) -> Any:
        size, strides = [p.batch, rows, cols], list(stride)
        if p.op != "bmm":
            size, strides = size[1:], strides[1:]
        t = torch.empty_strided(size, strides, dtype=dtype_from_name(dtype), device=device)
        return t.normal_()

    a = make(p.m, p.k, p.a_stride, p.a_dtype)
    b = make(p.k, p.n, p.b_stride, p.b_dtype)
    out = torch.empty(p.out_size(), dtype=p.torch_dtype, device=device)
    return a, b, out
