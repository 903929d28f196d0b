"""Kiln's decomposition table: composite ATen ops rewritten into ops Kiln lowers.

Core ATen's table, plus the composites that core ATen keeps (softmax, layer norm, gelu,
...), minus the ops Kiln lowers directly (var_mean, addmm, embedding, ...).
"""

from __future__ import annotations

import functools
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
    aten.native_dropout_backward, aten.expand_as, aten.linalg_vector_norm, aten.repeat,
]

# Ops Kiln lowers itself even where core ATen decomposes them.
_KEEP = {
    aten.var_mean.correction, aten.var.correction, aten.addmm.default, aten.embedding.default,
    aten.clamp.default, aten.clamp_min.default, aten.clamp_max.default,
    aten.native_dropout.default, aten.index_select.default, aten.gather.default,
    aten.where.self, aten.full.default, aten.arange.start_step, aten.arange.default,
    aten.embedding_dense_backward.default,  # one fp32 scatter-add (lowering/scatter.py)
}


def kiln_decompositions() -> dict[Any, Callable[..., Any]]:
    """The decomposition table AOTAutograd and ``trace_aten`` use for Kiln (a fresh copy)."""
    return dict(_decomposition_table())


@functools.cache
def _decomposition_table() -> dict[Any, Callable[..., Any]]:
    # Built once per process: materializing core ATen's table takes about 0.1 s.
    table = dict(core_aten_decompositions())
    table.update(get_decompositions(_EXTRA))
    for op in _KEEP:
        table.pop(op, None)
    # Fused attention stays one (fallback) kernel: the vendor's flash kernels are fast, and
    # AOTAutograd's backward calls the matching backward kernel with what the forward
    # kernel saved, which a decomposed forward does not produce.
    table.pop(aten._scaled_dot_product_flash_attention_for_cpu.default, None)
    return table


def trace_aten(fn: Callable[..., Any], args: Sequence[torch.Tensor], *,
               functionalize: bool = False) -> torch.fx.GraphModule:
    """Trace ``fn`` to an ATen graph with Kiln's decompositions (for tests and tools).

    With ``functionalize`` the graph is functional, as AOTAutograd's are: in-place ops on
    intermediates become their out-of-place forms, and a mutation of an input becomes one
    ``copy_`` into it at the end. Without it, decompositions that write in place
    (``masked_fill_`` in cross entropy with label smoothing, the ``empty`` + ``copy_`` of
    ``silu_backward``) leave mutations of intermediates, which AOTAutograd never hands
    Kiln and Kiln does not lower.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    traced = _functionalized(fn) if functionalize else fn
    gm = make_fx(traced, decomposition_table=kiln_decompositions(), tracing_mode="fake")(*args)
    # Name inputs as AOTAutograd does (arg0_1, arg1_1, ...), so dumps read the same.
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        node.name = node.target = f"arg{i}_1"
    gm.recompile()
    return gm


def _functionalized(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` under Python functionalization, copying mutated inputs back at the end."""
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
    from torch.utils import _pytree as pytree

    def unwrap(t: FunctionalTensor) -> torch.Tensor:
        torch._sync(t)
        return torch._from_functional_tensor(t.elem)

    def inner(*args: Any) -> Any:
        functionalize_key = torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize)
        with torch._C._ExcludeDispatchKeyGuard(functionalize_key):
            with FunctionalTensorMode():
                wrapped = pytree.tree_map_only(torch.Tensor, FunctionalTensor.to_functional,
                                               args)
                out = fn(*wrapped)
            out = pytree.tree_map_only(FunctionalTensor, unwrap, out)
            for arg, w in zip(args, wrapped):
                mutated = torch._functionalize_has_data_mutation  # type: ignore[attr-defined]
                if isinstance(w, FunctionalTensor) and mutated(w.elem):
                    arg.copy_(unwrap(w))
        return out

    return inner
