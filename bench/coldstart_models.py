"""The models of bench/coldstart.py, and one measurement in a fresh process.

Each model gives a ``Case``: the module, its inputs, and ``step(module)``, the work whose
first output is timed (a forward, or a training step's loss and gradients). Full sizes
are the H200 host's; ``smoke`` sizes run on a 2-core CPU in seconds. HF GPT-2 and
torchvision's ResNet-18 are used where installed; without them (this CPU machine) a
stand-in of the same architecture written here is used, and the row says so.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class Case:
    name: str
    module: nn.Module
    inputs: tuple[Any, ...]
    step: Callable[[Any], list[torch.Tensor]]  # the module, or torch.compile's wrapper
    tol: dict[str, float]
    note: str = ""
    outputs: tuple[str, ...] = ()  # names of step's outputs, for a failure's message


def _forward(*inputs: Any, pick: Callable[[Any], torch.Tensor] = lambda o: o
             ) -> Callable[[nn.Module], list[torch.Tensor]]:
    def step(m: nn.Module) -> list[torch.Tensor]:
        with torch.no_grad():
            return [pick(m(*inputs))]
    return step


# ---------------------------------------------------------------------------------------
# GPT-2 (HF transformers, random weights), or a stand-in of its block structure.


class _GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.c_attn, self.c_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, s, d))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class DecoderLM(nn.Module):
    """Token and position embeddings, pre-norm causal blocks, a final norm, LM head."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, positions: int) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(positions, d)
        self.blocks = nn.ModuleList(_GPTBlock(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def gpt2(device: str, smoke: bool) -> Case:
    batch, seq = (2, 16) if smoke else (4, 512)
    dtype = torch.float32 if smoke or device == "cpu" else torch.bfloat16
    try:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=512) if smoke \
            else GPT2Config()
        module: nn.Module = GPT2LMHeadModel(config).eval()
        vocab, note = config.vocab_size, ""
        pick: Callable[[Any], torch.Tensor] = lambda out: out.logits
    except ImportError:
        vocab, d, layers, heads = (512, 64, 2, 2) if smoke else (50257, 768, 12, 12)
        module = DecoderLM(vocab, d, layers, heads, 1024).eval()
        note, pick = "stand-in (transformers not installed)", lambda out: out
    module = module.to(device=device, dtype=dtype)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return Case("gpt2", module, (ids,), _forward(ids, pick=pick), _tol(dtype), note)


# ---------------------------------------------------------------------------------------
# ResNet-18 (torchvision), or a stand-in with its layout.


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = x if self.down is None else self.down(x)
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + skip)


def resnet18_standin(width: int, classes: int) -> nn.Module:
    stages, cin = [], width
    for i, cout in enumerate((width, 2 * width, 4 * width, 8 * width)):
        stride = 1 if i == 0 else 2
        stages += [_BasicBlock(cin, cout, stride), _BasicBlock(cout, cout, 1)]
        cin = cout
    return nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width),
                         nn.ReLU(), nn.MaxPool2d(3, 2, 1), *stages,
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes))


def resnet18(device: str, smoke: bool) -> Case:
    batch, size = (2, 32) if smoke else (32, 224)
    dtype = torch.float32 if smoke or device == "cpu" else torch.bfloat16
    note = ""
    try:
        import torchvision

        module: nn.Module = torchvision.models.resnet18()
    except ImportError:
        module = resnet18_standin(16 if smoke else 64, 10 if smoke else 1000)
        note = "stand-in (torchvision not installed)"
    module = module.eval().to(device=device, dtype=dtype)
    x = torch.randn(batch, 3, size, size, device=device, dtype=dtype)
    return Case("resnet18", module, (x,), _forward(x), _tol(dtype, loose=True), note)


def resnet50(device: str, smoke: bool) -> Case:
    """torchvision ResNet-50 forward (53 convolutions in 16 bottleneck blocks of four
    widths): a large model whose layers differ, for the worker sweep (deep24's 24
    identical layers compile as 3 distinct regions)."""
    import torchvision  # (no stand-in: the sweep needs the real model)

    batch, size = (2, 64) if smoke else (32, 224)
    # fp16, not bf16: through 16 random-weight blocks bf16's rounding alone moved eager
    # against itself compiled (Inductor's too) past the tolerance on the H200 (06:37 UTC).
    dtype = torch.float32 if smoke or device == "cpu" else torch.float16
    module = torchvision.models.resnet50().eval().to(device=device, dtype=dtype)
    x = torch.randn(batch, 3, size, size, device=device, dtype=dtype)
    return Case("resnet50", module, (x,), _forward(x), _tol(dtype, loose=True), "53 convs")


class Bottleneck(nn.Module):
    """torchvision's bottleneck, op for op (in-place ReLUs, the shortcut after conv3), so
    that its traced graph is torchvision's (bench/region_interp.py rebuilds the H200's
    regions from it)."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = 4 * width
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet50(nn.Module):
    """torchvision's ResNet-50 layout (blocks 3, 4, 6, 3; attribute names and op order
    alike), for a machine without torchvision."""

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1, self.maxpool = nn.BatchNorm2d(64), nn.MaxPool2d(3, 2, 1)
        self.relu = nn.ReLU(inplace=True)
        cin, stages = 64, []
        for i, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3))):
            layer = []
            for b in range(blocks):
                layer.append(Bottleneck(cin, width, 2 if b == 0 and i > 0 else 1))
                cin = 4 * width
            stages.append(nn.Sequential(*layer))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def _resnet50_module(num_classes: int) -> tuple[nn.Module, str]:
    try:
        import torchvision
    except ImportError:
        return ResNet50(num_classes), "stand-in (torchvision not installed)"
    return torchvision.models.resnet50(num_classes=num_classes), ""


def resnet50_train(device: str, smoke: bool) -> Case:
    """A torchvision ResNet-50 training step (forward, cross-entropy loss, backward; no
    optimizer): the sweep's large model with the most compile work per second of the
    client's own trace (Dynamo and AOTAutograd run once for both graphs, and the backward
    graph has more kernels than the forward). fp32 weights under fp16 autocast on a GPU.
    BatchNorm keeps its statistics (eval mode, as fine-tuning with frozen BatchNorm
    does): with batch statistics, the backward through BatchNorm cancels so much that
    Inductor's gradients of a late conv differed from eager's by 9-22% of their largest
    value in fp32 on this CPU machine, so no comparison with eager could pass."""
    batch, size, classes = (2, 64, 10) if smoke else (32, 224, 1000)
    built, note = _resnet50_module(classes)
    module = built.to(device).eval()  # frozen BatchNorm statistics (see above)
    x = torch.randn(batch, 3, size, size, device=device)
    labels = torch.randint(0, classes, (batch,), device=device)
    autocast = device == "cuda" and not smoke
    watched = ("fc.weight", "layer4.2.conv3.weight", "layer1.0.conv1.weight", "conv1.weight")
    scaled = _GradScales([module.get_parameter(n) for n in watched])

    def step(m: nn.Module) -> list[torch.Tensor]:
        m.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.float16, enabled=autocast):
            loss = F.cross_entropy(m(x).float(), labels)
        loss.backward()
        return [loss.detach(), *scaled()]

    tol = _tol(torch.float16 if autocast else torch.float32, loose=True)
    note = ", ".join(filter(None, ["53 convs, fwd+bwd",
                                   "fp16 autocast" if autocast else "fp32", note]))
    return Case("resnet50_train", module, (x,), step, tol, note,
                ("loss", *(f"grad {n} (scaled)" for n in watched)))


class _GradScales:
    """Gradients over the largest magnitude each had in the first (eager) step: compared
    with eager, a tolerance then means the same for a gradient of 1e-4 as for one of 1 (a
    fixed atol would pass any small gradient), and a wrong scale still fails."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self.scales: list[torch.Tensor] = []

    def __call__(self) -> list[torch.Tensor]:
        grads = []
        for p in self.params:
            if p.grad is None:
                raise RuntimeError("a watched parameter got no gradient")
            grads.append(p.grad.detach().float())
        if not self.scales:  # the first step is eager's (coldstart's child runs it first)
            self.scales = [g.abs().max().clamp_min(1e-30) for g in grads]
        return [g / s for g, s in zip(grads, self.scales)]


# ---------------------------------------------------------------------------------------
# A transformer-encoder training step: embedding, 4 layers, MLM-style loss, fwd + bwd.


class EncoderMLM(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True, activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(self.encoder(self.embed(ids))))
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def encoder_train(device: str, smoke: bool) -> Case:
    vocab, d, heads, batch, seq = (256, 64, 4, 2, 16) if smoke else (30522, 768, 12, 8, 512)
    module = EncoderMLM(vocab, d, heads, 4).to(device).train()
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    labels = torch.where(torch.rand(batch, seq, device=device) < 0.15, ids, -100)
    labels[:, 0] = ids[:, 0]  # at least one masked position per row
    autocast = device == "cuda" and not smoke

    def step(m: nn.Module) -> list[torch.Tensor]:
        m.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            loss = m(ids, labels)
        loss.backward()
        grads = [p.grad for p in (module.embed.weight, module.head.weight)
                 if p.grad is not None]
        return [loss.detach(), *grads]

    tol = _tol(torch.bfloat16 if autocast else torch.float32, loose=True)
    return Case("encoder_train", module, (ids, labels), step, tol,
                "bf16 autocast" if autocast else "fp32",
                ("loss", "grad embed.weight", "grad head.weight"))


# ---------------------------------------------------------------------------------------
# The large model: a 24-layer decoder-only transformer, forward.


def deep24(device: str, smoke: bool) -> Case:
    vocab, d, heads, batch, seq = (512, 64, 2, 2, 16) if smoke else (32000, 1024, 16, 4, 1024)
    dtype = torch.float32 if smoke or device == "cpu" else torch.bfloat16
    module = DecoderLM(vocab, d, 24, heads, seq).eval().to(device=device, dtype=dtype)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return Case("deep24", module, (ids,), _forward(ids), _tol(dtype), "24 layers")


MODELS: dict[str, Callable[[str, bool], Case]] = {
    "gpt2": gpt2, "resnet18": resnet18, "encoder_train": encoder_train, "deep24": deep24,
    "resnet50": resnet50, "resnet50_train": resnet50_train}


def _tol(dtype: torch.dtype, loose: bool = False) -> dict[str, float]:
    if dtype in (torch.bfloat16, torch.float16):
        return {"atol": 1e-1 if loose else 6e-2, "rtol": 6e-2}
    return {"atol": 2e-3 if loose else 1e-3, "rtol": 2e-3 if loose else 1e-3}


@dataclass(frozen=True)
class OutputCheck:
    """One output against eager's: how many of its values are NaN or infinite (eager's
    count apart), and the largest scaled difference over the values finite in both."""

    name: str
    nan: int
    inf: int
    ref_nonfinite: int
    worst: float
    values: int = 0
    shape_ok: bool = True

    @property
    def ok(self) -> bool:
        return self.shape_ok and self.nan == 0 and self.inf == 0 and self.worst <= 1.0

    def describe(self) -> str:
        if not self.shape_ok:
            return f"{self.name}: shape differs from eager's"
        parts = [f"{self.name}: scaled error {self.worst:.3g}"]
        if self.nan or self.inf:
            parts = [f"{self.name}: {self.nan} NaN and {self.inf} inf of {self.values} "
                     f"values (eager's finite), scaled error {self.worst:.3g} over the rest"]
        if self.ref_nonfinite:
            parts.append(f"eager has {self.ref_nonfinite} non-finite")
        return ", ".join(parts)


@dataclass(frozen=True)
class Comparison:
    """Every output checked against eager's (``compare``)."""

    outputs: tuple[OutputCheck, ...]
    count_ok: bool = True

    @property
    def ok(self) -> bool:
        return self.count_ok and all(o.ok for o in self.outputs)

    @property
    def worst(self) -> float:
        """The largest scaled difference; infinite where a value is not finite (or a
        shape differs), so that no NaN hides behind a small figure."""
        if not all(o.shape_ok and not o.nan and not o.inf for o in self.outputs):
            return math.inf
        return max((o.worst for o in self.outputs), default=0.0)

    def problem(self) -> str:
        """What failed, naming each output that did (empty when every one passed)."""
        if self.ok:
            return ""
        # the failing outputs first, then the others' errors for comparison
        lines = [o.describe() for o in self.outputs if not o.ok] + \
            [f"(passed) {o.describe()}" for o in self.outputs if o.ok]
        if not self.count_ok:
            lines.insert(0, "a different number of outputs from eager's")
        return "; ".join(lines)

    def summary(self) -> list[dict[str, Any]]:
        return [{"name": o.name, "nan": o.nan, "inf": o.inf, "worst": o.worst,
                 "values": o.values, "ref_nonfinite": o.ref_nonfinite,
                 "shape_ok": o.shape_ok} for o in self.outputs]


def check_output(name: str, got: torch.Tensor, ref: torch.Tensor, tol: dict[str, float]
                 ) -> OutputCheck:
    g, r = got.detach().float(), ref.detach().float()
    if g.shape != r.shape:
        return OutputCheck(name, 0, 0, 0, math.inf, g.numel(), shape_ok=False)
    ref_special = ~torch.isfinite(r)
    matched = ref_special & ((g == r) | (g.isnan() & r.isnan()))  # eager's own NaN or inf
    bad = ~torch.isfinite(g) & ~matched
    both = torch.isfinite(g) & torch.isfinite(r)
    scaled = (g - r).abs()[both] / (tol["atol"] + tol["rtol"] * r.abs())[both]
    worst = float(scaled.max()) if scaled.numel() else 0.0
    if bool((ref_special & ~matched).any()):  # eager's NaN or inf, finite here
        worst = math.inf
    return OutputCheck(name, int((bad & g.isnan()).sum()), int((bad & g.isinf()).sum()),
                       int(ref_special.sum()), worst, g.numel())


def output_names(count: int, names: Sequence[str] = ()) -> list[str]:
    return [names[i] if i < len(names) else f"output {i}" for i in range(count)]


def compare(got: list[torch.Tensor], ref: list[torch.Tensor], tol: dict[str, float],
            names: Sequence[str] = ()) -> Comparison:
    """Each output against eager's, named (``names``, else by position)."""
    checks = tuple(check_output(n, g, r, tol)
                   for n, g, r in zip(output_names(len(ref), names), got, ref))
    return Comparison(checks, count_ok=len(got) == len(ref))


def max_error(got: list[torch.Tensor], ref: list[torch.Tensor], tol: dict[str, float]
              ) -> tuple[bool, float]:
    """Whether every output is finite and within tolerance, and the largest scaled
    difference (infinite where an output has a NaN or an infinity eager has not)."""
    result = compare(got, ref, tol)
    return result.ok, result.worst
