"""Kiln's decomposition table: composite ATen ops rewritten into ops Kiln lowers.

Core ATen's table, plus the composites that core ATen keeps (softmax, layer norm, gelu,
...), minus the ops Kiln lowers directly (var_mean, addmm, embedding, ...).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._decomp import core_aten_decompositions, get_decompositions

aten = torch.ops.aten

_EXTRA = [
    aten._softmax, aten._log_softmax, aten.native_layer_norm, aten.gelu, aten.silu,
    aten.hardtanh, aten.leaky_relu, aten.elu, aten.hardswish, aten.hardsigmoid,
    aten.mish, aten.softplus, aten.native_group_norm, aten.native_batch_norm,
    aten._native_batch_norm_legit, aten._native_batch_norm_legit_functional,
    aten._native_batch_norm_legit_no_training, aten.logsumexp, aten.std, aten.std_mean,
    aten.log_sigmoid_forward, aten.nll_loss_forward, aten.nll_loss_backward,
    aten._softmax_backward_data, aten._log_softmax_backward_data,
    aten.native_layer_norm_backward, aten.gelu_backward, aten.silu_backward,
    aten.sigmoid_backward, aten.tanh_backward, aten.threshold_backward,
    aten.embedding_dense_backward, aten.rms_norm, aten.linear, aten.t, aten.transpose,
    aten.mv, aten.dot, aten.addcmul, aten.addcdiv, aten.lerp, aten.frac, aten.xlogy,
    aten.native_dropout_backward, aten.expand_as,
]

# Ops Kiln lowers itself even where core ATen decomposes them.
_KEEP = {
    aten.var_mean.correction, aten.var.correction, aten.addmm.default, aten.embedding.default,
    aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default,
    aten.native_dropout.default, aten.index_select.default, aten.gather.default,
    aten.where.self, aten.full.default, aten.arange.start_step, aten.arange.default,
}


def kiln_decompositions() -> dict[Any, Callable[..., Any]]:
    """The decomposition table AOTAutograd and ``trace_aten`` use for Kiln."""
    table = dict(core_aten_decompositions())
    table.update(get_decompositions(_EXTRA))
    for op in _KEEP:
        table.pop(op, None)
    return table


def trace_aten(fn: Callable[..., Any], args: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    """Trace ``fn`` to an ATen graph with Kiln's decompositions (for tests and tools)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gm = make_fx(fn, decomposition_table=kiln_decompositions(), tracing_mode="fake")(*args)
    # Name inputs as AOTAutograd does (arg0_1, arg1_1, ...), so dumps read the same.
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        node.name = node.target = f"arg{i}_1"
    gm.recompile()
    return gm
