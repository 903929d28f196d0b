"""tests/unit/test_per_program_loads.py's batch-norm gradients, generated for a CUDA
target of 64 SMs (so that 8 channels split 16 ways into persistent parts, each channel's
mean loaded once per program as ``xoffset // 16``) and run under Triton's interpreter on
CPU tensors: both sums equal eager's. Before the fix the interpreter raised Triton's
"Mask argument cannot be block type if pointer argument is not a block"."""

from __future__ import annotations

import torch

from tests.numerics_cases import tolerance
from tests.triton_interp.test_split_reductions import SM16, _compile_for_cuda, _run
from tests.unit.test_per_program_loads import relu_bn_grads


def test_per_program_loads_match_eager() -> None:
    torch.manual_seed(11)
    args = [torch.randn(32, 8, 32, 32) for _ in range(3)] + [torch.randn(8)]
    compiled = _compile_for_cuda(relu_bn_grads, args, dict(SM16, sm_count=64))
    assert "xoffset // 16" in compiled.kernels[0].source
    outs = _run(compiled, args)
    refs = relu_bn_grads(*args)
    tol = tolerance(torch.float32, reduction=True)
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out, ref, atol=tol["atol"], rtol=tol["rtol"])
