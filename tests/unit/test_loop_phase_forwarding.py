"""A looped reduction's later ``for roffset`` phase never reuses a value made inside an
earlier loop (it exists only there, one r block of it): it loads the stored buffer. The
H200 (2026-12-02 10:25, ResNet-50's training forward under fp16 autocast) failed at
kernel compile with ``NameError('tmp20 is not defined')``: a ReLU output stored in the
mean's loop was copied (to eager's strides) in the next loop from the first loop's
register. The kernel here has the same shape (a channels-last ReLU output realized for a
matmul, its 7x7 mean, then its contiguous copy), generated with Triton codegen from CPU
tensors and compiled for sm_90."""

from __future__ import annotations

import re

import pytest
import torch

from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.kernel_compile import compile_kernel
from kiln.compiler.runtime.kernel_files import interpreter_active
from tests.targets import SM90


def relu_mean_copy(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
    y = torch.relu(x * 2.0 + 0.5)
    z = y.permute(0, 2, 3, 1).reshape(-1, x.shape[1]) @ w  # y realized, channels-last
    return y.mean((2, 3)), z, y.contiguous()


def _looped_kernel() -> tuple[str, object]:
    x = torch.randn(8, 64, 7, 7).to(memory_format=torch.channels_last)
    w = torch.randn(64, 4)
    compiled = compile_graph(trace_aten(relu_mean_copy, [x, w]), [x, w],
                             {"cpu_backend": "triton-interpret"}, compile_kernels=False)
    spec = next(k for k in compiled.kernels if k.source.count("for roffset") == 2)
    return spec.source, spec


def test_a_later_loop_loads_what_an_earlier_loop_stored() -> None:
    source, _ = _looped_kernel()
    first, second = source.split("for roffset")[1:]
    stored = re.findall(r"tl\.store\((out_ptr\d+) \+ \(.*\), (tmp\d+), xmask & rmask\)",
                        first)
    assert stored, first
    ptr, value = stored[0]
    # The second loop reads that buffer from memory, never the first loop's register.
    assert not re.search(rf"\b{value}\b", second), second
    assert f"tl.load({ptr} + " in second


@pytest.mark.skipif(interpreter_active(), reason="Triton was imported for its interpreter")
def test_the_kernel_compiles_for_sm90() -> None:
    _, spec = _looped_kernel()
    binary = compile_kernel(spec, dict(spec.configs[0]), SM90)  # type: ignore[arg-type]
    assert binary.binary[:4] == b"\x7fELF"
