"""Index expressions printed as Triton/Python and C++ source keep their meaning: a
dynamic graph divides by products and powers of size symbols (a causal mask over
``s1*s1`` positions per batch row)."""

from __future__ import annotations

import sympy

from kiln.compiler.codegen.common import IndexPrinter
from kiln.compiler.codegen.cpp.overrides import CppIndexPrinter
from kiln.compiler.ir.sym import FloorDiv, ModularIndexing

X = sympy.Symbol("xindex", integer=True, nonnegative=True)
S0 = sympy.Symbol("s0", integer=True, positive=True)
S1 = sympy.Symbol("s1", integer=True, positive=True)


def _python_value(expr: sympy.Expr, **values: int) -> int:
    return int(eval(IndexPrinter().print(expr), {}, values))  # noqa: S307


def test_power_divisor_and_modulus_are_parenthesized() -> None:
    exprs = [FloorDiv(X, S1**2), ModularIndexing(X, S1**2, S0), ModularIndexing(X, 1, S1**2),
             FloorDiv(X, 3 * S1**2) + 2 * S0 * S1**2, FloorDiv(X, S0 * S1**2)]
    for expr in exprs:
        for xindex, s0, s1 in ((0, 2, 3), (17, 2, 3), (250, 3, 7), (999, 5, 4)):
            want = int(expr.subs({X: xindex, S0: s0, S1: s1}).doit())
            got = _python_value(expr, xindex=xindex, s0=s0, s1=s1)
            assert got == want, (IndexPrinter().print(expr), xindex, s0, s1, got, want)
    assert IndexPrinter().print(FloorDiv(X, S1**2)) == "(xindex // (s1*s1))"
    assert CppIndexPrinter().print(FloorDiv(X, S1**2)) == "(xindex / (s1*s1))"
