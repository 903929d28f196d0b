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


# A GPU of 16 SMs: the row-column kernel of a layer norm over 1024 or 2048 rows has a
# part per SM; on an H200 (132 SMs) those run as two kernels (fewer parts than half the SMs).
SM16 = {"kind": "cuda", "backend": "cuda", "arch": 90, "warp_size": 32, "sm_count": 16}


def _run(compiled: CompiledGraph, args: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(load(compiled, device=torch.device("cpu"))([a.clone() for a in args]))


def _assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    tol = tolerance(dtype, reduction=True)
    torch.testing.assert_close(out, ref, atol=tol["atol"], rtol=tol["rtol"])


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
    assert "buf0 = empty_strided_cuda((128, 96), (96, 1)" in compiled.wrapper_source
    assert stage1.xnumel == 128 * 96 and stage1.rnumel == 32 and stage2.rnumel == 128
    assert "tmp1 = tmp0 * " in stage1.source or "* tmp" in stage1.source  # producer fused
    out = _run(compiled, [x])[0]
    _assert_close(out, (x * 2).sum(0), dtype)


def test_fewer_sms_split_less() -> None:
    x = rand(2048, 512)
    many = _compile_for_cuda(lambda t: t.sum(0), [x])
    few = _compile_for_cuda(lambda t: t.sum(0), [x], target={
        "kind": "cuda", "backend": "cuda", "arch": 90, "warp_size": 32, "sm_count": 16})
    # 132 SMs: 8 column blocks split until 2 x 132 programs or chunks of 32 rows; 16
    # SMs: one part per SM (128 rows each), what a row-column kernel would run.
    assert "empty_strided_cuda((64, 512)" in many.wrapper_source
    assert "empty_strided_cuda((16, 512)" in few.wrapper_source


def _close_to_truth(outs: list[torch.Tensor], fn: Callable[..., Any], args: list[torch.Tensor],
                    dtype: torch.dtype, label: object = "") -> None:
    """Each output within twice eager's own error against fp64 (bf16 sums of 1024 rows
    round differently in any order), plus the dtype's reduction tolerance."""
    refs = fn(*args)
    truth = fn(*[a.double() for a in args])
    tol = tolerance(dtype, reduction=True)
    for i, (out, ref, wide) in enumerate(zip(outs, refs, truth)):
        err = (out.double() - wide).abs().max().item()
        ref_err = (ref.double() - wide).abs().max().item()
        assert err <= 2 * ref_err + tol["atol"] + tol["rtol"] * wide.abs().max().item(), \
            (i, label, err, ref_err)


def _ln_backward_saved(g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                       rstd: torch.Tensor, w: torch.Tensor, b: torch.Tensor
                       ) -> tuple[torch.Tensor, ...]:
    """The bench's form: the forward's mean and rstd are inputs."""
    return aten.native_layer_norm_backward(g, x, [x.shape[-1]], mean, rstd, w, b,
                                           [True, True, True])


def _saved_inputs(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    cols = shape[-1]
    x, w, b = rand(*shape, dtype=dtype), rand(cols, dtype=dtype), rand(cols, dtype=dtype)
    _, mean, rstd = aten.native_layer_norm(x, [cols], w, b, 1e-5)
    return [rand(*shape, dtype=dtype), x, mean, rstd, w, b]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_layer_norm_backward_is_one_row_column_kernel(dtype: torch.dtype) -> None:
    """Forward statistics, input gradient and the weight and bias partials in one pass
    over the rows (16 programs of 64 rows: one part per SM), then one kernel for both
    second stages."""
    args = [rand(1024, 256, dtype=dtype), rand(1024, 256, dtype=dtype),
            rand(256, dtype=dtype), rand(256, dtype=dtype)]
    compiled = _compile_for_cuda(_ln_backward, args, SM16)
    kinds = [(k.kind, k.xnumel, k.rnumel, k.programs) for k in compiled.kernels]
    assert kinds == [("row_column", 1024, 256, 16), ("reduction", 256, 16, 0)], kinds
    assert compiled.wrapper_source.count(".run(") == 2
    assert compiled.kernels[1].source.count("tl.store(") == 2  # weight and bias
    # mean and rstd stay in registers: the column stage reads them where the row
    # reduction made them, in the same iteration
    assert "empty_strided_cuda((1024,)" not in compiled.wrapper_source
    row = compiled.kernels[0].source
    assert row.count("tl.store(") == 3 and row.count("tl.sum(") == 6  # 4 by rows, 2 columns
    _close_to_truth(_run(compiled, args), _ln_backward, args, dtype)


def test_layer_norm_backward_every_row_column_config_matches_eager() -> None:
    """Each candidate autotuning may pick (rows per iteration, warps) on a GPU."""
    args = _saved_inputs((2048, 512), torch.bfloat16)
    compiled = _compile_for_cuda(_ln_backward_saved, args, SM16)
    row = compiled.kernels[0]
    # 16 SMs: 16 programs of 128 rows
    assert (row.kind, row.programs, row.grid(dict(row.configs[0]))) == \
        ("row_column", 16, (16, 1, 1))
    assert len(row.configs) >= 3
    for config in row.configs:
        compiled.configs[row.name] = dict(config)
        _close_to_truth(_run(compiled, args), _ln_backward_saved, args, torch.bfloat16,
                        config)


def test_layer_norm_backward_over_batch_and_sequence() -> None:
    """A [batch, sequence, hidden] layer norm: the weight and bias gradients reduce two
    dimensions, whose split chunks cross the batch boundary."""
    args = _saved_inputs((8, 256, 128), torch.float32)
    args[2], args[3] = args[2].reshape(8, 256, 1), args[3].reshape(8, 256, 1)
    compiled = _compile_for_cuda(_ln_backward_saved, args, SM16)
    assert [k.kind for k in compiled.kernels] == ["row_column", "reduction"]
    _close_to_truth(_run(compiled, args), _ln_backward_saved, args, torch.float32)


def test_row_sum_and_column_max_share_one_pass() -> None:
    fn = lambda x: (x.sum(1), x.amax(0))  # noqa: E731
    # 64 columns on 16 SMs: the same two kernels as 128 columns or 132 SMs would give
    # (32 parts here), at a quarter of the interpreter's cost of the column max, which it
    # combines an element at a time in Python (about 0.12 s a program).
    x = rand(4096, 64)
    compiled = _compile_for_cuda(fn, [x], SM16)
    assert [(k.kind, k.programs) for k in compiled.kernels] == [("row_column", 32),
                                                               ("reduction", 0)]
    assert "th.max2(" in compiled.kernels[0].source
    outs = _run(compiled, [x])
    _assert_close(outs[0], x.sum(1), torch.float32)
    torch.testing.assert_close(outs[1], x.amax(0))


def test_column_sum_of_the_row_kernels_output_fuses() -> None:
    """A column sum of what the row kernel computes, at the element it computes."""
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = x * x.sum(1, keepdim=True)
        return y, y.sum(0)

    x = rand(4096, 128)
    compiled = _compile_for_cuda(fn, [x], SM16)
    assert [k.kind for k in compiled.kernels] == ["row_column", "reduction"]
    outs = _run(compiled, [x])
    for out, ref in zip(outs, fn(x)):
        _assert_close(out, ref, torch.float32)


def test_few_parts_for_the_sms_stay_two_kernels() -> None:
    """2048 rows of 512 on 132 SMs: 64 parts of 32 rows would leave half the GPU idle:
    the row kernel and the column stage stay apart (and match eager)."""
    args = _saved_inputs((2048, 512), torch.float32)
    compiled = _compile_for_cuda(_ln_backward_saved, args)
    assert [k.kind for k in compiled.kernels] == ["persistent_reduction", "reduction",
                                                  "reduction"]
    _close_to_truth(_run(compiled, args), _ln_backward_saved, args, torch.float32)


def test_column_sum_of_other_data_stays_apart() -> None:
    """No shared reads: nothing saved by one pass, the kernels stay as they were."""
    fn = lambda x, y: (x.sum(1), y.sum(0))  # noqa: E731
    args = [rand(4096, 128), rand(4096, 128)]
    compiled = _compile_for_cuda(fn, args, SM16)
    assert "row_column" not in [k.kind for k in compiled.kernels]
    outs = _run(compiled, args)
    _assert_close(outs[1], args[1].sum(0), torch.float32)



def _bn_train(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, rm: torch.Tensor,
              rv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Batch norm in training, as AOTAutograd traces it: output, saved mean and rstd,
    updated running statistics."""
    return aten._native_batch_norm_legit_functional(x, w, b, rm, rv, True, 0.1, 1e-5)


def _channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return aten.var_mean(x, [0, 2, 3], correction=1)


def test_batch_norm_statistics_split_over_the_batch() -> None:
    """Training batch norm's Welford reduction (4 channels over 16 x 64 x 64) splits into
    chunks of the batch (one program per chunk and channel: 32 on 16 SMs, where unsplit 4
    programs would each walk 65536 elements), then one kernel combines the chunks' means
    and m2s and makes every statistic batch norm returns; a third normalizes."""
    with FakeTensorMode():
        args = [torch.empty(16, 4, 64, 64, device="cuda")] + [
            torch.empty(4, device="cuda") for _ in range(4)]
    compiled = compile_graph(trace_aten(_bn_train, args), args, {}, target=SM16,
                             compile_kernels=False)
    stage1, stage2, out = compiled.kernels
    assert (stage1.kind, stage1.xnumel, stage1.rnumel) == ("reduction", 4 * 8, 8192)
    assert "th.welford_step(" in stage1.source and stage1.source.count("tl.store(") == 2
    assert (stage2.kind, stage2.xnumel, stage2.rnumel) == ("persistent_reduction", 4, 8)
    # mean (saved, and as the normalization reads it), rstd, running mean and variance
    assert stage2.source.count("tl.store(") == 5
    assert out.kind == "pointwise"


@pytest.mark.parametrize("offset", [0.0, 1000.0], ids=["centred", "mean-1000"])
def test_split_welford_matches_eager(offset: float) -> None:
    """The split statistics against float64. Data far from zero (mean 1000, spread 2)
    keeps its variance: each chunk's deviation is taken from the final mean, never a
    difference of large sums."""
    x = rand(16, 4, 64, 64) + offset
    compiled = _compile_for_cuda(_channel_stats, [x], SM16)
    assert [k.kind for k in compiled.kernels] == ["reduction", "persistent_reduction"]
    # The interpreter combines a Welford reduction's lanes a pair at a time in Python:
    # the candidate with the narrowest rows (32 x 64) runs in a second, not 25.
    stage1 = compiled.kernels[0]
    compiled.configs[stage1.name] = dict(min(stage1.configs, key=lambda c: c["RBLOCK"]))
    _close_to_truth(_run(compiled, [x]), _channel_stats, [x], torch.float32, offset)


def test_welford_of_a_column_splits_by_rows() -> None:
    """Channels-last data (the channel contiguous): the rows split into parts, the part
    index outermost so that stage one reads whole rows of channels (unsplit, 4 channels
    were one program walking all 65536 rows); stage two combines the 32 parts."""
    x = rand(16, 4, 64, 64).contiguous(memory_format=torch.channels_last)
    compiled = _compile_for_cuda(_channel_stats, [x], SM16)
    shapes = [(k.kind, k.xnumel, k.rnumel) for k in compiled.kernels]
    assert shapes == [("reduction", 32 * 4, 2048), ("reduction", 4, 32)], shapes
    assert "empty_strided_cuda((32, 4), (4, 1)" in compiled.wrapper_source
    stage1 = compiled.kernels[0]
    compiled.configs[stage1.name] = dict(min(stage1.configs, key=lambda c: c["RBLOCK"]))
    _close_to_truth(_run(compiled, [x]), _channel_stats, [x], torch.float32)
