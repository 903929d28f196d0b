"""The ``kiln`` Dynamo backend: AOTAutograd with Kiln's decompositions, then each forward
and backward ATen graph compiled by Kiln and loaded as a callable.

A graph Kiln cannot compile (symbolic sizes, a compile error) runs eagerly, with one
warning naming the graph and the stage; the backend never raises into the user's program.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.compiler.decompositions import kiln_decompositions

from .config import KilnConfig

log = logging.getLogger("kiln.backend")
_graph_ids = itertools.count()


class KilnFallbackWarning(UserWarning):
    """A graph runs eagerly because Kiln could not compile it."""


def kiln_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                 mode: str | None = None, options: dict[str, Any] | None = None
                 ) -> Callable[..., Any]:
    """``torch.compile(model, backend="kiln", options={...})``."""
    from torch._dynamo.backends.common import aot_autograd

    config = KilnConfig.resolve(options).with_mode(mode)
    model_id = next(_graph_ids)
    from kiln.compiler.fx_passes import fuse_attention

    fuse_attention(gm)  # attention as one flash-attention call, on GPU graphs

    def compiler(kind: str) -> Callable[..., Any]:
        def compile_fn(graph: torch.fx.GraphModule, inputs: Sequence[Any]) -> Any:
            return compile_aten_graph(graph, inputs, config, f"{kind}_{model_id}")

        return compile_fn

    return aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                        inference_compiler=compiler("inference"),
                        decompositions=kiln_decompositions(),
                        keep_inference_input_mutations=True)(gm, example_inputs)


def compile_aten_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                       config: KilnConfig, name: str) -> Callable[..., Any]:
    """Compile one ATen graph; on any failure, the eager graph with one warning."""
    from torch._functorch.aot_autograd import make_boxed_func

    reason = unsupported_reason(example_inputs)
    if reason is not None:
        _warn_eager(name, "graph check", reason)
        return make_boxed_func(gm.forward)
    try:
        from .compile import compile_and_load

        return compile_and_load(gm, example_inputs, config, name)
    except Exception as e:  # the user's program must keep running
        stage = getattr(e, "stage", "compile")
        _warn_eager(name, stage, f"{type(e).__name__}: {e}")
        log.debug("kiln compile failure for %s", name, exc_info=True)
        return make_boxed_func(gm.forward)


def unsupported_reason(example_inputs: Sequence[Any]) -> str | None:
    for i, x in enumerate(example_inputs):
        if isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(
                isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride()))):
            return (f"input {i} has symbolic sizes; Kiln compiles static shapes only "
                    "(mark the model static, or pass dynamic=False to torch.compile)")
        if isinstance(x, torch.Tensor) and x.device.type not in ("cpu", "cuda"):
            return f"input {i} is on {x.device.type}, which Kiln does not target"
    return None


def _warn_eager(name: str, stage: str, reason: str) -> None:
    warnings.warn(f"kiln: graph {name} runs eagerly (stage {stage}): {reason}",
                  KilnFallbackWarning, stacklevel=3)
