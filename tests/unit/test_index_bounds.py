"""Bounds of index expressions over loop ranges (ir/sym.py): what lets a Triton load in
a masked body drop its guard (codegen/triton/kernel.py, ``_always_in_bounds``)."""

from __future__ import annotations

import sympy

from kiln.compiler.ir.sym import FloorDiv, ModularIndexing, index_lower_bound, index_upper_bound

X = sympy.Symbol("xindex", integer=True, nonnegative=True)
RANGES = {X: sympy.Integer(1000)}


def _brute(expr: sympy.Expr) -> tuple[int, int]:
    values = [int(expr.subs(X, x).doit()) if expr.has(X) else int(expr) for x in range(1000)]
    return min(values), max(values) + 1


def test_bounds_contain_every_value_of_the_expression() -> None:
    exprs = [ModularIndexing(X, 1, 64), 3 * ModularIndexing(X, 8, 5) + FloorDiv(X, 64) + 7,
             2 * FloorDiv(X, 10) - 5, X - 1, ModularIndexing(X, 1, 64) + 64 * FloorDiv(X, 7)]
    for expr in exprs:
        lo, hi = _brute(expr)
        lower, upper = index_lower_bound(expr), index_upper_bound(expr, RANGES)
        assert lower is not None and upper is not None, expr
        assert lower <= lo and hi <= upper, (expr, lower, lo, hi, upper)


def test_per_channel_index_is_tight_and_a_shifted_tap_may_go_negative() -> None:
    assert index_lower_bound(ModularIndexing(X, 1, 64)) == 0
    assert index_upper_bound(ModularIndexing(X, 1, 64), RANGES) == 64
    assert index_lower_bound(ModularIndexing(X, 1, 64) + 128 * FloorDiv(X, 64) - 7232) == -7232


def test_no_bound_without_ranges_or_with_negative_coefficients() -> None:
    tmp = sympy.Symbol("tmp3", integer=True, nonnegative=True)  # an indirect index
    assert index_upper_bound(tmp + X, RANGES) is None
    assert index_upper_bound(-2 * X + 5000, RANGES) is None
    assert index_lower_bound(-2 * X + 5000) is None
    assert index_lower_bound(FloorDiv(X - 10, 3)) is None


def test_products_of_size_symbols_and_loop_variables_are_bounded() -> None:
    """A dynamic graph's addresses multiply loop variables by size symbols (``s1*x``,
    a rotary table's ``512*s1*FloorDiv(x, 512*s1)``): each factor is bounded on its own
    (a coefficient of 1 gives ``as_coeff_Mul`` the whole product back)."""
    s1 = sympy.Symbol("s1", integer=True, positive=True)
    rotary = 512 * s1 * FloorDiv(X, 512 * s1) + ModularIndexing(X, 1, 64) - 32
    assert index_lower_bound(s1 * X) == 0
    assert index_lower_bound(rotary) == -32
    assert index_upper_bound(s1 * X, RANGES) is None  # s1 has no range here
    assert index_upper_bound(s1 * X, {**RANGES, s1: sympy.Integer(8)}) == 7 * 999 + 1
    assert index_upper_bound(rotary, RANGES) is None
    assert index_lower_bound(-2 * s1 * X) is None
