"""The IR interpreter: an ops handler that evaluates loop bodies with torch operations.

Every index variable becomes an int64 tensor along its own axis, so one call of an
``inner_fn`` evaluates all elements at once. With it every lowering is checked against
eager before any code generation exists, and the same handler runs whole lowered graphs.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch

from .ir.extern import ExternKernel, FallbackKernel, MultiOutput, fill_template
from .ir.layout import Layout, MutationLayout
from .ir.nodes import Buffer, ComputedBuffer, IRNode, Reduction, ReinterpretView, Scatter
from .ir.sym import Expr, FloorDiv, ModularIndexing
from .ops_handler import BINARY_OPS, UNARY_OPS, DefaultHandler
from .virtualized import V

Tensor = torch.Tensor
_REDUCED = (torch.float16, torch.bfloat16)
_sym_ids = itertools.count()


def _upcast(t: Tensor) -> Tensor:
    return t.float() if t.dtype in _REDUCED else t


_UNARY_FNS: dict[str, Callable[[Tensor], Tensor]] = {
    "relu": torch.relu, "sigmoid": torch.sigmoid, "rsqrt": torch.rsqrt,
    "logical_not": torch.logical_not, "bitwise_not": torch.bitwise_not,
    "isnan": torch.isnan, "isinf": torch.isinf, "isfinite": torch.isfinite,
    "signbit": torch.signbit, "erfinv": torch.erfinv, "lgamma": torch.lgamma,
    "reciprocal": torch.reciprocal, "square": torch.square,
}
_BINARY_FNS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "truediv": torch.true_divide, "floordiv": torch.floor_divide,
    "truncdiv": lambda a, b: torch.div(a, b, rounding_mode="trunc"),
    "bitwise_left_shift": torch.bitwise_left_shift,
    "bitwise_right_shift": torch.bitwise_right_shift,
}


def eval_expr(expr: Expr, env: dict[sympy.Symbol, Any]) -> Any:
    """Evaluate an integer index expression with int64 tensors bound to its symbols."""
    if isinstance(expr, (int, sympy.Integer)):
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        return env[expr]
    args = [eval_expr(a, env) for a in expr.args]
    if isinstance(expr, sympy.Add):
        return sum(args[1:], args[0])
    if isinstance(expr, sympy.Mul):
        out = args[0]
        for a in args[1:]:
            out = out * a
        return out
    if isinstance(expr, FloorDiv):
        return _floordiv(args[0], args[1])
    if isinstance(expr, ModularIndexing):
        return _floordiv(args[0], args[1]) % args[2]
    if isinstance(expr, sympy.Max):
        return _fold(torch.maximum, max, args)
    if isinstance(expr, sympy.Min):
        return _fold(torch.minimum, min, args)
    if isinstance(expr, sympy.Pow) and isinstance(expr.args[1], sympy.Integer):
        return args[0] ** int(expr.args[1])
    raise NotImplementedError(f"index expression {expr} ({type(expr).__name__})")


def _floordiv(a: Any, b: Any) -> Any:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return torch.div(torch.as_tensor(a), b, rounding_mode="floor")
    return a // b


def _fold(tensor_fn: Callable[..., Any], py_fn: Callable[..., Any], args: list[Any]) -> Any:
    out = args[0]
    for a in args[1:]:
        if isinstance(out, Tensor) or isinstance(a, Tensor):
            out = tensor_fn(torch.as_tensor(out), torch.as_tensor(a))
        else:
            out = py_fn(out, a)
    return out


class InterpreterHandler(DefaultHandler[Tensor]):
    """Evaluates ops on tensors; loads read flat storages from ``storages``."""

    def __init__(self, storages: dict[str, Tensor], index_env: dict[sympy.Symbol, Any],
                 reduction_axes: int = 0) -> None:
        self.storages = storages
        self.env = index_env
        self.reduction_axes = reduction_axes
        self.masks: list[Tensor] = []

    def _index(self, index: Expr, numel: int) -> Tensor:
        flat = torch.as_tensor(eval_expr(index, self.env), dtype=torch.int64)
        for mask in self.masks:  # masked-off lanes may index anywhere: point them at 0
            flat = torch.where(mask, flat, torch.zeros((), dtype=torch.int64))
        return flat.clamp(0, max(numel - 1, 0)) if self.masks else flat

    def load(self, name: str, index: Expr) -> Tensor:
        storage = self.storages[name]
        return _upcast(storage[self._index(index, storage.numel())])

    def store(self, name: str, index: Expr, value: Tensor, mode: str | None = None) -> None:
        raise RuntimeError("the interpreter stores through evaluate_loops")

    def store_reduction(self, name: str, index: Expr, value: Tensor) -> None:
        raise RuntimeError("the interpreter stores through evaluate_loops")

    def constant(self, value: Any, dtype: torch.dtype) -> Tensor:
        dt = torch.float32 if dtype in _REDUCED else dtype
        if isinstance(value, float) and not dt.is_floating_point and math.isinf(value):
            value = torch.iinfo(dt).max if value > 0 else torch.iinfo(dt).min
        return torch.tensor(value, dtype=dt)

    def index_expr(self, expr: Expr, dtype: torch.dtype) -> Tensor:
        return torch.as_tensor(eval_expr(expr, self.env)).to(dtype)

    def to_dtype(self, x: Tensor, dtype: torch.dtype, src_dtype: torch.dtype | None = None
                 ) -> Tensor:
        return x.to(dtype)

    def to_dtype_bitcast(self, x: Tensor, dtype: torch.dtype, src_dtype: torch.dtype) -> Tensor:
        return x.to(src_dtype).view(dtype)

    def indirect_indexing(self, x: Tensor, size: Expr, check: bool = True) -> sympy.Symbol:
        sym = sympy.Symbol(f"indirect_eval{next(_sym_ids)}", integer=True)
        x = x.to(torch.int64)
        self.env[sym] = torch.where(x < 0, x + int(size), x)
        return sym

    def masked(self, mask: Tensor, body: Callable[[], Tensor], other: Any) -> Tensor:
        mask = torch.as_tensor(mask).to(torch.bool)
        self.masks.append(mask)
        try:
            value = body()
        finally:
            self.masks.pop()
        return torch.where(mask, value, torch.tensor(other, dtype=value.dtype))

    def where(self, cond: Tensor, a: Tensor, b: Tensor) -> Tensor:
        return torch.where(torch.as_tensor(cond).to(torch.bool), a, b)

    def getitem(self, x: Any, i: int) -> Tensor:
        return x[i]

    def reduction(self, dtype: torch.dtype, src_dtype: torch.dtype, reduction_type: str,
                  value: Tensor) -> Any:
        return reduce_trailing(value, self.full_shape, self.reduction_axes, reduction_type)

    def _default(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Tensor:
        targs = [torch.as_tensor(a) for a in args]
        if name in _UNARY_FNS:
            return _UNARY_FNS[name](targs[0])
        if name in _BINARY_FNS:
            return _BINARY_FNS[name](*targs)
        if name == "remainder":
            return torch.remainder(*targs)
        if name in UNARY_OPS or name in BINARY_OPS:
            return getattr(torch, name)(*targs)
        raise NotImplementedError(name)

    full_shape: tuple[int, ...] = ()


def reduce_trailing(value: Tensor, shape: tuple[int, ...], naxes: int, kind: str) -> Any:
    """Reduce the last ``naxes`` axes of ``value`` (broadcast to ``shape``)."""
    value = torch.as_tensor(value).expand(shape)
    keep = shape[: len(shape) - naxes]
    flat = value.reshape(*keep, -1)
    acc = flat if flat.dtype.is_floating_point or kind in ("any", "all") else flat
    if kind == "sum":
        return acc.sum(-1)
    if kind == "prod":
        return acc.prod(-1)
    if kind == "max":
        return acc.amax(-1)
    if kind == "min":
        return acc.amin(-1)
    if kind == "argmax":
        return acc.argmax(-1)
    if kind == "argmin":
        return acc.argmin(-1)
    if kind == "any":
        return acc.to(torch.bool).any(-1)
    if kind == "all":
        return acc.to(torch.bool).all(-1)
    if kind == "xor_sum":
        out = acc[..., 0]
        for i in range(1, acc.shape[-1]):
            out = out ^ acc[..., i]
        return out
    if kind == "welford_reduce":
        acc = acc.to(torch.float64) if acc.dtype == torch.float64 else acc.float()
        mean = acc.mean(-1)
        m2 = ((acc - mean.unsqueeze(-1)) ** 2).sum(-1)
        weight = torch.full_like(mean, acc.shape[-1])
        return (mean, m2, weight)
    raise NotImplementedError(f"reduction {kind}")


def evaluate_loops(node: IRNode, storages: dict[str, Tensor]) -> Tensor:
    """All elements of a Pointwise or Reduction, as a contiguous tensor of its size."""
    ranges = [int(s) for s in node.get_size()]
    rranges = [int(s) for s in node.get_reduction_size()] if isinstance(node, Reduction) else []
    shape = tuple(ranges + rranges)
    syms, handler = _handler_over(shape, storages, len(rranges))
    with V.set_ops_handler(handler):
        if isinstance(node, Reduction):
            value = handler.reduction(node.dtype, node.src_dtype, node.reduction_type,
                                      node.inner_fn(syms[: len(ranges)], syms[len(ranges):]))
            if node.output_index is not None:
                value = value[node.output_index]
            return torch.as_tensor(value).to(node.dtype).expand(tuple(ranges)).contiguous()
        value = node.inner_fn(syms)  # type: ignore[attr-defined]
    return torch.as_tensor(value).to(node.get_dtype()).expand(shape).contiguous()


def _handler_over(shape: tuple[int, ...], storages: dict[str, Tensor], reduction_axes: int
                  ) -> tuple[list[sympy.Symbol], InterpreterHandler]:
    """Index symbols bound to aranges along their own axes, and a handler over them."""
    syms = [sympy.Symbol(f"ev{i}", integer=True, nonnegative=True) for i in range(len(shape))]
    env: dict[sympy.Symbol, Any] = {}
    for i, (sym, n) in enumerate(zip(syms, shape)):
        view = [1] * len(shape)
        view[i] = n
        env[sym] = torch.arange(n, dtype=torch.int64).reshape(view)
    handler = InterpreterHandler(storages, env, reduction_axes)
    handler.full_shape = shape
    return syms, handler


def evaluate_scatter(node: Scatter, layout: MutationLayout, storages: dict[str, Tensor]
                     ) -> None:
    """Write a Scatter's values into its target's storage, as its kernel would."""
    shape = tuple(int(s) for s in node.get_size())
    syms, handler = _handler_over(shape, storages, 0)
    with V.set_ops_handler(handler):
        value = node.inner_fn(syms)
        where = eval_expr(layout.make_indexer()(node.output_indexer(syms)), handler.env)
    target = storages[layout.target]
    flat = torch.as_tensor(where, dtype=torch.int64).expand(shape).reshape(-1)
    value = torch.as_tensor(value).to(target.dtype).expand(shape).reshape(-1)
    if node.scatter_mode is None:
        target[flat] = value
    elif node.scatter_mode == "atomic_add":
        target.index_put_((flat,), value, accumulate=True)
    else:
        reduce = {"atomic_max": "amax", "atomic_min": "amin"}[node.scatter_mode]
        target.scatter_reduce_(0, flat, value, reduce)


def flat_storage(t: Tensor) -> Tensor:
    """The whole storage under ``t`` as a 1-D tensor of its dtype."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return t.as_strided((n,), (1,), 0)


def _strided(storage: Tensor, layout: Layout) -> Tensor:
    return storage.as_strided([int(s) for s in layout.size], [int(s) for s in layout.stride],
                              int(layout.offset))


def run_graph(graph: Any, inputs: Sequence[Tensor]) -> list[Any]:
    """Evaluate a lowered graph on real inputs with the interpreter; return its outputs."""
    storages: dict[str, Tensor] = {}
    tensors: dict[str, Any] = {}
    for name, t in zip(graph.graph_input_names, inputs):
        storages[name], tensors[name] = flat_storage(t), t
    for name, t in graph.constants.items():
        storages[name], tensors[name] = flat_storage(t), t
    with V.set_graph_handler(graph):
        for buf in graph.buffers:
            _evaluate_buffer(buf, storages, tensors)
    outs: list[Any] = []
    for out in graph.graph_outputs:
        if isinstance(out, ReinterpretView):
            outs.append(_strided(storages[out.get_name()], out.layout))
        elif isinstance(out, Buffer):
            outs.append(tensors[out.get_name()])
        else:
            outs.append(out)
    return outs


def _evaluate_buffer(buf: Buffer, storages: dict[str, Tensor], tensors: dict[str, Any]) -> None:
    name = buf.get_name()
    if isinstance(buf, ComputedBuffer):
        layout = buf.get_layout()
        if isinstance(buf.data, Scatter) and isinstance(layout, MutationLayout):
            evaluate_scatter(buf.data, layout, storages)
            storages[name], tensors[name] = storages[layout.target], _strided(
                storages[layout.target], layout)
            return
        value = evaluate_loops(buf.data, storages)
        if isinstance(layout, MutationLayout):
            target = _strided(storages[layout.target], layout)
            target.copy_(value)
            storages[name], tensors[name] = storages[layout.target], target
            return
        out = torch.empty_strided([int(s) for s in layout.size],
                                  [int(s) for s in layout.stride], dtype=layout.dtype)
        out.copy_(value)
        storages[name], tensors[name] = flat_storage(out), out
        return
    if isinstance(buf, MultiOutput):
        assert buf.parent is not None
        value = tensors[buf.parent.get_name()]
        for i in buf.indices:
            value = value[i]
        storages[name], tensors[name] = flat_storage(value), value
        return
    if isinstance(buf, ExternKernel):
        args = [_input_tensor(x, storages, tensors) for x in buf.inputs]
        if buf.out_variant is not None:
            lay = buf.get_layout()
            value = torch.empty_strided([int(v) for v in lay.size], [int(v) for v in lay.stride],
                                        dtype=lay.dtype)
            buf.out_variant(*args, *buf.constant_args, **buf.kwargs, out=value)
        elif isinstance(buf, FallbackKernel):
            value = buf.op_overload(*fill_template(buf.args_template, args.__getitem__),
                                    **fill_template(buf.kwargs_template, args.__getitem__))
        else:
            value = buf.op_overload(*args, *buf.constant_args, **buf.kwargs)
        if isinstance(value, Tensor) and isinstance(buf.layout, Layout):
            value = _as_declared(value, buf.layout)
        tensors[name] = value
        if isinstance(value, Tensor):
            storages[name] = flat_storage(value)


def _as_declared(value: Tensor, layout: Layout) -> Tensor:
    """``value`` in the layout the IR declared for it (from the op's meta function).

    Consumers load the buffer through the declared strides; where eager's result is laid
    out otherwise (a meta function that disagrees with the kernel), copy it over.
    """
    size = [int(s) for s in layout.size]
    stride = [int(s) for s in layout.stride]
    if list(value.shape) != size or all(
            a == b or n == 1 for a, b, n in zip(value.stride(), stride, size)):
        return value
    out = torch.empty_strided(size, stride, dtype=value.dtype, device=value.device)
    return out.copy_(value)


def _input_tensor(x: IRNode, storages: dict[str, Tensor], tensors: dict[str, Any]) -> Tensor:
    if isinstance(x, ReinterpretView):
        return _strided(storages[x.get_name()], x.layout)
    assert isinstance(x, Buffer)
    return tensors[x.get_name()]
