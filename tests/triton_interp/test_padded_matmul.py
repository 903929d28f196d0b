"""Matmul row padding at a small stand-in shape (GPT-2's lm_head, vocabulary 1001), with
the padding rule forced on CPU (it is a GPU decision): a product the graph returns as it
is stays unpadded (no kernel, eager's strides); one read inside is padded and its readers
see the same values as eager's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kiln.compiler.lowering import extern_ops
from tests.triton_interp.helpers import assert_matches_eager

TOL = {torch.float16: {"atol": 1e-2, "rtol": 1e-2}, torch.float32: {"atol": 1e-4, "rtol": 1e-4}}


@pytest.fixture(autouse=True)
def _pad_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(extern_ops, "_row_padding", extern_ops._aligned_row_multiple)
    monkeypatch.setattr(extern_ops, "PAD_MIN_ELEMENTS", 0)


def _lm_head(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w)


def _lm_head_softmax(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w).float().softmax(-1)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("fn", "padded"), [(_lm_head, False), (_lm_head_softmax, True)])
def test_padding_only_where_the_product_is_read_inside(
        dtype: torch.dtype, fn: Callable[..., Any], padded: bool) -> None:
    args = [torch.randn(2, 24, 64, dtype=dtype), torch.randn(1001, 64, dtype=dtype)]
    compiled = assert_matches_eager(fn, args, TOL[dtype])
    pads = [k.name for k in compiled.kernels if "ge_logical_and_lt" in k.name]
    assert len(pads) == (1 if padded else 0)
    assert len(compiled.kernels) == (2 if padded else 0), [k.name for k in compiled.kernels]
