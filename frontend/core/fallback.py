"""A graph Kiln cannot compile runs eagerly, with one warning naming the graph and the
stage: the backend never raises into the user's program. Tests and benchmarks turn
``KilnFallbackWarning`` into an error, so that a graph run eagerly never counts as Kiln's."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger("kiln.backend")


class KilnFallbackWarning(UserWarning):
    """A graph runs eagerly because Kiln could not compile it."""

def eager_instead(gm: torch.fx.GraphModule, name: str, error: Exception
                  ) -> Callable[..., Any]:
    """Graph ``name`` run eagerly because its compile failed with ``error``: one
    warning naming the graph and the stage."""
    from torch._functorch.aot_autograd import make_boxed_func

    stage = getattr(error, "stage", "compile")
    warn_eager(name, stage, f"{type(error).__name__}: {error}")
    log.debug("kiln compile failure for %s", name, exc_info=error)
    return make_boxed_func(gm.forward)

def warn_eager(name: str, stage: str, reason: str) -> None:
    warnings.warn(f"kiln: graph {name} runs eagerly (stage {stage}): {reason}",
                  KilnFallbackWarning, stacklevel=3)
