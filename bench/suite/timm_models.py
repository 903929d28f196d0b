"""timm models of the suite: convnets, vision transformers and hybrids, built by
``timm.create_model`` with random weights. The tiny form is the same architecture with
fewer and narrower stages (or the family's smallest variant) on small images."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from .spec import Inputs, ModelSpec, classes, images, logits_ce, no_randomness
from .tv_shim import ensure_torchvision

TINY_CLASSES = 10
_TINY_VIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2)


def _build(variant: str, tiny_variant: str, tiny_kwargs: dict[str, Any],
           is_tiny: bool) -> nn.Module:
    ensure_torchvision()  # timm imports torchvision.ops
    import timm

    if is_tiny:
        model = timm.create_model(tiny_variant, pretrained=False, num_classes=TINY_CLASSES,
                                  **tiny_kwargs)
    else:
        model = timm.create_model(variant, pretrained=False)
    return no_randomness(model)


def _inputs(full: tuple[int, int], tiny: tuple[int, int], is_tiny: bool,
            batch: int | None) -> Inputs:
    b, size = tiny if is_tiny else full
    b = batch or b
    return {"x": images(b, size), "target": classes(b, TINY_CLASSES if is_tiny else 1000)}


def _timm(variant: str, batch: int = 64, size: int = 224, tiny_variant: str | None = None,
          tiny: dict[str, Any] | None = None, tiny_size: int = 32, train: bool = False,
          optimizer: str | None = None, dtype: torch.dtype = torch.float16) -> ModelSpec:
    return ModelSpec(f"timm_{variant}", "timm",
                     partial(_build, variant, tiny_variant or variant, tiny or {}),
                     partial(_inputs, (batch, size), (2, tiny_size)), dtype, logits_ce,
                     ("target",), train, optimizer)


_STAGES_1 = dict(layers=(1, 1, 1, 1))
TIMM_MODELS: list[ModelSpec] = [
    # Convnets.
    _timm("resnet50", batch=128, tiny=_STAGES_1, train=True, optimizer="sgd"),
    _timm("resnext50_32x4d", tiny=_STAGES_1),
    _timm("convnext_tiny", tiny=dict(depths=(1, 1, 1, 1), dims=(16, 32, 64, 128)),
          train=True),
    _timm("efficientnet_b0", batch=128, tiny_variant="tinynet_e", train=True),
    _timm("mobilenetv3_large_100", batch=128, tiny_variant="mobilenetv3_small_050",
          train=True),
    _timm("regnety_040", tiny_variant="regnety_002"),
    _timm("densenet121", tiny=dict(growth_rate=8, block_config=(1, 1, 1, 1))),
    _timm("ghostnet_100", batch=128, tiny_variant="ghostnet_050"),
    _timm("nfnet_l0", tiny=dict()),
    # Vision transformers and MLP-mixers.
    _timm("vit_base_patch16_224", tiny=_TINY_VIT, train=True, optimizer="adamw"),
    _timm("deit_small_patch16_224", batch=128, tiny=_TINY_VIT, train=True),
    _timm("swin_tiny_patch4_window7_224",
          tiny=dict(img_size=32, patch_size=4, window_size=4, embed_dim=16, depths=(1, 1),
                    num_heads=(1, 2)), train=True),
    _timm("beit_base_patch16_224", tiny=_TINY_VIT),
    _timm("mixer_b16_224", tiny_variant="mixer_s32_224", tiny=dict(img_size=64),
          tiny_size=64),
    # Hybrids: convolutions and attention.
    _timm("coat_lite_mini", tiny_variant="coat_lite_tiny", tiny=dict(img_size=64), tiny_size=64),
    _timm("levit_128", batch=128, tiny=dict(img_size=64), tiny_size=64),
    _timm("maxvit_tiny_tf_224", batch=32, tiny=dict(img_size=64), tiny_size=64),
    _timm("mobilevit_s", tiny_variant="mobilevit_xxs", tiny_size=64),
]
