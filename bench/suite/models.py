"""The suite's model list: every model by name, from HF transformers, timm and
torchvision (``bench/suite/hf.py``, ``timm_models.py``, ``tv.py``)."""

from __future__ import annotations

from .hf import HF_MODELS
from .spec import ModelSpec
from .timm_models import TIMM_MODELS
from .tv import TV_MODELS

MODELS: dict[str, ModelSpec] = {m.name: m for m in [*HF_MODELS, *TIMM_MODELS, *TV_MODELS]}
SUITES = ("hf", "timm", "torchvision")


def select(names: str | None, mode: str) -> list[ModelSpec]:
    """The models ``--models`` names (comma-separated; a suite name means all of it; None
    means all), those with a training step only in ``train`` mode, in list order."""
    wanted = [n.strip() for n in (names or "").split(",") if n.strip()]
    unknown = [n for n in wanted if n not in MODELS and n not in SUITES]
    if unknown:
        raise SystemExit(f"unknown models: {unknown}; known: {sorted(MODELS)}")
    chosen = [m for m in MODELS.values()
              if not wanted or m.name in wanted or m.suite in wanted]
    if mode == "train":
        chosen = [m for m in chosen if m.train]
    if mode == "dynamic":
        chosen = [m for m in chosen if m.dynamic_dim is not None]
    return chosen
