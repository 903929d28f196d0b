"""One Triton kernel: the ops handler that renders loop bodies, plus the kernel's frame.

A kernel iterates ``xnumel`` (and ``rnumel`` for reductions). Each scheduler node's
loops are mapped onto ``xindex`` / ``rindex``; loads and stores become ``tl.load`` /
``tl.store`` with masks; a value stored and read again in the same kernel is forwarded
in registers. Looped reductions run in phases, one ``for roffset`` loop each.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from ...ir.layout import Layout
from ...ir.sym import (
    Expr,
    FloorDiv,
    index_lower_bound,
    index_upper_bound,
    same_index,
    simplify_with_ranges,
)
from ...sizevars import free_size_symbols
from ...virtualized import V
from ..common import (
    CSE,
    CSEVariable,
    IndentedBuffer,
    IndexPrinter,
    KernelArgs,
    combine_div_mod,
    run_masked,
)
from .overrides import (
    BINARY_TEMPLATES,
    BOOL_RESULT,
    UNARY_TEMPLATES,
    compute_dtype,
    literal,
    promote,
    triton_type,
)

XINDEX = sympy.Symbol("xindex", integer=True, nonnegative=True)
RINDEX = sympy.Symbol("rindex", integer=True, nonnegative=True)
XOFFSET = sympy.Symbol("xoffset", integer=True, nonnegative=True)


@dataclass
class KernelPlan:
    """What codegen decided about a kernel's iteration."""

    name: str
    kind: str  # "pointwise", "persistent_reduction" or "reduction"
    xnumel: int
    rnumel: int
    index_dtype: str = "tl.int32"
    buffer_dtypes: dict[str, torch.dtype] = field(default_factory=dict)


class TritonKernel:
    """Renders the bodies of a kernel's nodes through the ops protocol."""

    def __init__(self, kind: str, xnumel: Expr | int, rnumel: Expr | int, removed: set[str],
                 index_dtype: str = "tl.int32", max_xblock: int | None = None,
                 outer: bool = False, parts: int = 0) -> None:
        self.kind = kind
        self.outer = outer  # a column reduction: x contiguous, r strided
        # The largest XBLOCK any launch config uses (None: unknown): a block of x then
        # lies within one multiple of any divisor it divides.
        self.max_xblock = max_xblock
        self.xnumel, self.rnumel = sympy.sympify(xnumel), sympy.sympify(rnumel)
        # A graph with dynamic shapes: numels and size symbols are kernel arguments.
        self.dynamic = V.graph.sizevars.is_dynamic()
        self.size_symbols: set[sympy.Symbol] = set()
        self.removed = removed
        self.index_dtype = index_dtype
        self.args = KernelArgs()
        self.printer = IndexPrinter()
        self.cse = CSE()
        self.body = IndentedBuffer()       # straight-line code (outside any r loop)
        self.loop_pre = IndentedBuffer()   # before the current r loop (accumulators)
        self.loop_body = IndentedBuffer()  # inside the current r loop
        self.loop_post = IndentedBuffer()  # after the current r loop
        self.in_loop = False
        self.loop_cse: CSE | None = None
        self.index_map: dict[sympy.Symbol, Expr] = {}
        self.var_ranges = {XINDEX: self.xnumel, RINDEX: self.rnumel}
        self.uses_r = False
        self.mask_stack: list[str] = []
        self.stored: dict[tuple[str, str], CSEVariable] = {}
        self.stored_index: dict[tuple[str, str], Expr] = {}  # ``stored`` keys' addresses
        self.loop_stored: set[tuple[str, str]] = set()  # ``stored`` keys of this r loop
        # Buffers this kernel wrote to memory since its last barrier, and those of them
        # written in the current r loop (see ``_fence``).
        self.unfenced: set[str] = set()
        self.loop_unfenced: set[str] = set()
        self.reduction_cache: dict[tuple[str, str, bool], Any] = {}
        self.unforwarded: set[str] = set()
        self.phase_reductions: set[str] = set()
        # A row-column kernel (``row_column.py``): ``parts`` programs; while ``column``
        # a column stage's body is generated, its reductions accumulating across the
        # row loop (accumulators made in ``column_pre``, combined in ``column_post``).
        self.parts = parts
        self.column = False
        self.column_pre = IndentedBuffer()
        self.column_post = IndentedBuffer()
        if parts:
            from .row_column import PID

            self.var_ranges[PID] = sympy.Integer(parts)

    # -- where code goes ----------------------------------------------------------------

    @property
    def is_reduction(self) -> bool:
        return self.kind != "pointwise"

    @property
    def looped(self) -> bool:
        return self.kind == "reduction"

    # -- size arguments (graphs with dynamic shapes) -----------------------------------------

    def size_params(self) -> list[str]:
        """Scalar parameters after the pointers: numels, then the size symbols used."""
        if not self.dynamic:
            return []
        numels = ["xnumel", "rnumel"] if self.is_reduction else ["xnumel"]
        return numels + [s.name for s in self._sorted_symbols()]

    def size_args(self) -> tuple[str, ...]:
        """What the wrapper passes for :meth:`size_params`: Python over ``s0, s1, ...``."""
        if not self.dynamic:
            return ()
        numels = [self.xnumel, self.rnumel] if self.is_reduction else [self.xnumel]
        return tuple(self.printer.print(n) for n in numels) + tuple(
            s.name for s in self._sorted_symbols())

    def _sorted_symbols(self) -> list[sympy.Symbol]:
        return sorted(self.size_symbols, key=lambda s: int(s.name[1:]))

    def _note_sizes(self, expr: Expr) -> None:
        self.size_symbols |= free_size_symbols([expr])

    def compute(self) -> IndentedBuffer:
        return self.loop_body if self.in_loop else self.body

    def current_cse(self) -> CSE:
        return self.loop_cse if self.in_loop and self.loop_cse is not None else self.cse

    def emit(self, expr: str, dtype: torch.dtype) -> CSEVariable:
        return self.current_cse().generate(self.compute(), expr, dtype)

    def begin_loop(self) -> None:
        """Start a ``for roffset`` phase (looped reductions only)."""
        self.in_loop = True
        self.loop_cse = self.cse.scoped()
        self.loop_pre, self.loop_body, self.loop_post = (IndentedBuffer(), IndentedBuffer(),
                                                         IndentedBuffer())
        self.phase_reductions = set()
        self.loop_unfenced = set()

    def end_loop(self) -> None:
        if not self.in_loop:
            return
        assert self.loop_cse is not None
        self.cse.counter = self.loop_cse.counter
        self.body.splice(self.loop_pre)
        self.body.writeline("for roffset in range(0, rnumel, RBLOCK):")
        with self.body.indent():
            self.body.writeline("rindex = roffset + rbase")
            self.body.writeline("rmask = rindex < rnumel")
            if not self.loop_body.lines:
                self.body.writeline("pass")
            self.body.splice(self.loop_body)
        self.body.splice(self.loop_post)
        self.in_loop = False
        self.loop_cse = None
        # A value stored inside the loop exists only there (one r block of it): later
        # phases load it from memory (a buffer kept in registers is then stored).
        for key in self.loop_stored:
            self.stored.pop(key, None)
        self.loop_stored.clear()
        self.loop_unfenced.clear()

    # -- indexing -----------------------------------------------------------------------

    def set_index_map(self, mapping: dict[sympy.Symbol, Expr], uses_r: bool) -> None:
        self.index_map = mapping
        self.uses_r = uses_r

    def index_str(self, index: Expr) -> str:
        return self._print_index(self._simplify(index))

    def _simplify(self, index: Expr) -> Expr:
        expr = sympy.expand(index.xreplace(self.index_map))
        return combine_div_mod(simplify_with_ranges(expr, self.var_ranges))

    def _print_index(self, expr: Expr) -> str:
        self._note_sizes(expr)
        text = self.printer.print(expr)
        if not expr.free_symbols:
            # A pointer must be a block like its mask: broadcast a constant offset.
            text += " + 0*rindex + 0*xindex" if self.is_reduction and self.uses_r \
                else " + 0*xindex"
        return text

    def mask(self, guards: bool = True) -> str:
        """The lanes that run: the block's, and (``guards``) the masked bodies' around."""
        parts = ["xmask"]
        if self.is_reduction and self.uses_r:
            parts.append("rmask")
        if guards:
            parts += self.mask_stack
        return " & ".join(parts)

    def _block_index(self, index: Expr) -> Expr:
        """``xindex // D`` is ``xoffset // D`` where every config's XBLOCK divides ``D``:
        the quotient (a split reduction's part) is then one value per program."""
        if not (self.is_reduction and self.max_xblock):
            return index
        step = self.max_xblock
        return index.replace(
            lambda e: isinstance(e, FloorDiv) and e.args[0] == XINDEX
            and isinstance(e.args[1], sympy.Integer) and int(e.args[1]) % step == 0,
            lambda e: FloorDiv(XOFFSET, e.args[1]))

    @staticmethod
    def _per_program(index: Expr) -> bool:
        """An address that varies by program only (``_block_index``'s ``xoffset // D``),
        along neither block dimension."""
        used = index.free_symbols
        return XOFFSET in used and not used & {XINDEX, RINDEX}

    def _always_in_bounds(self, name: str, index: Expr) -> bool:
        """Whether ``index`` stays inside buffer ``name`` for every lane of the block: a
        masked body's load there needs no guard of its own (its value is used only where
        the guard holds), so the same load under several guards (a window's taps reading
        a per-channel vector) is one load."""
        lower = index_lower_bound(index)
        upper = index_upper_bound(index, self.var_ranges)
        if lower is None or upper is None or lower < 0:
            return False
        layout = V.graph.get_buffer(name).layout
        extent = layout.storage_size() if isinstance(layout, Layout) else None
        return isinstance(extent, sympy.Integer) and layout.offset == 0 and upper <= extent

    def _load_mask(self, index: Expr, guards: bool = True) -> str:
        """A reduction's load masked by the block dimensions its address varies along:
        a per-row value (mean, rstd) loads as [XBLOCK, 1], not once per element. A value
        per r alone loads as [1, RBLOCK] only in a column reduction (where that is the
        per-row value and Triton then lays the tile out by the wide, x-contiguous loads
        alone); in a row reduction it stays a full tile (a weight), in the tile's layout
        (as [1, RBLOCK] Triton loads it narrow and converts it through shared memory)."""
        used = index.free_symbols
        if self._per_program(index):
            return " & ".join(["xmask"] + (self.mask_stack if guards else []))
        if not self.is_reduction or not used & {XINDEX, RINDEX} or \
                used - {XINDEX, RINDEX, XOFFSET} - free_size_symbols([index]):
            return self.mask(guards)  # pointwise, constant or indirect addresses: full mask
        if RINDEX in used and XINDEX not in used and not self.outer:
            return self.mask(guards)
        parts = [m for m, sym in (("xmask", XINDEX), ("rmask", RINDEX)) if sym in used]
        return " & ".join(parts + (self.mask_stack if guards else []))

    # -- the ops protocol ---------------------------------------------------------------

    def load(self, name: str, index: Expr) -> CSEVariable:
        simplified = self._simplify(index)
        key = (name, self._print_index(simplified))
        if key in self.stored:
            return self.stored[key]
        for (stored_name, text), where in self.stored_index.items():
            if stored_name == name and (name, text) in self.stored and \
                    same_index(where, simplified):
                return self.stored[(name, text)]
        self._fence(name)
        simplified = self._block_index(simplified)
        idx = self._print_index(simplified)
        if self._per_program(simplified):
            # One value per program (``xoffset // D``): a pointer must be a block like its
            # mask, so it loads as [XBLOCK, 1], as a per-row value would.
            idx += " + 0*xindex"
        if name in self.removed:
            self.unforwarded.add(name)
        dtype = V.graph.get_dtype(name)
        ptr = self.args.input(name)
        other = ", other=0.0" if dtype.is_floating_point else ", other=0"
        guards = bool(self.mask_stack) and not self._always_in_bounds(name, simplified)
        expr = f"tl.load({ptr} + ({idx}), {self._load_mask(simplified, guards)}{other})"
        if dtype in (torch.float16, torch.bfloat16):
            expr += ".to(tl.float32)"
        if dtype == torch.bool:
            expr += ".to(tl.int1)"
        return self.emit(expr, compute_dtype(dtype))

    def store(self, name: str, index: Expr, value: CSEVariable, mode: str | None = None
              ) -> None:
        if mode is not None:
            self._atomic_store(name, index, value, mode)
            return
        self._store_to(self.compute(), name, index, value, self.mask())

    def _fence(self, name: str) -> None:
        """A barrier before loading ``name`` from memory where this kernel wrote it.

        Triton gives a store and a later load their own thread layouts (a strided store
        one element per thread, a load whose value feeds a contiguous store eight per
        thread), so the thread that loads an element is often not the one that stored it,
        and nothing orders the two: the load may read memory from before the store. Seen
        on the H200 as ~0.1% stale values (some NaN) in ResNet-50's saved max-pool copy.
        Fusion only puts a read in the kernel that writes the same element, in the same
        program, so a barrier (``bar.sync``: the block's global writes before it are
        visible to the whole block after it) orders them. A load at an index known to be
        a stored one takes the stored value instead (``load``), needing none.
        """
        if name not in self.unfenced:
            return
        # Written in an earlier phase only: one barrier before this loop, not one per block.
        where = self.loop_pre if self.in_loop and name not in self.loop_unfenced \
            else self.compute()
        where.writeline("tl.debug_barrier()")
        if where is self.loop_pre:
            self.unfenced -= self.unfenced - self.loop_unfenced
        else:
            self.unfenced.clear()
            self.loop_unfenced.clear()

    def _atomic_store(self, name: str, index: Expr, value: CSEVariable, mode: str) -> None:
        """A scatter's combining store: ``tl.atomic_add`` (max, min) at an indirect index.

        Never forwarded to later loads in this kernel: other programs write there too.
        """
        assert mode in _ATOMICS, mode
        dtype = V.graph.get_dtype(name)
        ptr = self.args.output(name)
        cast = f".to({triton_type(dtype)})" if value.dtype != dtype else ""
        self.compute().writeline(f"tl.{_ATOMICS[mode]}({ptr} + ({self.index_str(index)}), "
                                 f"{value}{cast}, {self.mask()}, sem='relaxed')")

    def store_reduction(self, name: str, index: Expr, value: CSEVariable) -> None:
        if self.column:  # one value per column of the part, after the row loop
            self._store_to(self.column_post, name, index, value, "rmask")
            return
        was_r = self.uses_r
        self.uses_r = False
        saved = self.in_loop
        try:
            # In a looped reduction the final value exists after the loop.
            self.in_loop = False
            buf = self.loop_post if self.looped else self.body
            self._store_to(buf, name, index, value, "xmask")
        finally:
            self.in_loop = saved
            self.uses_r = was_r

    def _store_to(self, buf: IndentedBuffer, name: str, index: Expr, value: CSEVariable,
                  mask: str) -> None:
        """Store ``value`` (or only remember it, for a buffer kept in registers)."""
        simplified = self._simplify(index)
        idx = self._print_index(simplified)
        self.stored[(name, idx)] = value
        self.stored_index[(name, idx)] = simplified
        if self.in_loop:
            self.loop_stored.add((name, idx))
        if name in self.removed:
            return
        self.unfenced.add(name)
        if self.in_loop:
            self.loop_unfenced.add(name)
        dtype = V.graph.get_dtype(name)
        ptr = self.args.output(name)
        cast = f".to({triton_type(dtype)})" if value.dtype != dtype else ""
        buf.writeline(f"tl.store({ptr} + ({idx}), {value}{cast}, {mask})")

    def constant(self, value: Any, dtype: torch.dtype) -> CSEVariable:
        dt = compute_dtype(dtype)
        # A reduction's blocks are 2-D: a rank-1 constant would not broadcast with them.
        shape = "[1, 1]" if self.is_reduction else "[1]"
        return self.emit(f"tl.full({shape}, {literal(value, dt)}, {triton_type(dt)})", dt)

    def index_expr(self, expr: Expr, dtype: torch.dtype) -> CSEVariable:
        text = self.index_str(expr)
        var = self.emit(f"({text})", torch.int64 if self.index_dtype == "tl.int64"
                        else torch.int32)
        return self.to_dtype(var, dtype)

    def to_dtype(self, x: CSEVariable, dtype: torch.dtype,
                 src_dtype: torch.dtype | None = None) -> CSEVariable:
        if x.dtype == dtype:
            return x
        if dtype == torch.bool:
            return self.emit(f"({x} != 0)", torch.bool)
        if dtype in (torch.float16, torch.bfloat16):
            # Round as eager would, then keep computing in fp32 (integers go through fp32).
            src = x if x.dtype.is_floating_point else self.emit(f"{x}.to(tl.float32)",
                                                                torch.float32)
            return self.emit(f"{src}.to({triton_type(dtype)}).to(tl.float32)", torch.float32)
        return self.emit(f"{x}.to({triton_type(dtype)})", dtype)

    def to_dtype_bitcast(self, x: CSEVariable, dtype: torch.dtype, src_dtype: torch.dtype
                         ) -> CSEVariable:
        src = x
        if x.dtype != src_dtype:
            src = self.emit(f"{x}.to({triton_type(src_dtype)})", src_dtype)
        return self.emit(f"{src}.to({triton_type(dtype)}, bitcast=True)", dtype)

    def indirect_indexing(self, x: CSEVariable, size: Expr, check: bool = True
                          ) -> sympy.Symbol:
        self._note_sizes(size)
        n = self.printer.print(size)
        var = self.emit(f"tl.where({x} < 0, {x} + {n}, {x})", x.dtype)
        return sympy.Symbol(var.name, integer=True, nonnegative=True)

    def masked(self, mask: CSEVariable, body: Callable[[], Any], other: Any) -> CSEVariable:
        result = run_masked(self.mask_stack, mask, body)
        other_lit = literal(other, result.dtype)
        return self.emit(f"tl.where({mask}, {result}, {other_lit})", result.dtype)

    def where(self, cond: CSEVariable, a: Any, b: Any) -> CSEVariable:
        return self.emit(f"tl.where({cond}, {a}, {b})", promote(a, b))

    def getitem(self, x: Any, i: int) -> CSEVariable:
        return x[i]

    def reduction(self, dtype: torch.dtype, src_dtype: torch.dtype, reduction_type: str,
                  value: CSEVariable) -> Any:
        from .reductions import emit_column_reduction, emit_reduction

        key = (reduction_type, str(value), self.column)
        if key not in self.reduction_cache:
            emit = emit_column_reduction if self.column else emit_reduction
            self.reduction_cache[key] = emit(self, reduction_type, value, dtype)
        return self.reduction_cache[key]

    def __getattr__(self, name: str) -> Callable[..., CSEVariable]:
        if name in UNARY_TEMPLATES or name in BINARY_TEMPLATES or name in _SPECIAL:
            return lambda *args: self._op(name, *args)
        raise AttributeError(name)

    def _op(self, name: str, *args: Any) -> CSEVariable:
        dtype = promote(*args)
        if name in _SPECIAL:
            return _SPECIAL[name](self, dtype, *args)
        if name in UNARY_TEMPLATES:
            expr = UNARY_TEMPLATES[name].format(x=args[0])
        else:
            expr = BINARY_TEMPLATES[name].format(a=args[0], b=args[1])
        return self.emit(expr, torch.bool if name in BOOL_RESULT else dtype)


_ATOMICS = {"atomic_add": "atomic_add", "atomic_max": "atomic_max",
            "atomic_min": "atomic_min"}


def _minmax(kind: str) -> Callable[..., CSEVariable]:
    def op(k: TritonKernel, dtype: torch.dtype, a: Any, b: Any) -> CSEVariable:
        fn = f"th.{kind}" if dtype.is_floating_point else f"tl.{kind}"
        return k.emit(f"{fn}({a}, {b})", dtype)

    return op


def _floordiv(k: TritonKernel, dtype: torch.dtype, a: Any, b: Any) -> CSEVariable:
    if dtype.is_floating_point:
        return k.emit(f"tl.floor({a} / {b})", dtype)
    q = k.emit(f"{a} // {b}", dtype)
    fix = k.emit(f"(({a} % {b}) != 0) & (({a} < 0) != ({b} < 0))", torch.bool)
    return k.emit(f"tl.where({fix}, {q} - 1, {q})", dtype)


def _remainder(k: TritonKernel, dtype: torch.dtype, a: Any, b: Any) -> CSEVariable:
    if dtype.is_floating_point:
        return k.emit(f"{a} - {b} * tl.floor({a} / {b})", dtype)
    r = k.emit(f"{a} % {b}", dtype)
    fix = k.emit(f"({r} != 0) & (({r} < 0) != ({b} < 0))", torch.bool)
    return k.emit(f"tl.where({fix}, {r} + {b}, {r})", dtype)


def _truncdiv(k: TritonKernel, dtype: torch.dtype, a: Any, b: Any) -> CSEVariable:
    if dtype.is_floating_point:
        return k.emit(f"libdevice.trunc({a} / {b})", dtype)
    return k.emit(f"{a} // {b}", dtype)


def _fmod(k: TritonKernel, dtype: torch.dtype, a: Any, b: Any) -> CSEVariable:
    if dtype.is_floating_point:
        return k.emit(f"libdevice.fmod({a}, {b})", dtype)
    return k.emit(f"{a} % {b}", dtype)


def _pow(k: TritonKernel, dtype: torch.dtype, a: Any, b: Any) -> CSEVariable:
    if dtype.is_floating_point:
        return k.emit(f"libdevice.pow({a}, {b})", dtype)
    fa = k.emit(f"{a}.to(tl.float64)", torch.float64)
    fb = k.emit(f"{b}.to(tl.float64)", torch.float64)
    return k.emit(f"libdevice.pow({fa}, {fb}).to({triton_type(dtype)})", dtype)


def _relu(k: TritonKernel, dtype: torch.dtype, x: Any) -> CSEVariable:
    return k.emit(f"tl.where({x} < 0, 0, {x})", dtype)


def _sign(k: TritonKernel, dtype: torch.dtype, x: Any) -> CSEVariable:
    t = triton_type(dtype)
    return k.emit(f"(0 < {x}).to({t}) - ({x} < 0).to({t})", dtype)


def _logical_not(k: TritonKernel, dtype: torch.dtype, x: Any) -> CSEVariable:
    return k.emit(f"({x} == 0)", torch.bool)


def _abs(k: TritonKernel, dtype: torch.dtype, x: Any) -> CSEVariable:
    if dtype == torch.bool:
        return x
    return k.emit(f"tl.abs({x})", dtype)


_SPECIAL: dict[str, Callable[..., CSEVariable]] = {
    "maximum": _minmax("maximum"), "minimum": _minmax("minimum"), "floordiv": _floordiv,
    "remainder": _remainder, "truncdiv": _truncdiv, "fmod": _fmod, "pow": _pow,
    "relu": _relu, "sign": _sign, "logical_not": _logical_not, "abs": _abs,
}
