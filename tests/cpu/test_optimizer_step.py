"""A compiled optimizer step (``torch.compile(opt.step, backend="kiln")``), as the model
suite's training rows run it: every op lowered (core ATen's ``addcmul`` decomposition
leaves ``prims.fma``, defined late by Inductor's prims), weights as eager's after each
step."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from kiln import KilnFallbackWarning


@pytest.fixture(autouse=True)
def _isolated(kiln_isolated: None) -> None:
    """Compiles in this process against a fresh store."""


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8))]


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, lr=1e-2),
])
def test_compiled_adam_step_matches_eager_with_no_eager_op(make: Any) -> None:
    from kiln.frontend.core import compile as kiln_compile

    eager = _params()
    compiled = [torch.nn.Parameter(p.detach().clone()) for p in eager]
    opt_eager, opt_kiln = make(eager), make(compiled)
    step = torch.compile(opt_kiln.step, backend="kiln")
    fallbacks: list[dict[str, int]] = []
    observe = lambda name, result: fallbacks.append(result.compiled.stats["fallback_ops"])
    kiln_compile.observers.append(observe)
    try:
        for _ in range(2):
            grads = [torch.randn_like(p) for p in eager]
            for p, q, g in zip(eager, compiled, grads):
                p.grad, q.grad = g, g.clone()
            opt_eager.step()
            with warnings.catch_warnings():
                warnings.simplefilter("error", KilnFallbackWarning)
                step()
            for p, q in zip(eager, compiled):
                torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-5, atol=1e-6)
    finally:
        kiln_compile.observers.remove(observe)
    assert fallbacks, "Kiln compiled no graph"
    assert all(not f for f in fallbacks), f"ops run eagerly in the step: {fallbacks}"
