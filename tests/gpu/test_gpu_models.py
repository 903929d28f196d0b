"""Models through torch.compile(backend="kiln") on the GPU: forward and a training step."""

from __future__ import annotations

import pytest
import torch

from tests.models import Block, assert_training_step_matches, mlp


@pytest.mark.gpu
@pytest.mark.parametrize("make, shape", [(mlp, (64, 32)), (Block, (4, 16, 32))],
                         ids=["mlp", "block"])
def test_training_step_on_gpu(make: type, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    assert_training_step_matches(make().cuda(), torch.randn(*shape, device="cuda"),
                                 {"atol": 1e-4, "rtol": 1e-3})


@pytest.mark.gpu
def test_half_precision_block_forward_on_gpu() -> None:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Block().cuda().half()
    x = torch.randn(4, 16, 32, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        out = torch.compile(model, backend="kiln")(x)
        torch.testing.assert_close(out, model(x), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_biased_head_over_an_odd_vocabulary_matches_eager_and_frees_its_buffers() -> None:
    """An MLM head (vocabulary 30522, with a bias) after two MLP blocks, fp16 inference:
    the padded addmm's logits match eager's, and a call needs little more memory than
    its logits (each block's buffers freed at their last use)."""
    import warnings

    from kiln.frontend.core.fallback import KilnFallbackWarning

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = torch.nn.Sequential(
        torch.nn.Linear(768, 3072), torch.nn.GELU(), torch.nn.Linear(3072, 768),
        torch.nn.Linear(768, 3072), torch.nn.GELU(), torch.nn.Linear(3072, 768),
        torch.nn.LayerNorm(768), torch.nn.Linear(768, 30522)).cuda().half().eval()
    x = torch.randn(8, 512, 768, device="cuda", dtype=torch.float16)
    compiled = torch.compile(model, backend="kiln")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        out = compiled(x)
        torch.testing.assert_close(out, model(x), atol=3e-2, rtol=3e-2)
        del out
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        compiled(x)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    logits = 8 * 512 * 30528 * 2
    assert peak < logits * 1.5, (peak, logits)
