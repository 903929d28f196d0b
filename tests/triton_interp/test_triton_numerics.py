"""Every lowering through Triton codegen, run under the interpreter, against eager:
float32, float16, bfloat16 and integers where the op applies; broadcast, non-contiguous
and transposed inputs; persistent and looped reductions."""

from __future__ import annotations

import pytest
import torch

from tests.numerics_cases import (
    ALL_CASES,
    Case,
    case_id,
    case_seed,
    expand_cases,
    is_reduction,
    tolerance,
)
from tests.triton_interp.helpers import assert_matches_eager

CASES = expand_cases(ALL_CASES)


@pytest.mark.parametrize("item", CASES, ids=[case_id(c) for c in CASES])
def test_case_matches_eager(item: tuple[Case, torch.dtype]) -> None:
    case, dtype = item
    torch.manual_seed(case_seed(case))
    args = case.inputs(dtype)
    compiled = assert_matches_eager(case.fn, args, tolerance(dtype, is_reduction(case)))
    assert compiled.kernels or "aten" in compiled.wrapper_source
