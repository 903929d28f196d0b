"""GPU-sized split reductions (column sums and layer-norm backward: two stages, stage one
coalesced along the columns and fused with its pointwise producers), generated for a
CUDA target from fake tensors and run under Triton's interpreter on CPU tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.compiler.compiled_graph import CompiledGraph, load
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from tests.numerics_cases import rand, tolerance

aten = torch.ops.aten


def _compile_for_cuda(fn: Callable[..., Any], args: list[torch.Tensor],
                      target: dict[str, Any] | None = None) -> CompiledGraph:
    with FakeTensorMode():
        fake = [torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device="cuda")
                for a in args]
    return compile_graph(trace_aten(fn, fake), fake, {}, target=target, compile_kernels=False)


def _run(compiled: CompiledGraph, args: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(load(compiled, device=torch.device("cpu"))([a.clone() for a in args]))


def _ln_backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor
                 ) -> tuple[torch.Tensor, ...]:
    _, mean, rstd = aten.native_layer_norm(x, [x.shape[-1]], w, b, 1e-5)
    return aten.native_layer_norm_backward(g, x, [x.shape[-1]], mean, rstd, w, b,
                                           [True, True, True])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_column_sum_splits_by_sm_count(dtype: torch.dtype) -> None:
    x = rand(4096, 96, dtype=dtype)
    compiled = _compile_for_cuda(lambda t: (t * 2).sum(0), [x])
    assert [k.kind for k in compiled.kernels] == ["reduction", "reduction"]
    stage1, stage2 = compiled.kernels
    # 96 columns are 2 programs of 64: split until 2 x 132 SMs have work or the chunks
    # reach the minimum of 32 rows: 128 parts.
    assert "buf0 = empty_strided((128, 96), (96, 1)" in compiled.wrapper_source
    assert stage1.xnumel == 128 * 96 and stage1.rnumel == 32 and stage2.rnumel == 128
    assert "tmp1 = tmp0 * " in stage1.source or "* tmp" in stage1.source  # producer fused
    out = _run(compiled, [x])[0]
    torch.testing.assert_close(out, (x * 2).sum(0), **tolerance(dtype, reduction=True))


def test_fewer_sms_split_less() -> None:
    x = rand(2048, 512)
    many = _compile_for_cuda(lambda t: t.sum(0), [x])
    few = _compile_for_cuda(lambda t: t.sum(0), [x], target={
        "kind": "cuda", "backend": "cuda", "arch": 90, "warp_size": 32, "sm_count": 16})
    assert "empty_strided((64, 512)" in many.wrapper_source
    assert "empty_strided((4, 512)" in few.wrapper_source


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layer_norm_backward_weight_and_bias_in_one_coalesced_stage(dtype: torch.dtype
                                                                    ) -> None:
    args = [rand(1024, 256, dtype=dtype), rand(1024, 256, dtype=dtype),
            rand(256, dtype=dtype), rand(256, dtype=dtype)]
    compiled = _compile_for_cuda(_ln_backward, args)
    kinds = [(k.kind, k.xnumel, k.rnumel) for k in compiled.kernels]
    # grad input (rows), then the weight and bias partials in one kernel over
    # (32 parts, 256 columns), then the second stages.
    stage1 = [k for k in compiled.kernels if k.kind == "reduction" and k.xnumel > 256]
    assert len(stage1) == 1 and stage1[0].xnumel == 32 * 256, kinds
    assert stage1[0].source.count("tl.store(") == 2
    assert "(xindex % 256)" in stage1[0].source  # columns are the contiguous x dimension
    outs = _run(compiled, args)
    refs = _ln_backward(*args)
    for i in range(3):  # fp64 truth: eager bf16 sums round differently
        wide = _ln_backward(*[a.double() for a in args])[i]
        err = (outs[i].double() - wide).abs().max().item()
        ref_err = (refs[i].double() - wide).abs().max().item()
        tol = tolerance(dtype, reduction=True)
        assert err <= 2 * ref_err + tol["atol"] + tol["rtol"] * wide.abs().max().item(), i


def test_layer_norm_backward_every_stage_one_config_matches_eager() -> None:
    """Each candidate tile of the column stage (the one autotuning picks on a GPU): the
    part a program reduces comes from ``xoffset`` (every candidate XBLOCK divides the 256
    columns), the per-row mean and rstd load as [1, RBLOCK]."""
    args = [rand(1024, 256, dtype=torch.bfloat16), rand(1024, 256, dtype=torch.bfloat16),
            rand(256, dtype=torch.bfloat16), rand(256, dtype=torch.bfloat16)]
    compiled = _compile_for_cuda(_ln_backward, args)
    [stage1] = [k for k in compiled.kernels if k.kind == "reduction" and k.xnumel > 256]
    assert "(xoffset // 256)" in stage1.source and "(xindex // 256)" not in stage1.source
    wide = [a.double() for a in args]
    truth = _ln_backward(*wide)
    for config in stage1.configs:
        compiled.configs[stage1.name] = dict(config)
        outs = _run(compiled, args)
        for i in (1, 2):  # the weight and bias gradients (column sums)
            scale = truth[i].abs().max().item()
            assert (outs[i].double() - truth[i]).abs().max().item() <= 2e-2 * scale, config
