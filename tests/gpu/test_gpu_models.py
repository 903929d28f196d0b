"""Models through torch.compile(backend="kiln") on the GPU: forward and a training step."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.models import Block, mlp


@pytest.mark.gpu
@pytest.mark.parametrize("make, shape", [(mlp, (64, 32)), (Block, (4, 16, 32))],
                         ids=["mlp", "block"])
def test_training_step_on_gpu(make: type, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model, x = make().cuda(), torch.randn(*shape, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled = torch.compile(model, backend="kiln")
        loss = compiled(x).square().mean()
        loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    ref = model(x).square().mean()
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-4, rtol=1e-3)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-4, rtol=1e-3, msg=n)


@pytest.mark.gpu
def test_half_precision_block_forward_on_gpu() -> None:
    torch.manual_seed(0)
    torch._dynamo.reset()
    model = Block().cuda().half()
    x = torch.randn(4, 16, 32, device="cuda", dtype=torch.float16)
    with torch.no_grad():
        out = torch.compile(model, backend="kiln")(x)
        torch.testing.assert_close(out, model(x), atol=2e-2, rtol=2e-2)
