"""2-d pooling's window kernels on a real GPU (cubins for the device), against eager
CUDA: max_pool2d values and indices over every window parameter, its backward,
avg_pool2d, and the ResNet-18 stand-in (fp16 forward, fp32 training step) through
torch.compile(backend="kiln")."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.compiler.compiled_graph import load
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from tests.gpu.test_gpu_numerics import target
from tests.models import assert_training_step_matches
from tests.pooling_cases import AVG_POOL_PARAMS, avg_pool_fn, case_id, expand_cases

CASES = expand_cases()


@pytest.mark.gpu
@pytest.mark.parametrize("item", CASES, ids=[case_id(c) for c in CASES])
def test_max_pool_matches_eager_cuda(item: Any) -> None:
    case, dtype = item
    torch.manual_seed(0)
    args = [a.cuda() for a in case.inputs(dtype)]
    compiled = compile_graph(trace_aten(case.fn, args), args, {}, name=case.name,
                             target=target())
    assert "max_pool2d" not in compiled.wrapper_source and len(compiled.kernels) == 1
    values, indices = load(compiled)([a.clone() for a in args])
    ref_values, ref_indices = case.fn(*args)
    torch.testing.assert_close(values, ref_values, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(indices, ref_indices)


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(AVG_POOL_PARAMS))
def test_avg_pool_matches_eager_cuda(name: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 16, 29, 30, device="cuda", dtype=torch.float16)
    fn = avg_pool_fn(name)
    compiled = compile_graph(trace_aten(fn, [x]), [x], {}, name=name, target=target())
    torch.testing.assert_close(load(compiled)([x.clone()])[0], fn(x), rtol=2e-3, atol=2e-3)


def _resnet18_standin(width: int) -> torch.nn.Module:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    from coldstart_models import resnet18_standin

    return resnet18_standin(width, 10)


@pytest.mark.gpu
def test_resnet18_fp16_forward_on_gpu() -> None:
    """Channels-last convolutions in fp16 round otherwise than eager's: compared by the
    relative error of the logits as a whole."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = _resnet18_standin(32).cuda().half().eval()
    x = torch.randn(8, 3, 112, 112, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        out = torch.compile(model, backend="kiln")(x).float()
        ref = model(x).float()
    assert ((out - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.gpu
def test_resnet18_training_step_on_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 convolutions without TF32 (eager and Kiln would round them differently)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    torch.manual_seed(0)
    model = _resnet18_standin(8).cuda().train()
    assert_training_step_matches(model, torch.randn(4, 3, 32, 32, device="cuda"),
                                 {"rtol": 1e-3, "atol": 3e-2})


@pytest.mark.gpu
def test_saved_pool_copy_matches_eager_at_resnet50_size() -> None:
    """The stem of ResNet-50's training forward at batch 32: the contiguous copy of the
    channels-last max-pool output, saved for the backward, had ~0.1% stale values on the
    H200 when its kernel loaded back what it had stored (tests/unit/test_store_load_order.py).
    Values and indices must equal eager's pooling of the compiled pool input exactly, on
    several calls; the convolutions match eager's within fp16 tolerance."""
    from tests.unit.test_store_load_order import stem_args, stem_saving_pool

    torch.manual_seed(0)
    args = stem_args(32, "cuda")
    compiled = compile_graph(trace_aten(stem_saving_pool, args), args, {}, target=target())
    run = load(compiled)
    ref = stem_saving_pool(*args)
    for _ in range(3):
        conv, copy, indices, y = run([a.clone() for a in args])
        torch.testing.assert_close(y, ref[3], rtol=1e-2, atol=1e-2)
        pooled, pooled_at = torch.nn.functional.max_pool2d(y, 3, 2, 1, return_indices=True)
        assert copy.is_contiguous()
        wrong = int((copy != pooled).sum())
        assert wrong == 0, f"{wrong} of {copy.numel()} pooled values differ"
        assert torch.equal(indices, pooled_at)
        torch.testing.assert_close(conv, ref[0], rtol=2e-2, atol=5e-2)
