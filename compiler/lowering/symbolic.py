"""Size arithmetic in a graph with dynamic shapes: SymInt values are sympy expressions.

AOTAutograd passes dynamic sizes as SymInt inputs and computes others with ``operator``
functions (``mul = arg0_1 * 128``) or ``aten.sym_size``; lowering evaluates them to
sympy expressions over the size symbols, which the views and loops then use like ints.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import sympy
import torch

from ..ir.nodes import IRNode
from ..ir.sym import Expr, FloorDiv, ModularIndexing


def _size(value: Any) -> Expr:
    if isinstance(value, bool) or not isinstance(value, (int, sympy.Expr)):
        raise ValueError(f"size arithmetic on a {type(value).__name__} "
                            "(only integer sizes are supported)")
    return sympy.sympify(value)


def _binary(fn: Callable[[Expr, Expr], Expr]) -> Callable[..., Expr]:
    def op(a: Any, b: Any) -> Expr:
        return fn(_size(a), _size(b))

    return op


def _floordiv(a: Expr, b: Expr) -> Expr:
    _non_negative(a, b)
    return FloorDiv(a, b)


def _mod(a: Expr, b: Expr) -> Expr:
    _non_negative(a, b)
    return ModularIndexing(a, sympy.Integer(1), b)


def _non_negative(*values: Expr) -> None:
    # Kiln's FloorDiv and ModularIndexing mean Python's // and % for non-negative values.
    for v in values:
        if not (v.is_nonnegative or (v.is_Integer and int(v) >= 0)):
            raise ValueError(f"// or % of size {v}, which may be negative")


def _dim_of(x: IRNode, dim: int, sizes: Any) -> Expr:
    values = tuple(sizes)
    return sympy.sympify(values[dim if dim >= 0 else dim + len(values)])


SYMBOLIC_OPS: dict[Any, Callable[..., Any]] = {
    operator.add: _binary(lambda a, b: a + b),
    operator.sub: _binary(lambda a, b: a - b),
    operator.mul: _binary(lambda a, b: a * b),
    operator.floordiv: _binary(_floordiv),
    operator.mod: _binary(_mod),
    operator.neg: lambda a: -_size(a),
    torch.sym_max: _binary(lambda a, b: sympy.Max(a, b)),
    torch.sym_min: _binary(lambda a, b: sympy.Min(a, b)),
    torch.ops.aten.sym_size.int: lambda x, dim: _dim_of(x, dim, x.get_size()),
    torch.ops.aten.sym_stride.int: lambda x, dim: _dim_of(x, dim, x.get_stride()),
    torch.ops.aten.sym_numel.default:
        lambda x: sympy.Mul(*[sympy.sympify(s) for s in x.get_size()]),
}
