"""The models of bench/full_speed.py: a Llama-architecture decoder, an encoder training
step, a ViT, a convnet, and a model called at several sequence lengths (dynamic shapes).

Each is a ``Loop``: the module and one or more ``Variant``s, the calls a program's loop
makes (a model with dynamic shapes cycles through its sequence lengths). Full sizes are
the GPU host's; ``smoke`` sizes run on a 2-core CPU in seconds. timm or torchvision are
used where installed, else a stand-in written here, and the row says so.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from coldstart_models import _tol, encoder_train, resnet18_standin  # noqa: E402

Step = Callable[[Any], list[torch.Tensor]]


@dataclass
class Variant:
    tag: str  # what the loop's calls are told apart by (a sequence length)
    step: Step  # the call: the module (or torch.compile's wrapper) in, outputs out


@dataclass
class Loop:
    name: str
    module: nn.Module
    variants: list[Variant]
    tol: dict[str, float]
    note: str = ""
    outputs: tuple[str, ...] = ()
    dynamic: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def _no_grad(fn: Callable[[nn.Module], torch.Tensor]) -> Step:
    def step(m: Any) -> list[torch.Tensor]:
        with torch.no_grad():
            return [fn(m)]
    return step


def _dtype(device: str, smoke: bool, half: torch.dtype) -> torch.dtype:
    return torch.float32 if smoke or device == "cpu" else half


# ---------------------------------------------------------------------------------------
# A Llama-architecture decoder: RMSNorm, rotary embeddings, grouped-query attention,
# SwiGLU, in plain torch.


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(d)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class LlamaBlock(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, hidden: int) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, d // heads
        self.norm1, self.norm2 = RMSNorm(d), RMSNorm(d)
        self.q = nn.Linear(d, d, bias=False)
        self.kv = nn.Linear(d, 2 * kv_heads * self.hd, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.gate_up = nn.Linear(d, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, s, self.heads, self.hd).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.hd).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, d))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class LlamaDecoder(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int, kv_heads: int,
                 hidden: int, positions: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(LlamaBlock(d, heads, kv_heads, hidden)
                                    for _ in range(layers))
        self.norm = RMSNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        hd = d // heads
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        angles = torch.outer(torch.arange(positions).float(), inv)
        angles = torch.cat((angles, angles), dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s, dtype = ids.shape[1], self.head.weight.dtype
        cos: torch.Tensor = self.cos  # type: ignore[assignment]
        sin: torch.Tensor = self.sin  # type: ignore[assignment]
        cos, sin = cos[:s].to(dtype), sin[:s].to(dtype)
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.head(self.norm(x))


def decoder(device: str, smoke: bool) -> Loop:
    vocab, d, layers, heads, kv, hidden, batch, seq = (
        (256, 64, 2, 4, 2, 128, 2, 16) if smoke else (32000, 1024, 8, 16, 4, 2816, 4, 512))
    dtype = _dtype(device, smoke, torch.bfloat16)
    module = LlamaDecoder(vocab, d, layers, heads, kv, hidden, seq).eval()
    module = module.to(device=device, dtype=dtype)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return Loop("decoder", module, [Variant(str(seq), _no_grad(lambda m: m(ids)))],
                _tol(dtype, loose=True), f"Llama architecture, {layers} layers, plain torch")


# ---------------------------------------------------------------------------------------
# The encoder training step of bench/coldstart_models.py (forward, loss, backward).


def encoder_step(device: str, smoke: bool) -> Loop:
    case = encoder_train(device, smoke)
    return Loop("encoder_train", case.module, [Variant("step", case.step)], case.tol,
                case.note, case.outputs)


# ---------------------------------------------------------------------------------------
# ViT-B/16 (timm or torchvision), or a stand-in of its structure.


class _PatchViT(nn.Module):
    def __init__(self, size: int, patch: int, d: int, layers: int, heads: int,
                 classes: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, d, patch, patch)
        self.cls = nn.Parameter(torch.randn(1, 1, d) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x).flatten(2).transpose(1, 2)
        x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x), dim=1) + self.pos
        return self.head(self.norm(self.encoder(x))[:, 0])


def vit(device: str, smoke: bool) -> Loop:
    batch, size = (2, 32) if smoke else (32, 224)
    dtype = _dtype(device, smoke, torch.float16)
    note = "ViT-B/16"
    module: nn.Module
    if smoke:
        module, note = _PatchViT(size, 8, 64, 2, 4, 10), "stand-in (smoke sizes)"
    else:
        try:
            import timm

            module = timm.create_model("vit_base_patch16_224", pretrained=False)
            note = "timm ViT-B/16"
        except ImportError:
            try:
                import torchvision

                module, note = torchvision.models.vit_b_16(), "torchvision ViT-B/16"
            except ImportError:
                module = _PatchViT(size, 16, 768, 12, 12, 1000)
                note = "stand-in ViT-B/16 (neither timm nor torchvision installed)"
    module = module.eval().to(device=device, dtype=dtype)
    x = torch.randn(batch, 3, size, size, device=device, dtype=dtype)
    return Loop("vit", module, [Variant("224", _no_grad(lambda m: m(x)))],
                _tol(dtype, loose=True), f"{note}, batch {batch}")


# ---------------------------------------------------------------------------------------
# A convnet: MobileNetV3-Large (torchvision or timm), or the ResNet-18 stand-in.


def convnet(device: str, smoke: bool) -> Loop:
    batch, size = (2, 32) if smoke else (32, 224)
    dtype = _dtype(device, smoke, torch.float16)
    module: nn.Module
    try:
        import torchvision

        module, note = torchvision.models.mobilenet_v3_large(), "torchvision MobileNetV3-Large"
    except ImportError:
        try:
            import timm

            module = timm.create_model("mobilenetv3_large_100", pretrained=False)
            note = "timm MobileNetV3-Large"
        except ImportError:
            module = resnet18_standin(16 if smoke else 64, 10 if smoke else 1000)
            note = "stand-in ResNet-18 (neither torchvision nor timm installed)"
    module = module.eval().to(device=device, dtype=dtype)
    x = torch.randn(batch, 3, size, size, device=device, dtype=dtype)
    return Loop("convnet", module, [Variant("224", _no_grad(lambda m: m(x)))],
                _tol(dtype, loose=True), f"{note}, batch {batch}")


# ---------------------------------------------------------------------------------------
# Dynamic shapes: a pre-norm transformer block stack called at several sequence lengths
# (the sequence dimension marked dynamic), as a server batching requests would.


class _Block(nn.Module):
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
        y = F.scaled_dot_product_attention(q, k, v)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class DynamicEncoder(nn.Module):
    def __init__(self, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(_Block(d, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.blocks(x)).softmax(-1)


def _call_with(x: torch.Tensor) -> Callable[[nn.Module], torch.Tensor]:
    return lambda m: m(x)


def dynamic(device: str, smoke: bool) -> Loop:
    d, heads, layers, batch = (64, 4, 2, 2) if smoke else (768, 12, 4, 16)
    lengths = (8, 12, 16) if smoke else (128, 200, 256, 384)
    dtype = _dtype(device, smoke, torch.float16)
    module = DynamicEncoder(d, heads, layers).eval().to(device=device, dtype=dtype)
    variants = []
    for seq in lengths:
        x = torch.randn(batch, seq, d, device=device, dtype=dtype)
        torch._dynamo.mark_dynamic(x, 1)
        variants.append(Variant(str(seq), _no_grad(_call_with(x))))
    return Loop("dynamic", module, variants, _tol(dtype, loose=True),
                f"sequence lengths {', '.join(map(str, lengths))} (dimension 1 dynamic)",
                dynamic=True)


MODELS: dict[str, Callable[[str, bool], Loop]] = {
    "decoder": decoder, "encoder_train": encoder_step, "vit": vit, "convnet": convnet,
    "dynamic": dynamic}


def param_count(module: nn.Module) -> float:
    """Millions of parameters (for the row)."""
    return math.fsum(p.numel() for p in module.parameters()) / 1e6
