"""When a node runs eagerly inside a compiled graph (a ``FallbackKernel``), and the
effectful higher-order op whose nodes always do.

``GraphLowering`` asks ``eager_reason`` before it looks a node's op up in the
``lowerings`` registry: an op with no lowering, or one that touches complex values (the
code generators have no complex type), becomes a ``FallbackKernel`` and the rest of the
graph stays compiled. A lowering that raises does too (the graph logs a warning); one
that raises ``EagerInstead`` chose ATen's kernel for these arguments (a window too large
to unroll, say): the node runs eagerly the same way, its reason at debug level.
"""

from __future__ import annotations

from typing import Any

import torch

from ..ir.extern import make_fallback_call
from ..ir.nodes import IRNode
from .registry import Lowering, lowerings


class EagerInstead(Exception):
    """Raised by a lowering, before it builds any IR, when ATen's kernel is the better
    choice for these arguments; the message says why (a choice, not a fault)."""


def eager_reason(target: Any, args: Any, kwargs: Any, node: torch.fx.Node | None
                 ) -> str | None:
    """Why ``target(*args, **kwargs)`` must run eagerly, or None when it can be lowered."""
    if target not in lowerings:
        return "no lowering"
    if _touches_complex((args, kwargs)) or _touches_complex(
            node.meta.get("val") if node is not None else None):
        return "complex values (the kernel generators have no complex type)"
    return None


def _touches_complex(value: Any) -> bool:
    if isinstance(value, IRNode):
        return value.get_dtype().is_complex
    if isinstance(value, torch.Tensor):
        return value.dtype.is_complex
    if isinstance(value, torch.dtype):
        return value.is_complex
    if isinstance(value, (list, tuple)):
        return any(_touches_complex(v) for v in value)
    if isinstance(value, dict):
        return any(_touches_complex(v) for v in value.values())
    return False


def with_effects(token: IRNode, op: Any, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
    """``with_effects(token, op, *args)``: ``op`` runs eagerly, in graph order, and is
    never dropped as dead code (an error check such as ``_linalg_check_errors``); the
    token passes through (it only orders effects while tracing)."""
    out = make_fallback_call(op, args, kwargs, side_effects=True)
    if isinstance(out, tuple):
        return (token, *out)
    return (token, out)


# Higher-order ops GraphLowering lowers itself (every other call target is an ATen op).
effectful_lowerings: dict[Any, Lowering] = {
    torch.ops.higher_order.with_effects: with_effects,
}
