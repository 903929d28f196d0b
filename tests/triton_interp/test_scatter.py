"""The scatter family's Triton kernels (``tl.atomic_add`` / max / min into an fp32 target
for fp16 and bf16), run under Triton's interpreter against eager."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.scatter_cases import (
    SCATTER_CASES,
    assert_case_matches,
    expand_scatter_cases,
    flat_outputs,
    scatter_case_id,
)
from tests.triton_interp.helpers import compile_fn, run_compiled

CASES = expand_scatter_cases()


@pytest.mark.parametrize("item", CASES, ids=[scatter_case_id(c) for c in CASES])
def test_triton_scatter_matches_eager(item: Any) -> None:
    case, dtype = item
    args = case.inputs(dtype)
    compiled = compile_fn(lambda *a: flat_outputs(case.fn(*a)), args)
    assert "aten." not in compiled.wrapper_source  # no op ran as ATen's kernel
    if case.name != "as_strided_scatter":  # a plain store: the window's elements are unique
        assert any("tl.atomic_" in k.source or "scatter" in k.name for k in compiled.kernels)
    assert_case_matches(case, args, list(run_compiled(compiled, args)), dtype)


def test_bf16_accumulates_in_fp32() -> None:
    case = next(c for c in SCATTER_CASES if c.name == "index_put_accumulate")
    args = case.inputs(torch.bfloat16)
    compiled = compile_fn(case.fn, args)
    assert "dtype=torch.float32" in compiled.wrapper_source.split("buf1")[0]
    scatter = next(k for k in compiled.kernels if "tl.atomic_add(" in k.source)
    assert scatter.name == "triton_poi_fused_exp_scatter_add_1"
    assert ".to(tl.bfloat16)" not in scatter.source.split("tl.atomic_add(")[1]
