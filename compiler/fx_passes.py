"""Graph passes on Dynamo's torch-level FX graph, before AOTAutograd.

``fuse_attention``: attention written as ``softmax(q @ k^T / s) @ v`` becomes one
``scaled_dot_product_attention`` call, so that a GPU runs it as a flash-attention
kernel (never materializing the score matrix) instead of two matmuls and a softmax.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F

_MATMUL = {operator.matmul, torch.matmul, torch.bmm}
_SOFTMAX = {torch.softmax, F.softmax, torch.Tensor.softmax}


def _is_call(node: Any, targets: set[Any], method: str) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    if node.op == "call_function" and node.target in targets:
        return True
    return node.op == "call_method" and node.target == method


def _softmax_dim(node: torch.fx.Node) -> Any:
    return node.kwargs.get("dim", node.args[1] if len(node.args) > 1 else None)


def _transposed_key(node: Any) -> torch.fx.Node | None:
    """``k`` where ``node`` is ``k.transpose(-2, -1)`` (either order)."""
    if not _is_call(node, {torch.transpose}, "transpose") or len(node.args) != 3:
        return None
    dims = set(node.args[1:])
    return node.args[0] if dims in ({-1, -2},) else None


def _scaled_scores(node: torch.fx.Node) -> tuple[torch.fx.Node, float] | None:
    """(q @ k^T node, scale) for ``scores / c`` or ``scores * c`` (or no scaling)."""
    if node.op == "call_function" and node.target in (operator.truediv, operator.mul) \
            and isinstance(node.args[1], (int, float)):
        scale = 1.0 / node.args[1] if node.target is operator.truediv else float(node.args[1])
        return node.args[0], scale  # type: ignore[return-value]
    return node, 1.0


def fuse_attention(gm: torch.fx.GraphModule, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Rewrite ``softmax(q @ k^T * scale, -1) @ v`` into SDPA on ``devices``; return
    how many were rewritten."""
    count = 0
    for out in list(gm.graph.nodes):
        if not _is_call(out, _MATMUL, "matmul") or len(out.args) != 2:
            continue
        probs, v = out.args
        if not _is_call(probs, _SOFTMAX, "softmax") or len(probs.users) != 1:
            continue
        if _softmax_dim(probs) not in (-1, 3) or probs.kwargs.get("dtype") is not None:
            continue
        found = _scaled_scores(probs.args[0])
        if found is None:
            continue
        scores, scale = found
        if not _is_call(scores, _MATMUL, "matmul") or len(scores.users) != 1:
            continue
        q, kt = scores.args
        k = _transposed_key(kt)
        if k is None or not _four_d(devices, q, k, v):
            continue
        with gm.graph.inserting_before(out):
            fused = gm.graph.call_function(F.scaled_dot_product_attention, (q, k, v),
                                           {"scale": scale})
        fused.meta = dict(out.meta)
        out.replace_all_uses_with(fused)
        count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count


def _four_d(devices: tuple[str, ...], *nodes: Any) -> bool:
    """Known 4-d (batch, heads, sequence, head dim) floating tensors on ``devices``."""
    for n in nodes:
        val = n.meta.get("example_value", n.meta.get("val")) if isinstance(n, torch.fx.Node) \
            else None
        if not isinstance(val, torch.Tensor) or val.dim() != 4 or val.device.type not in devices \
                or val.dtype not in (torch.float16, torch.bfloat16, torch.float32):
            return False
    return True
