"""Symbolic sizes on the wire: canonical names, and expressions as small tagged trees.

A client's sizes come from Dynamo's shape environment with Dynamo's names (``s77``), which
depend on the program's history; a request names them ``s0, s1, ...`` by first
appearance among the graph's inputs (SymInt inputs, then each tensor's sizes, strides
and offset, input by input), so two processes with the same program and different
sizes send the same bytes. Values (hints) never enter a request.

An expression is an int, ``["s", k]`` (the k-th symbol) or ``[op, [args...]]`` with
``op`` one of :data:`_OPS`. Decoding is the trust boundary for these bytes: nothing is
evaluated (never ``sympify`` of a string), symbols must be declared, and depth, node
count, integer size and exponents are bounded before sympy sees them (sympy folds
constants as it builds: ``3 ** 10**9`` would hold the decoder for minutes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sympy

from .ir.sym import Expr, FloorDiv, ModularIndexing
from .sizevars import SymbolRange, size_symbol

_MAX_DEPTH = 32
_MAX_INT = 2**62
MAX_NODES = 512  # per expression
MAX_EXPONENT = 64


class SymbolicSizeError(Exception):
    """A symbolic size that Kiln cannot encode (an unbacked or float symbol, an unknown
    function); the graph runs eagerly."""


# Torch's sympy function class names -> wire op. Kiln decodes each to its own functions.
_TORCH_FUNCTIONS = {
    "FloorDiv": "//", "CleanDiv": "//", "ModularIndexing": "mi", "Mod": "%",
    "PythonMod": "%", "Max": "max", "Min": "min",
}


def _build_mod(a: Expr, b: Expr) -> Expr:
    return ModularIndexing(a, sympy.Integer(1), b)


_OPS: dict[str, tuple[int | None, Callable[..., Expr]]] = {
    "+": (None, lambda *a: sympy.Add(*a)),
    "*": (None, lambda *a: sympy.Mul(*a)),
    "^": (2, lambda a, b: sympy.Pow(a, b)),
    "//": (2, FloorDiv),
    "mi": (3, ModularIndexing),
    "%": (2, _build_mod),
    "max": (None, lambda *a: sympy.Max(*a)),
    "min": (None, lambda *a: sympy.Min(*a)),
}


class SymbolTable:
    """Client side: Dynamo's symbols -> canonical ``s<k>``, with their ranges."""

    def __init__(self) -> None:
        self.index: dict[sympy.Symbol, int] = {}
        self.ranges: list[SymbolRange] = []

    def __bool__(self) -> bool:
        return bool(self.index)

    def declare(self, expr: Expr, shape_env: Any = None) -> None:
        """Name the new free symbols of ``expr`` in a fixed order (plain symbols by their
        position in the expression's sorted string form)."""
        for sym in sorted(expr.free_symbols, key=str):
            if sym in self.index:
                continue
            if not str(sym).startswith("s"):
                raise SymbolicSizeError(f"size symbol {sym} is not a backed integer size "
                                        "(data-dependent sizes are not supported)")
            self.index[sym] = len(self.index)
            self.ranges.append(_range_of(sym, shape_env))

    def encode(self, expr: Any) -> Any:
        """The wire form of a torch sympy expression over declared symbols."""
        expr = sympy.sympify(expr)
        if expr.is_Integer:
            return int(expr)
        if isinstance(expr, sympy.Symbol):
            if expr not in self.index:
                raise SymbolicSizeError(f"size symbol {expr} does not appear among the "
                                        "graph's inputs")
            return ["s", self.index[expr]]
        if isinstance(expr, sympy.Add):
            return ["+", [self.encode(a) for a in expr.args]]
        if isinstance(expr, sympy.Mul):
            return ["*", [self.encode(a) for a in expr.args]]
        if isinstance(expr, sympy.Pow) and expr.args[1].is_Integer and expr.args[1] > 0:
            return ["^", [self.encode(expr.args[0]), int(expr.args[1])]]
        op = _TORCH_FUNCTIONS.get(type(expr).__name__)
        if op is None:
            raise SymbolicSizeError(f"size expression {expr} uses {type(expr).__name__}, "
                                    "which Kiln does not encode")
        return [op, [self.encode(a) for a in expr.args]]


def _range_of(sym: sympy.Symbol, shape_env: Any) -> SymbolRange:
    lower, upper = 0, None
    vr = getattr(shape_env, "var_to_range", {}).get(sym) if shape_env is not None else None
    if vr is not None:
        lo, hi = vr.lower, vr.upper
        lower = int(lo) if _finite(lo) else 0
        upper = int(hi) if _finite(hi) else None
    return SymbolRange(max(lower, 0), upper)


def _finite(value: Any) -> bool:
    try:
        return bool(sympy.sympify(value).is_Integer) and abs(int(value)) < _MAX_INT
    except (TypeError, ValueError, sympy.SympifyError):
        return False


def decode_expr(wire: Any, nsymbols: int, depth: int = 0,
                budget: list[int] | None = None) -> Expr:
    """Kiln's sympy expression for a wire tree, over symbols ``s0 .. s<nsymbols-1>``;
    ValueError for one over the bounds (module docstring). ``budget`` counts the nodes
    left to decode (one expression's, unless a caller shares it)."""
    budget = [MAX_NODES] if budget is None else budget
    budget[0] -= 1
    if budget[0] < 0:
        raise ValueError(f"size expression has more than {MAX_NODES} nodes")
    if depth > _MAX_DEPTH:
        raise ValueError("size expression nested too deeply")
    if isinstance(wire, int) and not isinstance(wire, bool):
        if abs(wire) >= _MAX_INT:
            raise ValueError(f"size {wire} out of range")
        return sympy.Integer(wire)
    if not (isinstance(wire, list) and len(wire) == 2):
        raise ValueError(f"bad size expression {wire!r:.80}")
    op, body = wire
    if op == "s":
        if not (isinstance(body, int) and 0 <= body < nsymbols):
            raise ValueError(f"undeclared size symbol {body!r}")
        return size_symbol(body)
    if op not in _OPS or not isinstance(body, list):
        raise ValueError(f"bad size expression op {op!r:.40}")
    arity, build = _OPS[op]
    if arity is not None and len(body) != arity:
        raise ValueError(f"size expression {op} takes {arity} arguments")
    if len(body) > budget[0]:
        raise ValueError(f"size expression has more than {MAX_NODES} nodes")
    args = [decode_expr(a, nsymbols, depth + 1, budget) for a in body]
    if op == "^":
        _check_power(args[0], body[1])
    result = build(*args)
    if result.is_Integer and abs(int(result)) >= _MAX_INT:
        raise ValueError(f"size expression {op} folds to an integer out of range")
    return result


def _check_power(base: Expr, exponent: Any) -> None:
    """A power sympy can build at once: a literal exponent in 1..MAX_EXPONENT, and a
    constant base whose power stays in range (checked before sympy folds it)."""
    if not (isinstance(exponent, int) and not isinstance(exponent, bool)
            and 0 < exponent <= MAX_EXPONENT):
        raise ValueError(f"size expression exponent {exponent!r:.40} is not a literal in "
                         f"1..{MAX_EXPONENT}")
    for factor in sympy.Mul.make_args(base):
        if factor.is_Integer and (abs(int(factor)).bit_length() - 1) * exponent >= 62:
            raise ValueError("size expression power is out of range")


def encode_range(r: SymbolRange) -> list[Any]:
    return [r.lower, r.upper]


def decode_ranges(wire: Any) -> tuple[SymbolRange, ...]:
    if not isinstance(wire, list):
        raise ValueError("bad symbol ranges")
    out = []
    for item in wire:
        lo, hi = item
        if not (isinstance(lo, int) and (hi is None or isinstance(hi, int))):
            raise ValueError(f"bad symbol range {item!r}")
        out.append(SymbolRange(lo, hi))
    return tuple(out)


def is_static(values: Sequence[Any]) -> bool:
    return all(isinstance(v, int) for v in values)


class _CanonicalTable(SymbolTable):
    """Encodes Kiln's own expressions, whose symbols already are ``s<k>``."""

    def encode(self, expr: Any) -> Any:
        for sym in sympy.sympify(expr).free_symbols:
            name = str(sym)
            if not (name.startswith("s") and name[1:].isdigit()):
                raise SymbolicSizeError(f"{sym} is not a canonical size symbol")
            self.index.setdefault(sym, int(name[1:]))
        return super().encode(expr)


def encode_canonical(value: Any) -> Any:
    """The wire form of an int or of an expression over canonical symbols."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    return _CanonicalTable().encode(value)
