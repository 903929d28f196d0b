"""Small models shared by the backends' model-level tests."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CausalBlock(nn.Module):
    """A pre-norm decoder block: causal attention (mask from the sequence length, so a
    dynamic length stays symbolic) and a GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for t in (q, k, v))
        pos = torch.arange(s, device=x.device)
        causal = pos[:, None] >= pos[None, :]
        att = (q @ k.transpose(-1, -2)) * (d // self.heads) ** -0.5
        att = torch.softmax(att.masked_fill(~causal, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Decoder(nn.Module):
    """A decoder-only transformer: token and position embeddings, causal blocks, the
    final norm and the vocabulary head. Token ids ``(batch, seq)`` in, logits out."""

    def __init__(self, vocab: int = 97, d: int = 32, heads: int = 4, layers: int = 2,
                 max_len: int = 4096) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(CausalBlock(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


def assert_training_step_matches(model: nn.Module, x: torch.Tensor, tol: dict[str, float],
                                 options: dict[str, Any] | None = None) -> None:
    """One step through ``torch.compile(backend="kiln")``: loss and every gradient equal
    eager's, and no graph falls back to eager (its warning is an error here)."""
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        compiled = torch.compile(model, backend="kiln", options=options)
        loss = compiled(x).square().mean()
        loss.backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    ref = model(x).square().mean()
    ref.backward()
    torch.testing.assert_close(loss, ref, **tol)
    assert set(got) == {n for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, **tol, msg=n)


def compile_checked(fn: Callable[..., torch.Tensor], *args: torch.Tensor
                    ) -> list[warnings.WarningMessage]:
    """``fn(*args)`` through ``torch.compile(backend="kiln")``: no graph fell back to
    eager, the output equals eager's (fp32 tolerances); the warnings the call gave."""
    from kiln.frontend.core.fallback import KilnFallbackWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(fn, backend="kiln")(*args)
    assert not [w for w in caught if issubclass(w.category, KilnFallbackWarning)]
    torch.testing.assert_close(out, fn(*args), rtol=1.3e-6, atol=1e-5)
    return caught
