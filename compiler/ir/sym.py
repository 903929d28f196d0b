"""Integer index arithmetic for loop bodies: sympy functions and helpers.

Sizes, strides and offsets are sympy expressions from the start (plain integers for
now) so that symbolic sizes later only change what the symbols are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import reduce
from typing import Any

import sympy
from sympy import Expr  # re-exported: the type of index expressions


def sympify_tuple(values: Iterable[Any]) -> tuple[Expr, ...]:
    return tuple(sympy.Integer(v) if isinstance(v, int) else sympy.sympify(v) for v in values)


def prod(values: Iterable[Any]) -> Expr:
    return reduce(lambda a, b: a * b, values, sympy.Integer(1))


class FloorDiv(sympy.Function):
    """``base // divisor`` for non-negative integer index expressions."""

    nargs = (2,)
    is_integer = True

    @classmethod
    def eval(cls, base: Expr, divisor: Expr) -> Expr | None:
        if divisor == 1:
            return base
        if base == 0:
            return sympy.Integer(0)
        if isinstance(base, sympy.Integer) and isinstance(divisor, sympy.Integer):
            return sympy.Integer(int(base) // int(divisor))
        if isinstance(base, FloorDiv):
            return FloorDiv(base.args[0], base.args[1] * divisor)
        if not isinstance(divisor, sympy.Integer):
            # A symbolic divisor: exact when the quotient is a polynomial (32*s0 // s0).
            num, den = sympy.fraction(sympy.cancel(base / divisor))
            if den == 1 and _integer_polynomial(num):
                return num
        if isinstance(divisor, sympy.Integer) and isinstance(base, sympy.Add):
            # Terms that are multiples of the divisor come out of the division exactly.
            exact, rest = [], []
            for term in base.args:
                coeff, _ = term.as_coeff_Mul()
                if isinstance(coeff, sympy.Integer) and int(coeff) % int(divisor) == 0:
                    exact.append(term / divisor)
                else:
                    rest.append(term)
            if exact and rest:
                return sympy.Add(*exact) + FloorDiv(sympy.Add(*rest), divisor)
            if exact:
                return sympy.Add(*exact)
        if isinstance(divisor, sympy.Integer) and isinstance(base, sympy.Mul):
            coeff, rest = base.as_coeff_Mul()
            if isinstance(coeff, sympy.Integer) and int(coeff) % int(divisor) == 0:
                return (coeff / divisor) * rest
        return None


def _integer_polynomial(expr: Expr) -> bool:
    return all(term.as_coeff_Mul()[0].is_Integer for term in sympy.Add.make_args(expr))


class ModularIndexing(sympy.Function):
    """``(base // divisor) % modulus`` for non-negative integer index expressions."""

    nargs = (3,)
    is_integer = True

    @classmethod
    def eval(cls, base: Expr, divisor: Expr, modulus: Expr) -> Expr | None:
        if modulus == 1 or base == 0:
            return sympy.Integer(0)
        if all(isinstance(a, sympy.Integer) for a in (base, divisor, modulus)):
            return sympy.Integer((int(base) // int(divisor)) % int(modulus))
        if isinstance(divisor, sympy.Integer) and isinstance(modulus, sympy.Integer):
            if isinstance(base, sympy.Add):
                # Terms that are multiples of divisor * modulus wrap to zero.
                period = int(divisor) * int(modulus)
                kept = []
                for term in base.args:
                    coeff, _ = term.as_coeff_Mul()
                    if not (isinstance(coeff, sympy.Integer) and int(coeff) % period == 0):
                        kept.append(term)
                if len(kept) != len(base.args):
                    return ModularIndexing(sympy.Add(*kept), divisor, modulus)
        return None


def unflatten_index(flat: Expr, sizes: Sequence[Expr]) -> list[Expr]:
    """Row-major coordinates of the flat index ``flat`` in loops of ``sizes``, outermost
    first (the outermost is not wrapped: it may run past its size only if ``flat`` does)."""
    out: list[Expr] = []
    stride: Expr = sympy.Integer(1)
    for i in reversed(range(len(sizes))):
        out.append(FloorDiv(flat, stride) if i == 0 else ModularIndexing(flat, stride, sizes[i]))
        stride = stride * sizes[i]
    return list(reversed(out))


def free_index_symbols(expr: Expr) -> set[sympy.Symbol]:
    return {s for s in expr.free_symbols if isinstance(s, sympy.Symbol)}


def index_upper_bound(e: Expr, var_ranges: dict[sympy.Symbol, Expr]) -> int | None:
    """An exclusive upper bound of an index expression whose terms have non-negative
    coefficients, from the ranges of its variables; None when there is none."""
    if isinstance(e, sympy.Integer):
        return int(e) + 1
    if isinstance(e, sympy.Symbol):
        r = var_ranges.get(e)
        return int(r) if isinstance(r, sympy.Integer) else None
    if isinstance(e, sympy.Mul):
        # Every factor on its own (``as_coeff_Mul`` of ``s0*x`` gives back ``s0*x`` itself):
        # a product of non-negative factors is largest where each factor is.
        highest = 1
        for factor in e.args:
            ub = index_upper_bound(factor, var_ranges)
            if ub is None or ub < 1 or index_lower_bound(factor) is None:
                return None
            highest *= ub - 1
        return highest + 1
    if isinstance(e, sympy.Add):
        bounds = [index_upper_bound(a, var_ranges) for a in e.args]
        if any(b is None for b in bounds):
            return None
        return sum(b - 1 for b in bounds if b is not None) + 1
    if isinstance(e, FloorDiv):
        ub = index_upper_bound(e.args[0], var_ranges)
        if ub is None or not isinstance(e.args[1], sympy.Integer):
            return None
        return (ub - 1) // int(e.args[1]) + 1
    if isinstance(e, ModularIndexing) and isinstance(e.args[2], sympy.Integer):
        return int(e.args[2])
    return None


def index_lower_bound(e: Expr) -> int | None:
    """A lower bound of an index expression over non-negative loop variables (the
    variables' lower bound is 0); None when there is none."""
    if isinstance(e, sympy.Integer):
        return int(e)
    if isinstance(e, sympy.Symbol):
        return 0 if e.is_nonnegative else None
    if isinstance(e, sympy.Mul):
        # A product of non-negative factors is smallest where each factor is.
        lowest = 1
        for factor in e.args:
            lb = index_lower_bound(factor)
            if lb is None or lb < 0:
                return None
            lowest *= lb
        return lowest
    if isinstance(e, sympy.Add):
        bounds = [index_lower_bound(a) for a in e.args]
        return None if any(b is None for b in bounds) else sum(b for b in bounds if b)
    if isinstance(e, FloorDiv):
        lb = index_lower_bound(e.args[0])
        if lb is None or lb < 0 or not e.args[1].is_positive:
            return None
        # A non-negative value over a positive divisor (a size symbol's too) stays >= 0.
        return lb // int(e.args[1]) if isinstance(e.args[1], sympy.Integer) else 0
    if isinstance(e, ModularIndexing):
        lb = index_lower_bound(e.args[0])
        return 0 if lb is not None and lb >= 0 else None
    return None


def simplify_with_ranges(expr: Expr, var_ranges: dict[sympy.Symbol, Expr]) -> Expr:
    """Drop divisions and moduli that the ranges of the variables make trivial."""

    def upper_bound(e: Expr) -> int | None:
        return index_upper_bound(e, var_ranges)

    def visit_mod(base: Expr, divisor: Expr, modulus: Expr) -> Expr:
        ub = upper_bound(base)
        if ub is not None and isinstance(divisor, sympy.Integer):
            if isinstance(modulus, sympy.Integer) and ub <= int(divisor) * int(modulus):
                return FloorDiv(base, divisor)
        return ModularIndexing(base, divisor, modulus)

    def visit_div(base: Expr, divisor: Expr) -> Expr:
        ub = upper_bound(base)
        if ub is not None and isinstance(divisor, sympy.Integer) and ub <= int(divisor):
            return sympy.Integer(0)
        return FloorDiv(base, divisor)

    if not expr.has(FloorDiv, ModularIndexing):
        return expr
    expr = expr.replace(ModularIndexing, visit_mod)
    return expr.replace(FloorDiv, visit_div)


def linear_coefficients(
    expr: Expr, variables: Sequence[sympy.Symbol]
) -> tuple[list[Expr], Expr] | None:
    """Coefficients and constant of ``expr`` if it is affine in ``variables``; else None."""
    expr = sympy.expand(expr)
    if expr.has(FloorDiv, ModularIndexing):
        return None
    coeffs: list[Expr] = []
    for v in variables:
        c = expr.coeff(v)
        if c.free_symbols & set(variables):
            return None
        coeffs.append(c)
    const = expr.subs({v: 0 for v in variables})
    rebuilt = sympy.expand(const + sum(c * v for c, v in zip(coeffs, variables)))
    if sympy.expand(rebuilt - expr) != 0:
        return None
    return coeffs, const


def combine_div_mod(expr: Expr) -> Expr:
    """Fold ``c*(b // (d*m)) * m + c*((b // d) % m)`` back into ``c*(b // d)``.

    Loops that could not be merged for every access (a broadcast bias reads only the
    inner one) still give full accesses of this shape; folding makes them plain again.
    ``c``, ``d`` and ``m`` may be sizes of a graph with dynamic shapes.
    """
    changed = True
    while changed and isinstance(expr, sympy.Add):
        changed = False
        terms = list(expr.args)
        mods = []
        for t in terms:
            coeff, rest = _split_function(t)
            if isinstance(rest, ModularIndexing):
                mods.append((t, coeff, rest))
        for t, coeff, mod in mods:
            base, div, m = mod.args
            partner_rest = FloorDiv(base, div * m)
            for u in terms:
                c2, r2 = _split_function(u)
                if u is not t and r2 == partner_rest and sympy.expand(c2 - coeff * m) == 0:
                    others = [x for x in terms if x is not t and x is not u]
                    expr = sympy.Add(*others, coeff * FloorDiv(base, div))
                    changed = True
                    break
            if changed:
                break
    return expr


def _split_function(term: Expr) -> tuple[Expr, Expr | None]:
    """``term`` as (coefficient, its one FloorDiv/ModularIndexing factor, if any)."""
    coeff: Expr = sympy.Integer(1)
    func: Expr | None = None
    for factor in sympy.Mul.make_args(term):
        if isinstance(factor, (FloorDiv, ModularIndexing)) and func is None:
            func = factor
        else:
            coeff = coeff * factor
    return coeff, func


def same_index(a: Expr, b: Expr) -> bool:
    """Whether ``a`` and ``b`` are the same address for every value of their symbols.

    ``64*(x % 3136)`` and ``3584*((x // 56) % 56) + 64*(x % 56)`` are one address written
    two ways (a store through one loop nest, a load through another that merged two of its
    loops). Each symbol that is the base of a ``//`` or ``%`` is written in mixed-radix
    digits at every divisor and period either uses; when those boundaries form a chain
    (each divides the next), both sides become polynomials in the digits, equal exactly
    when their difference expands to zero. Other shapes (symbolic divisors, compound
    bases, boundaries that do not nest) answer False: not proven the same.
    """
    if a == b:
        return True
    atoms = a.atoms(FloorDiv, ModularIndexing) | b.atoms(FloorDiv, ModularIndexing)
    bounds: dict[sympy.Symbol, set[int]] = {}
    for atom in atoms:
        base, div = atom.args[0], atom.args[1]
        period = div * atom.args[2] if isinstance(atom, ModularIndexing) else None
        if not isinstance(base, sympy.Symbol) or not isinstance(div, sympy.Integer) or \
                (period is not None and not isinstance(period, sympy.Integer)):
            return False
        marks = bounds.setdefault(base, {1})
        marks.add(int(div))
        if period is not None:
            marks.add(int(period))
    replace: dict[Expr, Expr] = {}
    for sym, marks in bounds.items():
        chain = sorted(marks)
        if any(hi % lo for lo, hi in zip(chain, chain[1:])):
            return False
        digits = [sympy.Symbol(f"_digit_{sym}_{k}", integer=True, nonnegative=True)
                  for k in range(len(chain))]
        position = {mark: k for k, mark in enumerate(chain)}

        def value(lo: int, hi: int | None, chain: list[int] = chain,
                  digits: list[sympy.Symbol] = digits, position: dict[int, int] = position
                  ) -> Expr:
            """``(sym // lo) % (hi // lo)`` in digits; ``sym // lo`` where ``hi`` is None."""
            end = len(chain) if hi is None else position[hi]
            return sympy.Add(*(digits[k] * (chain[k] // lo)
                               for k in range(position[lo], end)))

        replace[sym] = value(1, None)
        for atom in atoms:
            if atom.args[0] != sym:
                continue
            div = int(atom.args[1])
            hi = div * int(atom.args[2]) if isinstance(atom, ModularIndexing) else None
            replace[atom] = value(div, hi)
    # Atoms first (their bases are the symbols replaced after them).
    ordered = sorted(replace.items(), key=lambda kv: not isinstance(kv[0], sympy.Function))
    da, db = a, b
    for old, new in ordered:
        da, db = da.xreplace({old: new}), db.xreplace({old: new})
    return sympy.expand(da - db) == 0
