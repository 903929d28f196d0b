"""Read/write dependencies, extracted by running a loop body under a recording handler.

``MemoryDep`` is a read or write of a buffer at an index (over canonical iteration
variables ``c0, c1, ...``); ``StarDep`` reads a whole buffer in an unknown pattern
(extern kernels, templates); ``WeakDep`` only orders two nodes (a mutation after its
readers) and keeps nothing alive.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from .ir.sym import Expr, FloorDiv, ModularIndexing
from .ops_handler import BINARY_OPS, UNARY_OPS, DefaultHandler
from .virtualized import V


@dataclass(frozen=True)
class MemoryDep:
    """Buffer ``name`` accessed at ``index`` over iteration variables of sizes ``size``."""

    name: str
    index: Expr
    var_names: tuple[sympy.Symbol, ...]
    size: tuple[Expr, ...]

    def numel(self) -> Expr:
        n: Expr = sympy.Integer(1)
        for s in self.size:
            n = n * s
        return n

    def is_indirect(self) -> bool:
        return any(s.name.startswith("indirect") for s in self.index.free_symbols
                   if isinstance(s, sympy.Symbol))


@dataclass(frozen=True)
class StarDep:
    """The whole of buffer ``name``, in an access pattern the scheduler cannot see."""

    name: str


@dataclass(frozen=True)
class WeakDep:
    """Orders this node after the one that reads ``name``; extends no buffer's life."""

    name: str
    mutating_buf: str = ""


Dep = MemoryDep | StarDep | WeakDep


@functools.lru_cache(maxsize=1 << 16)
def normalize_dep(dep: MemoryDep) -> MemoryDep:
    """Drop size-1 loops and merge adjacent loops that the index walks contiguously.

    Memoized: deps are frozen and sympy expressions immutable, and fusion asks for the
    same deps over and over (every candidate pair, every round); uncached, this was most
    of the graph stage of a large graph.

    ``c1 + 128*c0`` over (64, 128) and ``c0`` over (8192,) are the same access; after
    normalization they compare equal, which is how fusion decides two nodes touch the
    same element in the same iteration.
    """
    index = dep.index
    sizes = list(dep.size)
    var_list = list(dep.var_names[: len(sizes)])
    zero = sympy.S.Zero  # xreplace of a bare symbol returns the replacement as given
    for v, s in zip(list(var_list), list(sizes)):
        if s == 1:
            index = index.xreplace({v: zero})
    keep = [(v, s) for v, s in zip(var_list, sizes) if s != 1]
    merged: list[tuple[Expr, Expr]] = []  # (expression of the loop, size)
    for v, s in keep:
        if merged:
            pv, ps = merged[-1]
            c_prev, c_cur = index.coeff(pv), index.coeff(v)
            if c_prev != 0 and c_prev == c_cur * s and not index.has(FloorDiv, ModularIndexing):
                new = sympy.Symbol(f"m{len(merged)}", integer=True, nonnegative=True)
                index = sympy.expand(index.xreplace({pv: zero, v: zero}) + c_cur * new)
                merged[-1] = (new, ps * s)
                continue
        merged.append((v, s))
    canon = canonical_vars(len(merged))
    # xreplace, not subs: symbols for symbols, all at once, without subs's pattern search
    index = sympy.expand(index.xreplace({v: c for (v, _), c in zip(merged, canon)}))
    return MemoryDep(dep.name, index, canon, tuple(s for _, s in merged))


@dataclass(frozen=True)
class ReadWrites:
    """The dependencies of one loop body, plus the op names it used (for kernel names)."""

    reads: frozenset[Dep]
    writes: frozenset[Dep]
    index_exprs: frozenset[Expr] = frozenset()
    op_names: tuple[str, ...] = ()

    def read_names(self) -> set[str]:
        return {d.name for d in self.reads}

    def write_names(self) -> set[str]:
        return {d.name for d in self.writes}

    def with_read(self, deps: set[Dep]) -> ReadWrites:
        return ReadWrites(self.reads | deps, self.writes, self.index_exprs, self.op_names)

    def merge(self, other: ReadWrites) -> ReadWrites:
        """Union of two bodies in one kernel: reads satisfied by the other's writes vanish."""
        writes = self.writes | other.writes
        reads = (self.reads | other.reads) - writes
        ops = tuple(dict.fromkeys(self.op_names + other.op_names))
        return ReadWrites(reads, writes, self.index_exprs | other.index_exprs, ops)


@dataclass
class _Token:
    """An opaque value flowing through the recording handler."""

    tag: str = "v"


_indirect_ids = itertools.count()

# Ops that do not name a kernel.
_PLUMBING = frozenset({"load", "store", "store_reduction", "constant", "index_expr",
                       "to_dtype", "getitem", "masked", "indirect_indexing",
                       "to_dtype_bitcast"})


_SCATTER_NAMES = {"atomic_add": "scatter_add", "atomic_max": "scatter_max",
                  "atomic_min": "scatter_min"}


@dataclass
class RecordLoadStore(DefaultHandler[_Token]):
    """The recording ops handler: every load and store becomes a MemoryDep."""

    var_names: tuple[sympy.Symbol, ...]
    size: tuple[Expr, ...]
    num_index_vars: int = -1
    reads: set[Dep] = field(default_factory=set)
    writes: set[Dep] = field(default_factory=set)
    index_exprs: set[Expr] = field(default_factory=set)
    op_names: list[str] = field(default_factory=list)

    def _dep(self, name: str, index: Expr) -> MemoryDep:
        return MemoryDep(name, sympy.expand(index), self.var_names, self.size)

    def _note(self, name: str) -> None:
        if name not in _PLUMBING and name not in self.op_names:
            self.op_names.append(name)

    def load(self, name: str, index: Expr) -> _Token:
        self.reads.add(self._dep(name, index))
        return _Token()

    def store(self, name: str, index: Expr, value: Any, mode: str | None = None) -> None:
        dep = self._dep(name, index)
        self.writes.add(dep)
        if mode is not None or dep.is_indirect():  # a scatter names its kernel
            self._note(_SCATTER_NAMES.get(mode or "", "scatter"))

    def store_reduction(self, name: str, index: Expr, value: Any) -> None:
        # A reduction's output is indexed by its non-reduced variables only.
        n = self.num_index_vars
        self.writes.add(MemoryDep(name, sympy.expand(index), self.var_names[:n], self.size[:n]))

    def reduction(self, dtype: torch.dtype, src_dtype: torch.dtype, reduction_type: str,
                  value: Any) -> _Token:
        self._note({"welford_reduce": "var_mean"}.get(reduction_type, reduction_type))
        return _Token()

    def constant(self, value: Any, dtype: torch.dtype) -> _Token:
        return _Token()

    def index_expr(self, expr: Expr, dtype: torch.dtype) -> _Token:
        self.index_exprs.add(expr)
        return _Token()

    def to_dtype(self, x: Any, dtype: torch.dtype, src_dtype: torch.dtype | None = None) -> Any:
        return x

    def to_dtype_bitcast(self, x: Any, dtype: torch.dtype, src_dtype: torch.dtype) -> Any:
        return x

    def indirect_indexing(self, x: Any, size: Expr, check: bool = True) -> sympy.Symbol:
        return sympy.Symbol(f"indirect{next(_indirect_ids)}", integer=True, nonnegative=True)

    def masked(self, mask: Any, body: Callable[[], Any], other: Any) -> _Token:
        body()
        return _Token()

    def where(self, cond: Any, a: Any, b: Any) -> _Token:
        self._note("where")
        return _Token()

    def getitem(self, x: Any, i: int) -> _Token:
        return _Token()

    def _default(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Token:
        assert name in UNARY_OPS or name in BINARY_OPS
        self._note(name)
        return _Token()


def canonical_vars(n: int, prefix: str = "c") -> tuple[sympy.Symbol, ...]:
    return tuple(sympy.Symbol(f"{prefix}{i}", integer=True, nonnegative=True) for i in range(n))


def extract_read_writes(
    fn: Callable[..., Any] | Any,
    ranges: Sequence[Expr] | None = None,
    reduction_ranges: Sequence[Expr] = (),
) -> ReadWrites:
    """Run a loop body (or a Loops node's ``inner_fn``) once, recording its memory accesses.

    Index and reduction variables are the canonical ``c0, c1, ...`` so that the same
    access from two nodes over the same ranges compares equal.
    """
    from .ir.nodes import Loops, Reduction

    body: Callable[..., Any] = fn
    if isinstance(fn, Loops):
        node = fn
        ranges, reduction_ranges = node.ranges, node.get_reduction_size()
        body = node.inner_fn
        if isinstance(node, Reduction):
            inner = node.inner_fn

            def body(index: Sequence[Expr], rindex: Sequence[Expr]) -> Any:
                return V.ops.reduction(node.dtype, node.src_dtype, node.reduction_type,
                                       inner(index, rindex))
    assert ranges is not None
    all_vars = canonical_vars(len(ranges) + len(reduction_ranges))
    index, rindex = list(all_vars[: len(ranges)]), list(all_vars[len(ranges):])
    handler = RecordLoadStore(all_vars, tuple(ranges) + tuple(reduction_ranges), len(ranges))
    with V.set_ops_handler(handler):
        if reduction_ranges:
            body(index, rindex)
        else:
            body(index)
    return ReadWrites(frozenset(handler.reads), frozenset(handler.writes),
                      frozenset(handler.index_exprs), tuple(handler.op_names))


def reduction_access_order(rw: ReadWrites, num_index_vars: int) -> tuple[int, int]:
    """(inner, outer): elements of the reads of a reduction body that walk memory along
    the reduced dimension (a row sum) or along the last kept dimension (a column sum).

    Each read counts the elements it touches, so a row vector broadcast over the columns
    (layer norm's mean and rstd in its weight gradient) does not outvote the matrices.
    """
    inner = outer = 0
    for dep in rw.reads:
        if not isinstance(dep, MemoryDep) or dep.is_indirect() or not dep.size:
            continue
        r_last = dep.var_names[len(dep.size) - 1]
        cx = dep.index.coeff(dep.var_names[num_index_vars - 1]) if num_index_vars else 0
        used = dep.index.free_symbols
        weight = 1
        for var, size in zip(dep.var_names, dep.size):
            if var in used and isinstance(size, sympy.Integer):
                weight *= int(size)
        if dep.index.coeff(r_last) == 1:
            inner += weight
        elif cx == 1:
            outer += weight
    return inner, outer
