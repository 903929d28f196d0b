"""Benchmark a kernel's compiled candidate configs on this process's GPU (no Ray here).

Each argument gets a buffer of the storage size the kernel spec records (``arg_bytes``)
and the dtype of its signature: floats random, integers and booleans zero (an index of
zero is in range for every gather, so a candidate cannot fault on its inputs). A
candidate that fails to load or launch is timed as infinity, never chosen.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

from compiler.codegen.kernel_spec import KernelSpec
from compiler.kernel_compile import KernelBinary

log = logging.getLogger("kiln.autotune")

# Test hook: time candidates with a deterministic fake instead of a GPU (plumbing tests).
FAKE_AUTOTUNE_ENV = "KILN_TEST_FAKE_AUTOTUNE"

TRITON_DTYPES = {
    "fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64",
    "i64": "int64", "i32": "int32", "i16": "int16", "i8": "int8", "u8": "uint8",
    "i1": "bool",
}


def fake_autotune() -> bool:
    return os.environ.get(FAKE_AUTOTUNE_ENV, "") == "1"


def fake_timings(binaries: list[KernelBinary]) -> list[float]:
    """Deterministic stand-in: the candidate with the most warps is 'fastest'."""
    return [100.0 / (1 + int(b.config.get("num_warps", 1))) + i * 1e-3
            for i, b in enumerate(binaries)]


def gpu_arch() -> int | None:
    """This process's GPU as an arch number (90 for sm_90); None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def make_args(spec: KernelSpec, device: Any) -> list[Any]:
    """One tensor per pointer argument, sized from the spec, in argument order."""
    import torch

    pointer_types = [t[1:] for t in spec.signature.values() if t.startswith("*")]
    if len(pointer_types) != len(spec.arg_buffers) or len(spec.arg_bytes) != len(
            spec.arg_buffers):
        raise ValueError(f"kernel {spec.name}: argument sizes were not recorded")
    args = []
    for type_name, nbytes in zip(pointer_types, spec.arg_bytes):
        dtype = getattr(torch, TRITON_DTYPES.get(type_name, "float32"))
        numel = max(1, math.ceil(nbytes / max(1, dtype.itemsize)))
        if dtype.is_floating_point:
            args.append(torch.randn(numel, dtype=dtype, device=device))
        else:
            args.append(torch.zeros(numel, dtype=dtype, device=device))
    return args


def time_launcher(run: Any, args: list[Any], *, warmup: int = 3, budget_ms: float = 25.0,
                  max_reps: int = 100) -> float:
    """Median microseconds of ``run(*args)`` by CUDA events, within a time budget."""
    import torch

    for _ in range(warmup):
        run(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run(*args)
    end.record()
    torch.cuda.synchronize()
    first_ms = max(start.elapsed_time(end), 1e-3)
    reps = int(min(max_reps, max(5, budget_ms / first_ms)))
    samples = []
    for _ in range(reps):
        start.record()
        run(*args)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000.0)
    samples.sort()
    return samples[len(samples) // 2]


def benchmark(spec: KernelSpec, binaries: list[KernelBinary]) -> list[float]:
    """Microseconds per candidate on this GPU (infinity where a candidate fails)."""
    if fake_autotune():
        return fake_timings(binaries)
    import torch

    from compiler.runtime.triton_launcher import TritonLauncher

    device = torch.device("cuda", torch.cuda.current_device())
    args = make_args(spec, device)
    timings = []
    for binary in binaries:
        try:
            launcher = TritonLauncher(spec, binary.config, "binary", binary)
            timings.append(time_launcher(launcher.run, args))
        except Exception as e:  # a candidate that does not run is not chosen
            log.warning("kiln autotune: kernel %s config %s failed: %s", spec.name,
                        binary.config, e)
            timings.append(math.inf)
    return timings
