"""The model suite at tiny configs on the C++ backend (``bench/suite/``): each model
compiles with ``backend="kiln"`` with no ``KilnFallbackWarning`` and no error, and its
outputs (training: loss and gradients) pass the suite's accuracy check against eager
and float64 eager. A model that stops compiling fails here.

torchvision's detection models are left out: on a CPU-only torch, PyPI's torchvision
cannot load its native ops (NMS, RoIAlign); its classifiers and segmentation models run
(``bench/suite/tv_shim.py``)."""

from __future__ import annotations

import warnings

import pytest
import torch

from bench.suite.models import MODELS
from bench.suite.row import (
    Case,
    KilnGraphs,
    check,
    compile_backend,
    cpu_results,
    references,
)
from bench.suite.tv_shim import ensure_torchvision

# The cheapest tiny forms that still cover each family: encoders, decoders (learned
# positions; rotary GQA; sliding window), a vision transformer from each library, convnets
# from timm and torchvision; and one training step (forward, loss, backward).
INFERENCE = ["hf_distilbert", "hf_gpt2", "hf_llama", "hf_mistral", "hf_qwen2", "hf_vit",
             "timm_vit_base_patch16_224", "timm_convnext_tiny", "timm_swin_tiny_patch4_window7_224",
             "tv_resnet50"]
TRAIN = ["hf_llama"]


@pytest.fixture(scope="module", autouse=True)
def _libraries() -> None:
    """torchvision importable (before timm and transformers import it), then the model
    libraries; the suite's modules themselves import only torch."""
    try:
        ensure_torchvision()
    except ImportError:
        pytest.skip("torchvision is not installed")
    pytest.importorskip("transformers")
    pytest.importorskip("timm")


@pytest.fixture(autouse=True)
def _isolated(kiln_isolated: None) -> None:
    """Compiles in this process against a fresh store."""


def _run(name: str, mode: str) -> KilnGraphs:
    case = Case(MODELS[name], mode, tiny=True, device="cpu")
    inputs = case.inputs()
    ref, fp64 = references(case, inputs)
    step = case.step(case.copy(), compile_backend("kiln", dynamic=False))
    with warnings.catch_warnings(), KilnGraphs() as graphs:
        from kiln import KilnFallbackWarning

        warnings.simplefilter("error", KilnFallbackWarning)
        first = cpu_results(step(inputs))
    verdict = check(case, first, ref, fp64)
    assert verdict["ok"], f"{name} ({mode}): {verdict['accuracy']}"
    assert graphs.graphs >= 1, f"{name}: Kiln compiled no graph"
    return graphs


@pytest.mark.parametrize("name", INFERENCE)
def test_inference(name: str) -> None:
    torch.manual_seed(0)
    _run(name, "inference")


@pytest.mark.parametrize("name", TRAIN)
def test_training_step(name: str) -> None:
    torch.manual_seed(0)
    graphs = _run(name, "train")
    assert graphs.graphs >= 2, "a training step compiles a forward and a backward graph"
