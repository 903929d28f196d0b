"""Pieces shared by the kernel generators: indented source, CSE, kernel arguments,
index printing and loop simplification."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from ..ir.sym import Expr, FloorDiv, ModularIndexing, combine_div_mod  # noqa: F401
from ..sizevars import is_size_symbol


class IndentedBuffer:
    """Lines of source with an indentation level."""

    def __init__(self, indent: int = 0) -> None:
        self.lines: list[str] = []
        self.level = indent

    def writeline(self, line: str) -> None:
        self.lines.append(("    " * self.level + line) if line else "")

    def writelines(self, lines: Sequence[str]) -> None:
        for line in lines:
            self.writeline(line)

    def splice(self, other: IndentedBuffer) -> None:
        for line in other.lines:
            self.lines.append(("    " * self.level + line) if line else "")

    @contextlib.contextmanager
    def indent(self, n: int = 1) -> Iterator[None]:
        self.level += n
        try:
            yield
        finally:
            self.level -= n

    def getvalue(self) -> str:
        return "\n".join(self.lines) + "\n"


@dataclass
class CSEVariable:
    """A named value in generated code, with the dtype it holds there."""

    name: str
    dtype: torch.dtype
    bounds: str = ""

    def __str__(self) -> str:
        return self.name


class CSE:
    """Common subexpression elimination: one variable per distinct expression."""

    def __init__(self, prefix: str = "tmp") -> None:
        self.prefix = prefix
        self.cache: dict[str, CSEVariable] = {}
        self.counter = 0

    def newvar(self, dtype: torch.dtype) -> CSEVariable:
        var = CSEVariable(f"{self.prefix}{self.counter}", dtype)
        self.counter += 1
        return var

    def generate(self, buffer: IndentedBuffer, expr: str, dtype: torch.dtype) -> CSEVariable:
        key = expr
        if key in self.cache:
            return self.cache[key]
        var = self.newvar(dtype)
        buffer.writeline(f"{var.name} = {expr}")
        self.cache[key] = var
        return var

    def scoped(self) -> CSE:
        """A CSE that sees this one's values but forgets its own later (loop bodies)."""
        child = CSE(self.prefix)
        child.cache = dict(self.cache)
        child.counter = self.counter
        return child


@dataclass
class KernelArgs:
    """Buffer names to the pointer argument names a kernel uses for them."""

    input_buffers: dict[str, str] = field(default_factory=dict)
    output_buffers: dict[str, str] = field(default_factory=dict)
    inplace_buffers: dict[str, str] = field(default_factory=dict)

    def input(self, name: str) -> str:
        if name in self.output_buffers:
            return self.output_buffers[name]
        if name in self.inplace_buffers:
            return self.inplace_buffers[name]
        if name not in self.input_buffers:
            self.input_buffers[name] = f"in_ptr{len(self.input_buffers)}"
        return self.input_buffers[name]

    def output(self, name: str) -> str:
        if name in self.input_buffers:
            # Read and written by this kernel: one in-out pointer.
            arg = f"in_out_ptr{len(self.inplace_buffers)}"
            self.inplace_buffers[name] = arg
            del self.input_buffers[name]
            return arg
        if name in self.inplace_buffers:
            return self.inplace_buffers[name]
        if name not in self.output_buffers:
            self.output_buffers[name] = f"out_ptr{len(self.output_buffers)}"
        return self.output_buffers[name]

    def call_args(self) -> list[tuple[str, str]]:
        """(argument name, buffer name) in signature order: in-out, inputs, outputs."""
        ordered = list(self.inplace_buffers.items()) + list(self.input_buffers.items()) + \
            list(self.output_buffers.items())
        return [(arg, buf) for buf, arg in ordered]


def run_masked(mask_stack: list[str], mask: Any, body: Any) -> Any:
    """Run a masked body with ``mask`` on the kernel's mask stack (its loads see it)."""
    mask_stack.append(str(mask))
    try:
        return body()
    finally:
        mask_stack.pop()


class IndexPrinter:
    """Print an integer index expression as Python/Triton source."""

    def print(self, expr: Expr) -> str:
        if isinstance(expr, (int, sympy.Integer)):
            return str(int(expr))
        if isinstance(expr, sympy.Symbol):
            return expr.name
        if isinstance(expr, sympy.Add):
            terms = sorted((self.print(a) for a in expr.args), key=lambda s: (s[0] == "-", s))
            out = terms[0]
            for t in terms[1:]:
                out += f" - {t[1:]}" if t.startswith("-") else f" + {t}"
            return out
        if isinstance(expr, sympy.Mul):
            coeff, rest = expr.as_coeff_Mul()
            body = "*".join(self._paren(a) for a in sympy.Mul.make_args(rest))
            if coeff == 1:
                return body
            if coeff == -1:
                return f"-{body}"
            return f"{int(coeff)}*{body}"
        if isinstance(expr, FloorDiv):
            return f"({self._paren(expr.args[0])} // {self._paren(expr.args[1])})"
        if isinstance(expr, ModularIndexing):
            base, div, mod = expr.args
            inner = self._paren(base) if div == 1 else \
                f"({self._paren(base)} // {self._paren(div)})"
            return f"({inner} % {self._paren(mod)})"
        if isinstance(expr, sympy.Pow) and expr.args[1].is_Integer and expr.args[1] > 0:
            return "*".join([self._paren(expr.args[0])] * int(expr.args[1]))
        if isinstance(expr, (sympy.Max, sympy.Min)):
            fn = "max" if isinstance(expr, sympy.Max) else "min"
            return self._minmax(fn, [self.print(a) for a in expr.args])
        raise NotImplementedError(f"cannot print index {expr}")

    def _minmax(self, fn: str, args: list[str]) -> str:
        return f"{fn}({', '.join(args)})"

    def _paren(self, expr: Expr) -> str:
        text = self.print(expr)
        # A power prints as a product (``s1*s1``): as a divisor or modulus it needs
        # parentheses as much as any product does.
        if isinstance(expr, (sympy.Add, sympy.Mul, sympy.Pow)) and \
                not isinstance(expr, sympy.Symbol):
            return f"({text})"
        return text


def merge_loops(sizes: Sequence[Expr], exprs: Sequence[Expr],
                variables: Sequence[sympy.Symbol]
                ) -> tuple[list[Expr], dict[sympy.Symbol, Expr], list[sympy.Symbol]]:
    """Merge adjacent loops that every access walks contiguously; drop size-1 loops.

    Returns the new sizes, a substitution from old variables to expressions of the new
    ones (valid inside every expression of ``exprs``), and the new variables.
    """
    exprs = [sympy.expand(e) for e in exprs]
    groups: list[list[int]] = []
    for i, size in enumerate(sizes):
        if size == 1:
            continue
        if groups and _can_merge(exprs, variables, groups[-1][-1], i, sizes):
            groups[-1].append(i)
        else:
            groups.append([i])
    new_vars = [sympy.Symbol(f"z{k}", integer=True, nonnegative=True) for k in range(len(groups))]
    new_sizes: list[Expr] = []
    subs: dict[sympy.Symbol, Expr] = {}
    for var, group in zip(new_vars, groups):
        total: Expr = sympy.Integer(1)
        stride: Expr = sympy.Integer(1)
        for d in reversed(group):
            subs[variables[d]] = FloorDiv(var, stride) if d == group[0] else \
                ModularIndexing(var, stride, sizes[d])
            stride = stride * sizes[d]
            total = total * sizes[d]
        new_sizes.append(total)
    for i, size in enumerate(sizes):
        if size == 1:
            subs[variables[i]] = sympy.Integer(0)
    return new_sizes, subs, new_vars


def _can_merge(exprs: Sequence[Expr], variables: Sequence[sympy.Symbol], prev: int, cur: int,
               sizes: Sequence[Expr]) -> bool:
    vp, vc = variables[prev], variables[cur]
    for e in exprs:
        if _inside_function(e, vp) or _inside_function(e, vc):
            return False
        cp, cc = e.coeff(vp), e.coeff(vc)
        if _loop_dependent(cp) or _loop_dependent(cc) or \
                sympy.expand(cp - cc * sizes[cur]) != 0:
            return False
    return True


def _loop_dependent(coeff: Expr) -> bool:
    """A coefficient that is not a size (it holds a loop variable)."""
    return any(not is_size_symbol(s) for s in coeff.free_symbols)


def _inside_function(expr: Expr, var: sympy.Symbol) -> bool:
    return any(var in f.free_symbols for f in expr.atoms(FloorDiv, ModularIndexing))


def simplify_merged(expr: Expr, subs: dict[sympy.Symbol, Expr],
                    groups_linear: dict[sympy.Symbol, Expr]) -> Expr:
    """Substitute merged loops, using the linear form where every term is linear."""
    return sympy.expand(expr.xreplace(groups_linear)) if groups_linear else \
        sympy.expand(expr.xreplace(subs))


def linear_substitution(subs: dict[sympy.Symbol, Expr]) -> dict[sympy.Symbol, Expr]:
    """For merged loops, the substitution that keeps linear accesses linear.

    If ``a*s + b`` merged into ``z`` (a over the outer loop, b the inner of size s), every
    access reads ``c*(a*s + b)``: substituting ``a -> 0`` and ``b -> z`` gives ``c*z``.
    """
    linear: dict[sympy.Symbol, Expr] = {}
    for old, new in subs.items():
        if isinstance(new, FloorDiv):  # outermost of its group
            inner = new.args[0]
            linear[old] = sympy.Integer(0) if _group_has_more(subs, inner, old) else inner
        elif isinstance(new, ModularIndexing):
            base, div, _ = new.args
            linear[old] = base if div == 1 else sympy.Integer(0)
        else:
            linear[old] = new
    return linear


def _group_has_more(subs: dict[sympy.Symbol, Expr], var: Expr, old: sympy.Symbol) -> bool:
    return any(isinstance(v, ModularIndexing) and v.args[0] == var for k, v in subs.items()
               if k != old)


def dtype_bytes(dtype: torch.dtype) -> int:
    return dtype.itemsize


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def type_name(x: Any) -> str:
    return type(x).__name__


