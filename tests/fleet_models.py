"""Models for the fleet precompile and package tests (``kiln precompile
tests.fleet_models:block``): built on the CPU with seeded random weights."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


class Block(torch.nn.Module):
    """A small decoder block: layer norm, attention written out (Kiln's fuse_attention
    makes it SDPA on GPU graphs), an indexing slice, an MLP with GELU."""

    def __init__(self, dim: int = 32, heads: int = 2, attention: bool = True,
                 sdpa: bool = False) -> None:
        super().__init__()
        self.heads, self.attention, self.sdpa = heads, attention, sdpa
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.fc1, self.fc2 = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        if not self.attention:  # the block's other ops: graphs no GPU decides at trace time
            x = x + self.proj(self.qkv(self.ln1(x))[..., :c])
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        if self.sdpa:  # as transformers writes it
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)
            y = F.softmax(scores, dim=-1) @ v
        y = y.transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc2(F.gelu(self.fc1(x[1:]))))


def block() -> torch.nn.Module:
    torch.manual_seed(0)
    return Block().eval()


def block_half() -> torch.nn.Module:
    return block().half()


def sdpa_block() -> torch.nn.Module:
    torch.manual_seed(0)
    return Block(sdpa=True).eval()


def sdpa_block_half() -> torch.nn.Module:
    return sdpa_block().half()


def block_no_attention_half() -> torch.nn.Module:
    torch.manual_seed(0)
    return Block(attention=False).eval().half()


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return Mlp().eval()
