"""Size variables: what the compiler may assume about symbolic sizes.

A graph with dynamic shapes names its sizes ``s0, s1, ...`` (canonically, by first
appearance among the inputs); each has the value range that Dynamo's guards admit. The
compiled artifact serves every size in those ranges, so a decision here is one of:

- *proved*: true for every admitted size (``statically_known_*``): equal ranges for
  fusion, equal storage for buffer reuse, a bound for a persistent reduction;
- *heuristic*: from a representative *hint* (``size_hint``), for choices that change
  speed and never results (block sizes, loop order, how much to parallelize).

There is no guard to add afterwards (Dynamo guarded before the graph reached Kiln), so a
fact that cannot be proved takes the general path. Static graphs use the same object
with no symbols: every decision is then exact.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sympy

from .ir.sym import Expr

# The hint of an unbounded size: big enough that heuristics pick the general kernels.
UNBOUNDED_HINT = 8192


class SymbolicTensor:
    """What a worker knows of a tensor with symbolic sizes (a FakeTensor would need
    values): sizes, strides and offset over ``s0, s1, ...``, dtype and device."""

    def __init__(self, shape: Sequence[Any], stride: Sequence[Any], dtype: Any, device: Any,
                 offset: Any = 0) -> None:
        self.shape, self._stride = tuple(shape), tuple(stride)
        self.dtype, self.device, self._offset = dtype, device, offset

    def stride(self) -> tuple[Any, ...]:
        return self._stride

    def storage_offset(self) -> Any:
        return self._offset

    def dim(self) -> int:
        return len(self.shape)


def size_symbol(index: int) -> sympy.Symbol:
    """The canonical name of the ``index``-th size variable of a graph."""
    return sympy.Symbol(f"s{index}", integer=True, positive=True)


@dataclass(frozen=True)
class SymbolRange:
    """The values a size variable may take (``upper`` None: unbounded)."""

    lower: int
    upper: int | None

    def hint(self) -> int:
        """A representative value: the upper bound if small, else a large one."""
        value = UNBOUNDED_HINT if self.upper is None else min(self.upper, UNBOUNDED_HINT)
        return max(self.lower, value)


class SizeVars:
    """The ranges of a graph's size variables, and decisions over them."""

    def __init__(self, ranges: Mapping[sympy.Symbol, SymbolRange] | None = None) -> None:
        self.ranges: dict[sympy.Symbol, SymbolRange] = dict(ranges or {})

    @property
    def symbols(self) -> list[sympy.Symbol]:
        return sorted(self.ranges, key=lambda s: int(s.name[1:]))

    def is_dynamic(self) -> bool:
        return bool(self.ranges)

    # -- heuristics: representative values ----------------------------------------------

    def size_hint(self, expr: Expr | int) -> int:
        """``expr`` at every symbol's hint (exact for a static expression)."""
        expr = sympy.sympify(expr)
        if expr.is_Integer:
            return int(expr)
        values = {s: self.ranges[s].hint() if s in self.ranges else UNBOUNDED_HINT
                  for s in expr.free_symbols}
        return int(_evaluate(expr, values))

    def size_hints(self, exprs: Iterable[Expr | int]) -> list[int]:
        return [self.size_hint(e) for e in exprs]

    # -- proofs ----------------------------------------------------------------------------

    def statically_known_equals(self, a: Expr | int, b: Expr | int) -> bool:
        """True only when ``a == b`` for every admitted size."""
        diff = sympy.expand(sympy.sympify(a) - sympy.sympify(b))
        return bool(diff == 0)

    def upper_bound(self, expr: Expr | int) -> int | None:
        """The largest value of ``expr`` over the admitted sizes, when the ranges bound it
        (a polynomial with non-negative coefficients); None when unbounded or unknown."""
        expr = sympy.expand(sympy.sympify(expr))
        if expr.is_Integer:
            return int(expr)
        if not _monotone(expr):
            return None
        values: dict[sympy.Symbol, int] = {}
        for s in expr.free_symbols:
            r = self.ranges.get(s)
            if r is None or r.upper is None:
                return None
            values[s] = r.upper
        return int(_evaluate(expr, values))

    def lower_bound(self, expr: Expr | int) -> int | None:
        """The smallest value of ``expr`` over the admitted sizes (a polynomial with
        non-negative coefficients); None when unknown."""
        expr = sympy.expand(sympy.sympify(expr))
        if expr.is_Integer:
            return int(expr)
        if not _monotone(expr):
            return None
        values = {s: self.ranges[s].lower if s in self.ranges else 0
                  for s in expr.free_symbols}
        return int(_evaluate(expr, values))

    def statically_known_geq(self, a: Expr | int, bound: Expr | int) -> bool:
        """True only when ``a >= bound`` for every admitted size."""
        diff = sympy.expand(sympy.sympify(a) - sympy.sympify(bound))
        if diff.is_Integer:
            return int(diff) >= 0
        lb = self.lower_bound(diff)
        return lb is not None and lb >= 0

    def statically_known_leq(self, a: Expr | int, bound: int) -> bool:
        """True only when ``a <= bound`` for every admitted size."""
        ub = self.upper_bound(a)
        return ub is not None and ub <= bound

    def static_value(self, expr: Expr | int) -> int | None:
        """The value of ``expr`` if it has no symbols."""
        expr = sympy.sympify(expr)
        return int(expr) if expr.is_Integer else None


def _monotone(expr: Expr) -> bool:
    """A constant plus products of symbols and powers with non-negative coefficients:
    its extremes over boxes of sizes are at the boxes' corners."""
    for term in sympy.Add.make_args(expr):
        if term.is_Integer:
            continue
        coeff, rest = term.as_coeff_Mul()
        if coeff < 0:
            return False
        for factor in sympy.Mul.make_args(rest):
            base = factor.args[0] if isinstance(factor, sympy.Pow) else factor
            if not (isinstance(base, sympy.Symbol) or base.is_Integer):
                return False
            if isinstance(factor, sympy.Pow) and not (factor.args[1].is_Integer
                                                      and factor.args[1] > 0):
                return False
    return True


def _evaluate(expr: Expr, values: Mapping[sympy.Symbol, int]) -> int:
    """``expr`` with symbols replaced by values (Kiln's FloorDiv/ModularIndexing included)."""
    result = expr.xreplace({s: sympy.Integer(v) for s, v in values.items()})
    if not result.is_Integer:
        result = sympy.simplify(result)
    if not result.is_Integer:
        raise ValueError(f"size {expr} does not evaluate to an integer at {dict(values)}")
    return int(result)


def free_size_symbols(exprs: Iterable[Expr | int]) -> set[sympy.Symbol]:
    """The size variables (``s<N>``) among the free symbols of ``exprs``."""
    out: set[sympy.Symbol] = set()
    for e in exprs:
        for s in sympy.sympify(e).free_symbols:
            if isinstance(s, sympy.Symbol) and is_size_symbol(s):
                out.add(s)
    return out


def is_size_symbol(s: sympy.Symbol) -> bool:
    return s.name.startswith("s") and s.name[1:].isdigit()
