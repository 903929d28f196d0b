"""fuse_attention: softmax(q @ k^T / s) @ v becomes one scaled_dot_product_attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.compiler.fx_passes import fuse_attention
from tests.models import Block


def capture(model: torch.nn.Module, x: torch.Tensor, devices: tuple[str, ...]) -> list[int]:
    counts: list[int] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        counts.append(fuse_attention(gm, devices))
        targets = [n.target for n in gm.graph.nodes]
        assert (F.scaled_dot_product_attention in targets) == bool(counts[-1])
        return gm

    torch._dynamo.reset()
    out = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    return counts


def test_block_attention_becomes_sdpa_and_matches() -> None:
    torch.manual_seed(0)
    assert capture(Block(), torch.randn(2, 8, 32), devices=("cpu",)) == [1]


def test_left_alone_on_other_devices_and_other_shapes() -> None:
    torch.manual_seed(0)
    assert capture(Block(), torch.randn(2, 8, 32), devices=("cuda",)) == [0]

    class NotAttention(torch.nn.Module):
        def forward(self, q: torch.Tensor) -> torch.Tensor:
            return torch.softmax(q @ q.transpose(-1, -2), dim=0) @ q  # softmax over dim 0

    assert capture(NotAttention(), torch.randn(2, 3, 4, 5), devices=("cpu",)) == [0]
