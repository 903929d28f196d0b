"""A padded matmul's rows (a GPU layout, forced here on CPU) stay padded only in an
inference graph's outputs: a forward graph's outputs may be saved for its backward,
which is compiled for eager's strides, so there they are copied (gradients stay right)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from kiln.compiler.lowering import extern_ops
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.compile import request_options
from kiln.frontend.core.fallback import KilnFallbackWarning


@pytest.fixture(autouse=True)
def _isolated(kiln_isolated: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def always_pad(a: Any, b: Any) -> int:
        multiple = 16 // b.get_dtype().itemsize
        return 1 if int(b.get_size()[-1]) % multiple == 0 else multiple

    monkeypatch.setattr(extern_ops, "_row_padding", always_pad)


def _square_and_sum(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    y = x @ w
    return (y * y).sum(), y


def _run(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        return torch.compile(_square_and_sum, backend="kiln", dynamic=False)(x, w)


def test_only_inference_graphs_ask_for_padded_outputs() -> None:
    config = KilnConfig.resolve({})
    assert request_options(config, "inference_3").get("padded_outputs") is True
    for name in ("forward_3", "backward_3", "graph", ""):
        assert "padded_outputs" not in request_options(config, name)


def test_training_graph_copies_padded_output_and_differentiates() -> None:
    x, w = torch.randn(40, 64), torch.randn(64, 1001, requires_grad=True)
    loss, y = _run(x, w)
    loss.backward()
    grad, w.grad = w.grad, None
    ref_loss, ref_y = _square_and_sum(x, w)
    ref_loss.backward()
    assert y.stride() == ref_y.stride() == (1001, 1)
    torch.testing.assert_close(y, ref_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad, w.grad, rtol=1e-4, atol=1e-3)


def test_inference_graph_returns_padded_rows() -> None:
    x, w = torch.randn(40, 64), torch.randn(64, 1001)
    with torch.no_grad():
        loss, y = _run(x, w)
        ref_loss, ref_y = _square_and_sum(x, w)
    assert y.stride() == (1004, 1)  # fp32 rows padded to 16 bytes, not copied
    torch.testing.assert_close(y, ref_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=1e-2)


class _MatmulChain(torch.nn.Module):
    """Blocks that end in a matmul of odd width: each block's product is the next block's
    input, so a cut between blocks hands a (padded) matmul product to the next region."""

    def __init__(self, width: int = 1001, blocks: int = 4) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.randn(width, width) / width**0.5) for _ in range(blocks))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for w in self.weights:
            h = torch.tanh(h * 0.5 + 0.25).sigmoid() * h - h.relu() * 0.125
            h = (h + 1.0).abs().sqrt() - h.exp().clamp(max=4.0) * 0.25
            h = h @ w
        return h


def test_regions_pass_padded_products_on_and_return_padded_rows() -> None:
    from kiln.frontend.core.client import process_counters

    torch.manual_seed(3)
    model = _MatmulChain().eval()
    x = torch.randn(24, 1001)
    compiled = torch.compile(model, backend="kiln", dynamic=False,
                             options={"regions": "on", "region_nodes": 16})
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        out = compiled(x)
        ref = model(x)
    assert process_counters()["regions"] >= 2
    # Between regions, stitch gives each region the strides it was compiled for; the
    # user's output keeps its padded rows.
    assert out.stride() == (1004, 1)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
