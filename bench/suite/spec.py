"""What the suite knows of one model: how to build it (at the size its users run, and at
a tiny size for CPU CI), its inference dtype, fresh random inputs, and its training loss.

Weights are random (built from configs; nothing is downloaded). Dropout, drop-path and
other random masking are off, so that eager, Inductor and Kiln compute the same function
and their outputs and gradients can be compared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

Inputs = dict[str, Any]


@dataclass(frozen=True)
class ModelSpec:
    """One model of the suite.

    ``build(tiny)`` returns an fp32 module with random weights; ``inputs(tiny, batch)``
    fresh random inputs on the CPU in fp32 (``batch`` None means the model's own), labels
    included under ``label_keys``; ``loss(output, inputs)`` the scalar a training step
    minimises. ``optimizer`` names the update a training step makes after backward
    ("adamw", "sgd"), None for forward, loss and backward only."""

    name: str
    suite: str  # "hf", "timm" or "torchvision"
    build: Callable[[bool], nn.Module]
    inputs: Callable[[bool, int | None], Inputs]
    dtype: torch.dtype
    loss: Callable[[Any, Inputs], torch.Tensor]
    label_keys: tuple[str, ...] = ()
    train: bool = False
    optimizer: str | None = None
    # The input dimension `--mode dynamic` varies (0: batch); None: the model has none.
    dynamic_dim: int | None = 0
    # HF models take their labels and return their loss; others get only their inputs.
    labels_to_model: bool = False

    def model_inputs(self, inputs: Inputs, train: bool) -> Inputs:
        """The keyword arguments of the model's forward for this mode."""
        keep_labels = train and self.labels_to_model
        return {k: v for k, v in inputs.items() if keep_labels or k not in self.label_keys}


def no_randomness(model: nn.Module) -> nn.Module:
    """Dropout off everywhere (``nn.Dropout`` modules and functional ``p`` attributes)."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for attr in ("drop_prob", "dropout_p"):
            if isinstance(getattr(module, attr, None), float):
                setattr(module, attr, 0.0)
    return model


def token_ids(batch: int, seq: int, vocab: int) -> torch.Tensor:
    """Random token ids, avoiding the first few ids (pad and special tokens)."""
    return torch.randint(4, vocab, (batch, seq))


def images(batch: int, size: int | tuple[int, int], channels: int = 3) -> torch.Tensor:
    h, w = (size, size) if isinstance(size, int) else size
    return torch.randn(batch, channels, h, w)


def classes(batch: int, num_classes: int) -> torch.Tensor:
    return torch.randint(0, num_classes, (batch,))


def hf_loss(output: Any, inputs: Inputs) -> torch.Tensor:
    """HF models compute their own loss when given labels."""
    return output.loss


def logits_ce(output: Any, inputs: Inputs) -> torch.Tensor:
    """Cross-entropy of a classifier's logits against ``inputs["target"]``."""
    logits = output.logits if hasattr(output, "logits") else output
    return nn.functional.cross_entropy(logits.float(), inputs["target"])


def flatten_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in an output (tensors, tuples, lists, dicts, HF ``ModelOutput``)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in flatten_tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flatten_tensors(v)]
    return []
