"""The looped reduction of tests/unit/test_loop_phase_forwarding.py (a channels-last ReLU
output realized for a matmul, its 7x7 mean, its contiguous copy: two ``for roffset``
loops in one kernel) run under the Triton interpreter at a 48x48 window, so each loop
takes several r blocks: every output equals eager's. Before 4911f1c the second loop
stored the first loop's last r block (the interpreter's Python scoping ran what Triton
refuses to compile) and this failed."""

from __future__ import annotations

import pytest
import torch

from tests.triton_interp.helpers import assert_matches_eager
from tests.unit.test_loop_phase_forwarding import relu_mean_copy

TOL = {torch.float16: {"atol": 1e-2, "rtol": 1e-2}, torch.float32: {"atol": 1e-4, "rtol": 1e-4}}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_two_loop_phases_match_eager(dtype: torch.dtype) -> None:
    torch.manual_seed(5)
    x = torch.randn(2, 16, 48, 48, dtype=dtype).to(memory_format=torch.channels_last)
    w = torch.randn(16, 4, dtype=dtype)
    compiled = assert_matches_eager(relu_mean_copy, [x, w], TOL[dtype])
    assert any(k.source.count("for roffset") == 2 for k in compiled.kernels)
