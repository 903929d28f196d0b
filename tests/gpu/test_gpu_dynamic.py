"""Dynamic shapes on a GPU: a decoder-only transformer (fp16) with a dynamic sequence
length compiles once and matches eager at every length, short rows and long; a training
step with a dynamic batch (the backward takes SymInt inputs)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from tests.models import Decoder, mlp


def _graphs() -> list[Any]:
    from kiln.frontend import compile as kiln_compile

    seen: list[Any] = []
    kiln_compile.observers.append(lambda name, result: seen.append(result))
    return seen


@pytest.mark.gpu
def test_decoder_dynamic_length_one_compile_on_gpu() -> None:
    from kiln.frontend import compile as kiln_compile
    from kiln.frontend.backend import KilnFallbackWarning

    torch.manual_seed(0)
    model = Decoder(d=64, heads=4, layers=2).cuda().half().eval()
    seen = _graphs()
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="kiln")
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", KilnFallbackWarning)
            for k, n in enumerate((128, 37, 1024, 2048, 3001)):
                ids = torch.randint(0, 97, (2, n), device="cuda")
                if k == 0:
                    torch._dynamo.mark_dynamic(ids, 1)
                torch.testing.assert_close(compiled(ids), model(ids), rtol=2e-2, atol=2e-2)
    finally:
        kiln_compile.observers.pop()
    assert len(seen) == 1, [r.source for r in seen]
    assert seen[0].compiled.stats["dynamic"]["symbols"]


@pytest.mark.gpu
def test_training_step_with_dynamic_batch_on_gpu() -> None:
    from kiln.frontend.backend import KilnFallbackWarning

    torch.manual_seed(0)
    model = mlp().cuda()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kiln")
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        for k, n in enumerate((64, 33, 200)):
            x = torch.randn(n, 32, device="cuda")
            if k == 0:
                torch._dynamo.mark_dynamic(x, 0)
            compiled(x).square().mean().backward()
            got = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            model(x).square().mean().backward()
            for g, p in zip(got, model.parameters()):
                torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-4)
            model.zero_grad()
