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
