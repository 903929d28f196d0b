"""torchvision models of the suite: classifiers, semantic segmentation and detection,
built with ``weights=None`` (random weights, nothing downloaded)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn

from .spec import Inputs, ModelSpec, classes, images, logits_ce, no_randomness
from .tv_shim import ensure_torchvision

TINY_CLASSES = 10


def _build(builder: str, full_kwargs: dict[str, Any], tiny_builder: str,
           tiny_kwargs: dict[str, Any], is_tiny: bool) -> nn.Module:
    ensure_torchvision()
    import torchvision

    name, kwargs = (tiny_builder, tiny_kwargs) if is_tiny else (builder, full_kwargs)
    fn = torchvision.models.get_model_builder(name)
    return no_randomness(fn(weights=None, **kwargs))


def _classify(full: tuple[int, int], tiny: tuple[int, int], is_tiny: bool,
              batch: int | None) -> Inputs:
    b, size = tiny if is_tiny else full
    b = batch or b
    return {"x": images(b, size), "target": classes(b, TINY_CLASSES if is_tiny else 1000)}


def _segment(full: tuple[int, int, int], tiny: tuple[int, int, int], key: str,
             is_tiny: bool, batch: int | None) -> Inputs:
    b, size, num = tiny if is_tiny else full
    b = batch or b
    return {key: images(b, size), "target": torch.randint(0, num, (b, size, size))}


def _detect(is_tiny: bool, batch: int | None) -> Inputs:
    b, h, w = (1, 64, 80) if is_tiny else (2, 480, 640)
    return {"images": [torch.rand(3, h, w) for _ in range(batch or b)]}


def segmentation_loss(output: Any, inputs: Inputs) -> torch.Tensor:
    return nn.functional.cross_entropy(output["out"].float(), inputs["target"])


def detection_loss(output: Any, inputs: Inputs) -> torch.Tensor:
    """Detection is inference only in the suite (its training samples proposals at
    random); a loss over the scores keeps the interface whole."""
    return sum(o["scores"].float().sum() for o in output)


def _tv(name: str, batch: int = 64, size: int = 224, tiny_builder: str | None = None,
        tiny: dict[str, Any] | None = None, tiny_size: int = 32, train: bool = False,
        optimizer: str | None = None) -> ModelSpec:
    build = partial(_build, name, {}, tiny_builder or name,
                    {"num_classes": TINY_CLASSES, **(tiny or {})})
    return ModelSpec(f"tv_{name}", "torchvision", build,
                     partial(_classify, (batch, size), (2, tiny_size)), torch.float16,
                     logits_ce, ("target",), train, optimizer)


def _seg(name: str, tiny_builder: str, batch: int = 8, size: int = 520,
         train: bool = False, key: str = "x") -> ModelSpec:
    build = partial(_build, name, {"weights_backbone": None, "aux_loss": False},
                    tiny_builder, {"weights_backbone": None, "num_classes": 4})
    return ModelSpec(f"tv_{name}", "torchvision", build,
                     partial(_segment, (batch, size, 21), (2, 32, 4), key), torch.float16,
                     segmentation_loss, ("target",), train)


def _det(name: str, tiny_builder: str) -> ModelSpec:
    # Detection runs in fp32, as torchvision's reference scripts evaluate it: in half
    # precision the random-weight scores tie and NMS keeps different boxes run to run.
    build = partial(_build, name, {"weights_backbone": None}, tiny_builder,
                    {"weights_backbone": None, "num_classes": 3, "min_size": 64,
                     "max_size": 80})
    return ModelSpec(f"tv_{name}", "torchvision", build, _detect, torch.float32,
                     detection_loss, (), dynamic_dim=None)


TV_MODELS: list[ModelSpec] = [
    _tv("resnet50", batch=128, tiny_builder="resnet18", train=True, optimizer="sgd"),
    _tv("mobilenet_v3_large", batch=128, tiny_builder="mobilenet_v3_small", train=True),
    _tv("vgg16", tiny_builder="vgg11"),
    _tv("convnext_small", tiny_builder="convnext_tiny", tiny_size=32),
    _tv("shufflenet_v2_x1_0", batch=128, tiny_builder="shufflenet_v2_x0_5"),
    _tv("swin_t", tiny_builder="swin_t", tiny_size=64),
    _seg("fcn_resnet50", "fcn_resnet50", train=True),
    _seg("deeplabv3_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large"),
    _seg("lraspp_mobilenet_v3_large", "lraspp_mobilenet_v3_large", key="input"),
    _det("fasterrcnn_resnet50_fpn", "fasterrcnn_mobilenet_v3_large_fpn"),
    _det("maskrcnn_resnet50_fpn", "maskrcnn_resnet50_fpn"),
]
