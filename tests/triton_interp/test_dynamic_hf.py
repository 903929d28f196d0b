"""An HF Llama (grouped-query attention, rotary embeddings, HF's causal mask) with dynamic
shapes, its Triton kernels run under Triton's interpreter against eager with fresh
random tokens: ``dynamic=True`` at lengths that are not multiples of 16, and a training
step with a dynamic sequence length. The same graphs compile to sm_90 cubins in
tests/unit/test_dynamic_hf_sm90.py."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from tests.dynamic_hf import ODD_LENGTHS, tiny_llama

OPTIONS = {"cpu_backend": "triton-interpret"}


@pytest.fixture(autouse=True)
def _isolated(kiln_isolated: None) -> None:
    """Every test: a fresh store, in process (tests/conftest.py)."""


def _count_graphs() -> list[str]:
    from kiln.frontend.core import compile as kiln_compile

    seen: list[str] = []
    kiln_compile.observers.append(lambda name, result: seen.append(name))
    return seen


def _stop_counting() -> None:
    from kiln.frontend.core import compile as kiln_compile

    kiln_compile.observers.pop()


def test_dynamic_true_matches_eager_at_odd_lengths() -> None:
    """Before: the causal mask's batch row was printed ``xindex // s1*s1`` (every output
    wrong) and the rotary guard's bound recursed (the graph ran eagerly)."""
    from kiln.frontend.core.fallback import KilnFallbackWarning

    torch.manual_seed(0)
    model = tiny_llama().eval()
    g = torch.Generator().manual_seed(1)
    seen = _count_graphs()
    try:
        compiled = torch.compile(model, backend="kiln", options=OPTIONS, dynamic=True)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", KilnFallbackWarning)
            for batch, n in zip((2, 3, 2), ODD_LENGTHS):
                ids = torch.randint(0, 100, (batch, n), generator=g)
                torch.testing.assert_close(compiled(ids).last_hidden_state,
                                           model(ids).last_hidden_state, rtol=1e-4, atol=1e-4,
                                           msg=lambda m, n=n: f"length {n}: {m}")
    finally:
        _stop_counting()
    assert len(seen) == 1, seen


def _grads(model: torch.nn.Module, out: Any) -> list[torch.Tensor]:
    out.last_hidden_state.float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad()
    return grads


def test_training_step_with_dynamic_length_matches_eager() -> None:
    """Forward and backward with a symbolic sequence length (``mark_dynamic``): the
    backward's kernels take the length as an argument; gradients equal eager's."""
    from kiln.frontend.core.fallback import KilnFallbackWarning

    torch.manual_seed(0)
    model = tiny_llama().train()
    g = torch.Generator().manual_seed(2)
    seen = _count_graphs()
    try:
        compiled = torch.compile(model, backend="kiln", options=OPTIONS)
        with warnings.catch_warnings():
            warnings.simplefilter("error", KilnFallbackWarning)
            for k, n in enumerate((37, 21, 50)):
                ids = torch.randint(0, 100, (2, n), generator=g)
                if k == 0:
                    torch._dynamo.mark_dynamic(ids, 1)
                got = _grads(model, compiled(ids))
                want = _grads(model, model(ids))
                assert len(got) == len(want) > 0
                for a, b in zip(got, want):
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5,
                                               msg=lambda m, n=n: f"length {n}: {m}")
    finally:
        _stop_counting()
    assert sorted(s.split("_")[0] for s in seen) == ["backward", "forward"], seen
