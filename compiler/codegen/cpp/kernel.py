"""One C++ kernel: the ops handler that renders loop bodies, plus the kernel's frame.

A kernel iterates an x loop nest (``x0, x1, ...``, outer loops parallel, the innermost
vectorized for pointwise kernels) and, for reductions, a flat reduction index ``r0``.
Each scheduler node's loops are mapped onto those. Reduction work runs in *phases*: one
``r0`` loop each, with per-lane accumulators that the loop updates and that are
combined after it; a node that needs a reduction finished in the current phase starts
the next one. Code outside phases ("x-level") runs once per x iteration. A value
stored and read again in the same kernel is forwarded in a variable.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from ...ir.layout import Layout
from ...ir.sym import Expr, simplify_with_ranges
from ...sizevars import free_size_symbols
from ...virtualized import V
from ..common import CSE, CSEVariable, IndentedBuffer, KernelArgs, combine_div_mod, run_masked
from .overrides import (
    CppIndexPrinter,
    compute_dtype,
    convert,
    ctype,
    literal,
    narrow,
    promote,
    render_op,
    storage_type,
    widen,
)

RINDEX = sympy.Symbol("r0", integer=True, nonnegative=True)
LANE = "rl"  # the lane index inside a phase's vector block
# Row buffers that keep expensive values for later phases: at most this much stack.
ROW_SCRATCH_BYTES = 64 * 1024
_VARIABLE = re.compile(r"\btmp\d+\b")
_DEFINITION = re.compile(r"^\s*const [\w:]+ (tmp\d+) = ")
_EXPENSIVE = re.compile(r"\b(?:exp|expm1|exp2|log|log1p|log2|log10|erf|erfc|tanh|sinh|cosh|"
                        r"sin|cos|tan|asin|acos|atan|asinh|acosh|atanh|pow|atan2|hypot|"
                        r"lgamma|kiln_erfinv_)f?\(")


def xvar(i: int) -> sympy.Symbol:
    return sympy.Symbol(f"x{i}", integer=True, nonnegative=True)


class NotColumnKernel(Exception):
    """The kernel cannot take the column-reduction form; generate it by rows."""


@dataclass
class Phase:
    """One ``r0`` loop: code before it, its body, code after it, its accumulators."""

    cse: CSE
    pre: IndentedBuffer = field(default_factory=IndentedBuffer)
    block_pre: IndentedBuffer = field(default_factory=IndentedBuffer)
    body: IndentedBuffer = field(default_factory=IndentedBuffer)
    post: IndentedBuffer = field(default_factory=IndentedBuffer)
    accumulators: list[Any] = field(default_factory=list)
    stored_keys: list[tuple[str, str]] = field(default_factory=list)
    reductions: set[str] = field(default_factory=set)
    rows: dict[str, str] = field(default_factory=dict)  # variable -> row buffer keeping it


class CppKernel:
    """Renders the bodies of a kernel's nodes through the ops protocol."""

    def __init__(self, xsizes: list[Expr], rnumel: Expr | int, removed: set[str], mode: str,
                 columns: Any = None) -> None:
        self.xsizes, self.rnumel = [sympy.sympify(s) for s in xsizes], sympy.sympify(rnumel)
        self.size_symbols: set[sympy.Symbol] = set()  # read by index expressions
        self.removed = removed
        self.mode = mode  # "serial", "x" (parallel x loops) or "r" (parallel r loops)
        self.columns = columns  # a columns.ColumnPlan: lanes are columns, not rows
        self.lane = "xl" if columns is not None else LANE
        self.args = KernelArgs()
        self.printer = CppIndexPrinter()
        self.cse = CSE()
        self.segments: list[IndentedBuffer | Phase] = [IndentedBuffer()]  # x-level and phases
        self.phase: Phase | None = None
        self.phase_count = 0
        self.index_map: dict[sympy.Symbol, Expr] = {}
        self.var_ranges: dict[sympy.Symbol, Expr] = {
            xvar(i): s for i, s in enumerate(self.xsizes)}
        self.var_ranges[RINDEX] = self.rnumel
        self.mask_stack: list[str] = []
        self.stored: dict[tuple[str, str], CSEVariable] = {}
        self.reduction_cache: dict[tuple[str, str], Any] = {}
        self.unforwarded: set[str] = set()
        self.value_ids: dict[str, str] = {}  # variable -> id of the value it holds
        self.interned: dict[str, str] = {}  # expression over value ids -> value id
        self.phase_values: dict[str, tuple[Phase, CSEVariable]] = {}
        self.scratch_bytes = 0
        self.atomics = False  # a scatter's atomic stores: the loop is not vectorized

    @property
    def is_reduction(self) -> bool:
        return self.rnumel != 1

    @property
    def rnumel_str(self) -> str:
        """The reduction length as C++ (a literal, or an expression of size arguments)."""
        return self.printer.print(self.rnumel)

    def size_symbols_sorted(self) -> list[sympy.Symbol]:
        """Size symbols the kernel reads (loop bounds, indices): its ``int64_t`` arguments."""
        found = self.size_symbols | free_size_symbols([*self.xsizes, self.rnumel])
        return sorted(found, key=lambda s: int(s.name[1:]))

    # -- where code goes ----------------------------------------------------------------

    def xlevel(self) -> IndentedBuffer:
        last = self.segments[-1]
        assert isinstance(last, IndentedBuffer)
        return last

    def compute(self) -> IndentedBuffer:
        return self.phase.body if self.phase is not None else self.xlevel()

    def after(self) -> IndentedBuffer:
        """Where x-level code goes now: after the current phase's loop, if there is one."""
        return self.phase.post if self.phase is not None else self.xlevel()

    def current_cse(self) -> CSE:
        return self.phase.cse if self.phase is not None else self.cse

    def emit(self, expr: str, dtype: torch.dtype) -> CSEVariable:
        cse = self.current_cse()
        if expr in cse.cache:
            return cse.cache[expr]
        value_id = self._value_id(expr)
        text = self._reuse_from_earlier_phase(value_id, expr, dtype) or expr
        var = cse.newvar(dtype)
        self.compute().writeline(f"const {ctype(dtype)} {var} = {text};")
        cse.cache[expr] = var
        self.value_ids[var.name] = value_id
        if self.phase is not None:
            self.phase_values.setdefault(value_id, (self.phase, var))
        return var

    def reserve_row(self, dtype: torch.dtype) -> bool:
        """Room for a row buffer of ``dtype`` on this kernel's stack (not when rows are
        split across threads: they may be any length)."""
        if not self.rnumel.is_Integer:  # a row of any length does not fit the stack
            return False
        nbytes = int(self.rnumel) * compute_dtype(dtype).itemsize
        if self.mode == "r" or self.columns is not None or \
                self.scratch_bytes + nbytes > ROW_SCRATCH_BYTES:
            return False
        self.scratch_bytes += nbytes
        return True

    def _value_id(self, expr: str) -> str:
        """Hash-consing: equal ids mean the same value, whatever the variables' names."""
        key = _VARIABLE.sub(lambda m: self.value_ids.get(m.group(0), m.group(0)), expr)
        return self.interned.setdefault(key, f"#{len(self.interned)}")

    def _reuse_from_earlier_phase(self, value_id: str, expr: str, dtype: torch.dtype
                                  ) -> str | None:
        """An expensive value an earlier phase of this row computed: keep it in a row
        buffer there and read it back here (softmax's exp), instead of computing again.
        Not at x-level, after the loops: there is no ``r0`` to index the row with (and a
        value computed there depends on no ``r``, so computing it again is right)."""
        found = self.phase_values.get(value_id)
        if found is None or self.phase is None or found[0] is self.phase or \
                not _EXPENSIVE.search(expr):
            return None
        origin, var = found
        row = origin.rows.get(var.name)
        if row is None:
            if not self.reserve_row(dtype):
                return None
            row = f"row_{var.name}"
            origin.rows[var.name] = row
            origin.pre.writeline(f"{ctype(dtype)} {row}[{self.rnumel}];")
            origin.body.writeline(f"{row}[r0] = {var};")
        return f"{row}[r0]"

    def emit_after(self, expr: str, dtype: torch.dtype) -> CSEVariable:
        """A value computed after the current phase (x-level, visible to later phases)."""
        var = self.newvar(dtype)
        self.after().writeline(f"const {ctype(dtype)} {var} = {expr};")
        return var

    def newvar(self, dtype: torch.dtype) -> CSEVariable:
        var = self.current_cse().newvar(dtype)
        self.cse.counter = max(self.cse.counter, self.current_cse().counter)
        return var

    def begin_phase(self) -> None:
        if self.columns is not None and self.phase_count:
            raise NotColumnKernel("a second reduction loop")
        self.phase = Phase(self.cse.scoped())
        self.phase_count += 1

    def end_phase(self) -> None:
        """Close the current ``r0`` loop; x-level code continues after it."""
        phase = self.phase
        if phase is None:
            return
        self.phase = None
        self.cse.counter = phase.cse.counter
        for key in phase.stored_keys:  # values stored in the loop do not outlive it
            self.stored.pop(key, None)
        self.segments += [phase, IndentedBuffer()]

    def render_body(self) -> IndentedBuffer:
        """The code of one x iteration: x-level code and the phases' loops, in order."""
        from .reductions import render_phase

        self.end_phase()
        if self.columns is not None:
            from .columns import render_columns

            code = render_columns(self, self.columns)
            code.lines = drop_unused_values(code.lines)
            return code
        code = IndentedBuffer()
        for segment in self.segments:
            if isinstance(segment, Phase):
                render_phase(self, segment, code)
            else:
                code.splice(segment)
        code.lines = drop_unused_values(code.lines)
        return code

    # -- indexing -----------------------------------------------------------------------

    def set_index_map(self, mapping: dict[sympy.Symbol, Expr]) -> None:
        self.index_map = mapping

    def index_str(self, index: Expr, name: str | None = None) -> str:
        expr = sympy.expand(index.xreplace(self.index_map))
        if name is not None:
            expr = expr - _storage_offset(name)
        expr = combine_div_mod(simplify_with_ranges(expr, self.var_ranges))
        self.size_symbols |= free_size_symbols([expr])
        return self.printer.print(expr)

    def mask(self) -> str:
        return " && ".join(f"({m})" for m in self.mask_stack)

    # -- the ops protocol ---------------------------------------------------------------

    def load(self, name: str, index: Expr) -> CSEVariable:
        idx = self.index_str(index, name)
        key = (name, idx)
        if key in self.stored:
            return self.stored[key]
        if name in self.removed:
            self.unforwarded.add(name)
        dtype = V.graph.get_dtype(name)
        value = widen(f"{self.args.input(name)}[{idx}]", dtype)
        if self.mask_stack:  # masked-off lanes must not touch memory
            value = f"({self.mask()} ? {value} : {literal(0, dtype)})"
        return self.emit(value, compute_dtype(dtype))

    def store(self, name: str, index: Expr, value: CSEVariable, mode: str | None = None
              ) -> None:
        if mode is not None:
            self._atomic_store(name, index, value, mode)
            return
        self._store_to(self.compute(), name, index, value, in_phase=self.phase is not None)

    def _atomic_store(self, name: str, index: Expr, value: CSEVariable, mode: str) -> None:
        """A scatter's combining store (``kiln_atomic_add``, max, min); the loop it is in
        is not vectorized, and the value is not forwarded: other iterations add to it."""
        assert mode in ("atomic_add", "atomic_max", "atomic_min"), mode
        self.atomics = True
        dtype = V.graph.get_dtype(name)
        idx = self.index_str(index, name)
        text = narrow(str(value), value.dtype, dtype)
        line = f"kiln_{mode}<{storage_type(dtype)}>({self.args.output(name)} + ({idx}), {text});"
        if self.mask_stack:
            line = f"if ({self.mask()}) {{ {line} }}"
        self.compute().writeline(line)

    def store_reduction(self, name: str, index: Expr, value: CSEVariable) -> None:
        self._store_to(self.after(), name, index, value, in_phase=False)

    def _store_to(self, buf: IndentedBuffer, name: str, index: Expr, value: CSEVariable,
                  in_phase: bool) -> None:
        if self.columns is not None and self.phase is None and not self.phase_count:
            raise NotColumnKernel("a store before the reduction loop")
        idx = self.index_str(index, name)
        self.stored[(name, idx)] = value
        if in_phase and self.phase is not None:
            self.phase.stored_keys.append((name, idx))
        if name in self.removed:
            return
        text = narrow(str(value), value.dtype, V.graph.get_dtype(name))
        buf.writeline(f"{self.args.output(name)}[{idx}] = {text};")

    def constant(self, value: Any, dtype: torch.dtype) -> CSEVariable:
        dt = compute_dtype(dtype)
        return self.emit(literal(value, dt), dt)

    def index_expr(self, expr: Expr, dtype: torch.dtype) -> CSEVariable:
        text = self.index_str(expr)
        var = self.emit(f"static_cast<int64_t>({text})", torch.int64)
        return self.to_dtype(var, dtype)

    def to_dtype(self, x: CSEVariable, dtype: torch.dtype,
                 src_dtype: torch.dtype | None = None) -> CSEVariable:
        if x.dtype == dtype:
            return x
        return self.emit(convert(str(x), x.dtype, dtype), compute_dtype(dtype))

    def to_dtype_bitcast(self, x: CSEVariable, dtype: torch.dtype, src_dtype: torch.dtype
                         ) -> CSEVariable:
        from .overrides import storage_type

        bits = narrow(str(x), x.dtype, src_dtype)
        src_t, dst_t = storage_type(src_dtype), storage_type(dtype)
        if src_dtype.itemsize != dtype.itemsize:
            raise NotImplementedError(f"bitcast {src_dtype} -> {dtype}")
        raw = f"__builtin_bit_cast({dst_t}, static_cast<{src_t}>({bits}))"
        return self.emit(widen(raw, dtype), compute_dtype(dtype))

    def indirect_indexing(self, x: CSEVariable, size: Expr, check: bool = True
                          ) -> sympy.Symbol:
        self.size_symbols |= free_size_symbols([size])
        n = self.printer.print(size)
        var = self.emit(f"static_cast<int64_t>({x} < 0 ? {x} + {n} : {x})", torch.int64)
        return sympy.Symbol(var.name, integer=True, nonnegative=True)

    def masked(self, mask: CSEVariable, body: Callable[[], Any], other: Any) -> CSEVariable:
        result = run_masked(self.mask_stack, mask, body)
        other_lit = literal(other, result.dtype)
        return self.emit(f"({mask} ? {result} : {other_lit})", result.dtype)

    def where(self, cond: CSEVariable, a: Any, b: Any) -> CSEVariable:
        dtype = compute_dtype(promote(a, b))
        a_text, b_text = (convert(str(v), v.dtype, dtype) if isinstance(v, CSEVariable)
                          else str(v) for v in (a, b))
        return self.emit(f"({cond} ? {a_text} : {b_text})", dtype)

    def getitem(self, x: Any, i: int) -> CSEVariable:
        return x[i]  # type: ignore[no-any-return]

    def reduction(self, dtype: torch.dtype, src_dtype: torch.dtype, reduction_type: str,
                  value: CSEVariable) -> Any:
        from .reductions import emit_reduction

        key = (reduction_type, str(value))
        if key not in self.reduction_cache:
            assert self.phase is not None, "a reduction outside a phase"
            self.reduction_cache[key] = emit_reduction(self, self.phase, reduction_type, value)
        return self.reduction_cache[key]

    def __getattr__(self, name: str) -> Callable[..., CSEVariable]:
        from ...ops_handler import BINARY_OPS, UNARY_OPS

        if name in UNARY_OPS or name in BINARY_OPS:
            return lambda *args: self._op(name, *args)
        raise AttributeError(name)

    def _op(self, name: str, *args: CSEVariable) -> CSEVariable:
        expr, dtype = render_op(name, args)
        return self.emit(expr, dtype)


def drop_unused_values(lines: list[str]) -> list[str]:
    """Remove ``const`` values nothing reads (a load made dead by a reused row buffer)."""
    while True:
        mentions: dict[str, int] = {}  # a tail loop repeats a body's definitions
        for line in lines:
            for name in _VARIABLE.findall(line):
                mentions[name] = mentions.get(name, 0) + 1
            match = _DEFINITION.match(line)
            if match is not None:
                mentions[match.group(1)] -= 1
        kept = [line for line in lines if not _unused_definition(line, mentions)]
        if len(kept) == len(lines):
            return kept
        lines = kept


def _unused_definition(line: str, uses: dict[str, int]) -> bool:
    match = _DEFINITION.match(line)
    return match is not None and uses.get(match.group(1), 0) == 0


def _storage_offset(name: str) -> Expr:
    """Kernels index from the tensor's data pointer, which already includes its offset."""
    try:
        layout = V.graph.get_buffer(name).layout
    except (KeyError, AttributeError):
        return sympy.Integer(0)
    return layout.offset if isinstance(layout, Layout) else sympy.Integer(0)
