"""The ``lowerings`` registry and the factories that fill it.

``@register_lowering(aten.op)`` maps an ATen op (every overload of a packet) to a
function from TensorBoxes and Python values to a TensorBox. ``make_pointwise`` turns an
ops-level function into such a lowering: it broadcasts, applies ATen's type promotion,
and builds a ``Pointwise`` whose ``inner_fn`` closes over the inputs' loaders.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
from torch._prims_common import ELEMENTWISE_TYPE_PROMOTION_KIND, elementwise_dtypes

from ..ir.nodes import IRNode, Pointwise, TensorBox, View
from ..ir.sym import Expr
from ..virtualized import V, ops

Lowering = Callable[..., Any]
class LoweringTable(dict[Any, Lowering]):
    """The lowerings, by op overload. A few ops exist only once another part of torch is
    imported (``prims.fma``: Inductor's prims module, which core ATen's ``addcmul``
    decomposition uses); their lowerings wait in ``late`` by qualified name
    (``prims::fma``) and are filed under the overload at its first lookup."""

    late: dict[str, Lowering] = {}

    def __missing__(self, op: Any) -> Lowering:
        fn = self._file_late(op)
        if fn is None:
            raise KeyError(op)
        return fn

    def __contains__(self, op: object) -> bool:
        return dict.__contains__(self, op) or self._file_late(op) is not None

    def _file_late(self, op: object) -> Lowering | None:
        if not isinstance(op, torch._ops.OpOverload):
            return None
        fn = self.late.get(op.name())
        if fn is not None:
            self[op] = fn
        return fn


lowerings: LoweringTable = LoweringTable()


def register_late_lowering(qualname: str, fn: Lowering) -> Lowering:
    """Register ``fn`` for every overload of the op named ``qualname`` (``prims::fma``),
    an op torch may define only later in the process."""
    LoweringTable.late[qualname] = fn
    return fn

DEFAULT = ELEMENTWISE_TYPE_PROMOTION_KIND.DEFAULT
INT_TO_FLOAT = ELEMENTWISE_TYPE_PROMOTION_KIND.INT_TO_FLOAT
ALWAYS_BOOL = ELEMENTWISE_TYPE_PROMOTION_KIND.ALWAYS_BOOL
NO_OPMATH = ELEMENTWISE_TYPE_PROMOTION_KIND.NO_OPMATH
BOOL_TO_LONG = ELEMENTWISE_TYPE_PROMOTION_KIND.BOOL_TO_LONG
COMPLEX_TO_FLOAT = ELEMENTWISE_TYPE_PROMOTION_KIND.COMPLEX_TO_FLOAT


def _overloads(op: Any) -> list[Any]:
    if isinstance(op, torch._ops.OpOverloadPacket):
        return [getattr(op, name) for name in op.overloads()]
    return [op]


def register_lowering(*aten_fns: Any, broadcast: bool = False) -> Callable[[Lowering], Lowering]:
    """Register ``fn`` as the lowering of each op (all overloads of a packet)."""

    def decorator(fn: Lowering) -> Lowering:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if broadcast:
                args = tuple(broadcast_all(list(args)))
            return fn(*args, **kwargs)

        wrapped.__name__ = fn.__name__
        wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
        for op in aten_fns:
            for overload in _overloads(op):
                lowerings[overload] = wrapped
        return fn

    return decorator


def is_tensor(x: Any) -> bool:
    return isinstance(x, IRNode)


def _meta_like(x: Any) -> Any:
    if is_tensor(x):
        return torch.empty([1] * len(x.get_size()), dtype=x.get_dtype(), device="meta")
    return x


def promote_dtypes(args: Sequence[Any], kind: ELEMENTWISE_TYPE_PROMOTION_KIND
                   ) -> tuple[torch.dtype, torch.dtype]:
    """ATen's (computation dtype, result dtype) for the elementwise op's arguments."""
    metas = [_meta_like(a) for a in args if is_tensor(a) or isinstance(a, (bool, int, float))]
    compute, result = elementwise_dtypes(*metas, type_promotion_kind=kind)
    return compute, result


def broadcast_shapes(*shapes: Sequence[Expr]) -> tuple[Expr, ...]:
    ndim = max((len(s) for s in shapes), default=0)
    out: list[Expr] = [sympy.Integer(1)] * ndim
    for shape in shapes:
        for i, s in enumerate(shape):
            j = ndim - len(shape) + i
            if s != 1:
                if out[j] != 1 and out[j] != s:
                    raise ValueError(f"shapes {shapes} do not broadcast")
                out[j] = s
    return tuple(out)


def expand(x: IRNode, size: Sequence[Expr]) -> IRNode:
    """Broadcast ``x`` to ``size`` as an index-remapping view (no copy)."""
    old = list(x.get_size())
    size = tuple(size)
    if tuple(old) == size:
        return x
    skip = len(size) - len(old)

    def reindex(index: Sequence[Expr]) -> list[Expr]:
        return [sympy.Integer(0) if o == 1 and n != 1 else index[skip + i]
                for i, (o, n) in enumerate(zip(old, size[skip:]))]

    return TensorBox(View(x.data if isinstance(x, TensorBox) else x, size, reindex, "expand"))


def broadcast_all(args: list[Any]) -> list[Any]:
    tensors = [a for a in args if is_tensor(a)]
    if not tensors:
        return args
    shape = broadcast_shapes(*[t.get_size() for t in tensors])
    return [expand(a, shape) if is_tensor(a) else a for a in args]


def make_pointwise(
    fn: Callable[..., Any],
    *,
    override_return_dtype: torch.dtype | None = None,
    promotion: ELEMENTWISE_TYPE_PROMOTION_KIND | None = DEFAULT,
) -> Lowering:
    """Build a pointwise lowering from ``fn(*values) -> value`` over the ops protocol."""

    def inner(*args: Any) -> TensorBox:
        tensors = [a for a in args if is_tensor(a)]
        assert tensors, "a pointwise op needs at least one tensor"
        if promotion is None:
            compute = result = tensors[0].get_dtype()
        else:
            # Before broadcasting: a 0-d tensor promotes less than a dimensioned one.
            compute, result = promote_dtypes(list(args), promotion)
            if compute in (torch.float16, torch.bfloat16):
                compute = torch.float32  # fp32 math for reduced-precision data
        if override_return_dtype is not None:
            result = override_return_dtype
        args_list = broadcast_all(list(args))
        tensors = [a for a in args_list if is_tensor(a)]
        loaders = [value_loader(a, compute) for a in args_list]
        device = tensors[0].get_device()

        def inner_fn(index: Sequence[Expr]) -> Any:
            out = fn(*[load(index) for load in loaders])
            return out if result == compute else ops.to_dtype(out, result)

        return Pointwise.create(device, result, inner_fn, tensors[0].get_size())

    return inner


def value_loader(a: Any, dtype: torch.dtype) -> Callable[[Sequence[Expr]], Any]:
    """A loader of ``a`` (a tensor or a Python scalar) as values of ``dtype``."""
    if is_tensor(a):
        load = a.make_loader()
        src = a.get_dtype()
        if src == dtype:
            return load
        return lambda index: ops.to_dtype(load(index), dtype, src)
    value = a
    if isinstance(value, sympy.Expr) and not value.is_number:
        # A size of the graph (a SymInt input, ``x.shape[0]``): read at run time.
        return lambda index: ops.index_expr(value, dtype)
    return lambda index: ops.constant(value, dtype)


def ops_wrapper(name: str) -> Callable[..., Any]:
    """The ops-level function that calls ``ops.<name>`` on its arguments."""

    def fn(*args: Any) -> Any:
        return getattr(ops, name)(*args)

    fn.__name__ = name
    return fn


def register_pointwise(
    aten_fn: Any,
    name: str | None = None,
    *,
    promotion: ELEMENTWISE_TYPE_PROMOTION_KIND | None = DEFAULT,
    override_return_dtype: torch.dtype | None = None,
) -> Lowering:
    """Register ``aten_fn`` as the pointwise op ``ops.<name>``."""
    name = name or aten_fn.__name__
    fn = make_pointwise(ops_wrapper(name), promotion=promotion,
                        override_return_dtype=override_return_dtype)
    register_lowering(aten_fn)(fn)
    return fn


def current_device() -> torch.device:
    return V.graph.default_device


def eager_strides(arg: int | None = None) -> tuple[int, ...] | None:
    """Eager's dense strides for the node being lowered (or its ``arg``-th input), if known.

    Read from the FX node's ``val`` meta; None when there is none or it is not dense
    (a gap or an overlap cannot be the layout of a fresh buffer).
    """
    node = V.graph.current_node
    if node is not None and arg is not None:
        node = node.args[arg] if len(node.args) > arg else None
    meta = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(meta, torch.Tensor):
        return None
    expected = 1
    for stride, size in sorted((s, n) for s, n in zip(meta.stride(), meta.shape) if n != 1):
        if stride != expected:
            return None
        expected *= size
    return tuple(meta.stride())



def size_value(n: Expr | int, dtype: torch.dtype) -> Any:
    """A size as a value in a loop body: a constant, or (dynamic shapes) computed from the
    kernel's size arguments."""
    n = sympy.sympify(n)
    if n.is_Integer:
        return ops.constant(int(n), dtype)
    return ops.to_dtype(ops.index_expr(n, torch.int64), dtype)
