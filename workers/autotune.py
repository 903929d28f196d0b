"""Benchmark a kernel's compiled candidates on this process's GPU (an ``Autotuner``
actor's work; no Ray here). Scratch buffers and timing are the compiler's own
(``compiler.autotune``): each argument as large as the graph's buffer was, floats random,
integers zero; the median of CUDA-event timings. A candidate that fails to load or launch
is timed as infinity and never chosen.
"""

from __future__ import annotations

import logging
import math
import os

from kiln.compiler.codegen.kernel_spec import KernelSpec
from kiln.compiler.kernel_compile import KernelBinary

log = logging.getLogger("kiln.autotune")

# Test hook: time candidates with a deterministic fake instead of a GPU (plumbing tests).
FAKE_AUTOTUNE_ENV = "KILN_TEST_FAKE_AUTOTUNE"


def fake_autotune() -> bool:
    return os.environ.get(FAKE_AUTOTUNE_ENV, "") == "1"


def fake_timings(binaries: list[KernelBinary]) -> list[float]:
    """Deterministic stand-in: the candidate with the most warps is 'fastest'."""
    return [1.0 / (1 + int(b.config.get("num_warps", 1))) + i * 1e-6
            for i, b in enumerate(binaries)]


def gpu_arch() -> int | None:
    """This process's GPU as an arch number (90 for sm_90); None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor


def benchmark(spec: KernelSpec, binaries: list[KernelBinary]) -> list[float]:
    """Milliseconds per candidate on this GPU (infinity where a candidate fails)."""
    if fake_autotune():
        return fake_timings(binaries)
    import torch

    from kiln.compiler.autotune import scratch_args, time_launch
    from kiln.compiler.runtime.triton_launcher import TritonLauncher

    device = torch.device("cuda", torch.cuda.current_device())
    args = scratch_args(spec, device)
    timings = []
    for binary in binaries:
        try:
            launcher = TritonLauncher(spec, binary.config, "binary", binary)
            timings.append(time_launch(launcher.run, args))
        except Exception as e:  # a candidate that does not run (resources) is not chosen
            log.warning("kiln autotune: kernel %s config %s failed: %s", spec.name,
                        binary.config, e)
            timings.append(math.inf)
    return timings
