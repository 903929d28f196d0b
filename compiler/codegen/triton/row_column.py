"""Row-column kernels: a row reduction over ``[M, N]`` that also computes the first stage
of split column reductions over the same rows, so that both read the rows once.

Layer-norm backward is the case in point: the input gradient needs two row sums, the
weight and bias gradients are column sums of the same ``g`` and ``x``. Split apart, the
rows are read twice (the column stage again, 40% more traffic). Fused, one program per
part of the rows (``P``, one per SM, see ``lowering/reductions._row_parts``) keeps a row
(or ``XBLOCK`` rows) in registers per iteration of a loop over its ``M / P`` rows: it
reduces each row as a persistent reduction does, and adds the row into per-column
accumulators, which it stores once, after the loop, as part ``pid`` of the partials that
the column reduction's second stage then sums.

The column stage's loops ``(part, *columns) x (row in part,)`` map onto the kernel's as
``part -> pid``, ``columns -> rindex`` and ``row in part -> xindex - pid * rows``: any
column stage whose parts times rows are the row reduction's rows and whose columns are
its row length computes the same values this way; it is fused when the two share reads
of the ``[M, N]`` data (otherwise nothing is saved).
"""

from __future__ import annotations

import re
from typing import Any

import sympy

from ...ir.nodes import ComputedBuffer, Reduction
from ...ir.sym import Expr, prod
from ...scheduler import BaseSchedulerNode, RowColumnSchedulerNode, SchedulerNode
from ...virtualized import V
from ..common import IndentedBuffer, next_power_of_2
from ..simd import SIMDScheduling, is_outer_reduction
from .heuristics import PERSISTENT_RNUMEL

PID = sympy.Symbol("pid", integer=True, nonnegative=True)
# Column reductions a row-column kernel accumulates (combine along axis 0 at the end).
COLUMN_REDUCTIONS = ("sum", "prod", "max", "min")
# Elements of a 2-byte row tile per thread beyond which ptxas spills (row_column_configs).
MAX_PER_THREAD = 16

Plan = tuple[tuple[Expr, Expr], int, set[str]]


class TritonScheduling(SIMDScheduling):
    """The fusion rules of GPU (Triton) graphs: the loop backends' rules, row-column
    kernels, and sibling reductions."""

    def row_column_plan(self, node1: BaseSchedulerNode, node2: BaseSchedulerNode
                        ) -> Plan | None:
        return row_column_plan(node1, node2)

    def row_column_allows(self, node1: BaseSchedulerNode, node2: BaseSchedulerNode) -> bool:
        return row_column_allows(node1, node2)

    def can_fuse_siblings(self, node1: BaseSchedulerNode, node2: BaseSchedulerNode) -> bool:
        """Two independent reductions in one kernel: the same space, walked in the same
        order (a column reduction next to a row reduction would walk one of them across
        memory)."""
        return self._same_space(node1, node2) and \
            is_outer_reduction(node1) == is_outer_reduction(node2)


def row_column_plan(node1: BaseSchedulerNode, node2: BaseSchedulerNode) -> Plan | None:
    """(row group, parts, column stage names) when one node is a row reduction (or a
    row-column node) and the other a column stage over the same rows that shares its
    reads; None otherwise."""
    for row, col in ((node1, node2), (node2, node1)):
        plan = _plan(row, col)
        if plan is not None:
            return plan
    return None


def row_column_allows(node1: BaseSchedulerNode, node2: BaseSchedulerNode) -> bool:
    """A row-column node takes nothing that reads its partials (they exist only after
    its loop), nor another row-column node of other parts."""
    for a, b in ((node1, node2), (node2, node1)):
        if not isinstance(a, RowColumnSchedulerNode):
            continue
        if b.read_writes.read_names() & a.column_names:
            return False
        if isinstance(b, RowColumnSchedulerNode) and b.parts != a.parts:
            return False
    return True


def _plan(row: BaseSchedulerNode, col: BaseSchedulerNode) -> Plan | None:
    # A graph with dynamic shapes launches its kernels over their xnumel argument, not
    # over a fixed number of programs.
    if V.graph.sizevars.is_dynamic():
        return None
    if isinstance(col, RowColumnSchedulerNode) or "cuda" not in (
            row.get_device().type, col.get_device().type) or \
            row.get_device() != col.get_device():
        return None
    rows = _row_group(row)
    stage = _column_stage(col)
    if rows is None or stage is None:
        return None
    (m, n), (parts, columns, chunk) = rows, stage
    if parts * chunk != m or columns != n or parts < _min_parts():
        return None
    if isinstance(row, RowColumnSchedulerNode) and row.parts != parts:
        return None
    if not _shared_rows(row, col, m * n) or not _reads_in_step(row, col, m, n, parts, chunk):
        return None
    names = set(col.get_names())
    if isinstance(row, RowColumnSchedulerNode):
        names |= row.column_names
    return (sympy.Integer(m), sympy.Integer(n)), parts, names


def _min_parts() -> int:
    """One program per part: with fewer than half the SMs busy the fused kernel is
    slower than the two it replaces, which spread over all of them (small layer norms:
    2048 rows split in 64 parts of 32 rows on an H200)."""
    from ...lowering.reductions import sm_count

    return sm_count() // 2


def _subnodes(node: BaseSchedulerNode) -> list[SchedulerNode]:
    subs = node.row_nodes() if isinstance(node, RowColumnSchedulerNode) else node.get_nodes()
    return [s for s in subs if isinstance(s, SchedulerNode)
            and isinstance(s.node, ComputedBuffer)]


def _row_group(node: BaseSchedulerNode) -> tuple[int, int] | None:
    """(M, N) of a persistent row reduction node (static sizes, rows contiguous)."""
    if node.is_template() or node.is_extern() or node.is_nop() or not node.is_reduction():
        return None
    m, n = node.group
    if not (m.is_Integer and n.is_Integer) or int(n) > PERSISTENT_RNUMEL:
        return None
    subs = _subnodes(node)
    if len(subs) != len(node.get_nodes()) - len(getattr(node, "column_names", ())):
        return None
    reds = [s for s in subs if s.is_reduction()]
    if not reds or any(s.group != (m, n) for s in reds):
        return None
    if any(is_outer_reduction(s) for s in reds):
        return None
    return int(m), int(n)


def _column_stage(node: BaseSchedulerNode) -> tuple[int, int, int] | None:
    """(parts, columns, rows per part) of a node of column-stage reductions: each over
    ranges ``(parts, *columns)`` and one reduced loop (the rows of its part), strided."""
    subs = _subnodes(node)
    if not subs or len(subs) != len(node.get_nodes()) or not is_outer_reduction(node):
        return None
    shapes = set()
    for s in subs:
        data = getattr(s.node, "data", None)
        if not isinstance(data, Reduction) or data.reduction_type not in COLUMN_REDUCTIONS \
                or data.output_index is not None:
            return None
        ranges, rranges = s.get_ranges()
        if len(ranges) < 2 or len(rranges) != 1:
            return None
        sizes = (ranges[0], prod(ranges[1:]), rranges[0])
        if not all(isinstance(v, sympy.Integer) or getattr(v, "is_Integer", False)
                   for v in sizes):
            return None
        shapes.add(tuple(int(v) for v in sizes))
    if len(shapes) != 1:
        return None
    parts, columns, chunk = shapes.pop()
    return parts, columns, chunk


def _reads_in_step(row: BaseSchedulerNode, col: BaseSchedulerNode, m: int, n: int,
                   parts: int, chunk: int) -> bool:
    """The row node reads nothing of the column stage (its partials exist only after the
    loop), and the column stage reads of the row node's buffers only the element the
    row node wrote in the same iteration (a row's mean and rstd, or the element itself)."""
    from ...dependencies import MemoryDep
    from ...ir.sym import simplify_with_ranges, unflatten_index

    if any(d.name in col.get_names() for d in row.unmet_dependencies):
        return False
    writes = {d.name: d for d in row.read_writes.writes}
    x, y = sympy.symbols("row_x row_y", integer=True, nonnegative=True)
    ranges = {x: sympy.Integer(m), y: sympy.Integer(n), PID: sympy.Integer(parts)}
    for dep in col.unmet_dependencies:
        if dep.name not in row.get_names():
            continue
        write = writes.get(dep.name)
        if not isinstance(dep, MemoryDep) or not isinstance(write, MemoryDep) or \
                dep.is_indirect() or write.is_indirect() or len(dep.size) < 3:
            return False
        span = int(prod(write.size)) if prod(write.size).is_Integer else -1
        if span not in (m, m * n):
            return False
        flat = x if span == m else x * n + y
        wmap = dict(zip(write.var_names, unflatten_index(flat, write.size)))
        rvars, rsize = dep.var_names[:len(dep.size)], dep.size
        rmap = dict(zip(rvars[1:-1], unflatten_index(y, rsize[1:-1])))
        rmap.update({rvars[0]: PID, rvars[-1]: x - chunk * PID})
        want, got = (simplify_with_ranges(sympy.expand(e), ranges) for e in
                     (write.index.xreplace(wmap), dep.index.xreplace(rmap)))
        if sympy.expand(want - got) != 0:
            return False
    return True


def _shared_rows(row: BaseSchedulerNode, col: BaseSchedulerNode, numel: int) -> bool:
    return bool(_whole_reads(row, numel) & _whole_reads(col, numel))


def _whole_reads(node: BaseSchedulerNode, numel: int) -> set[str]:
    """Buffers the node reads ``numel`` distinct elements of (the ``[M, N]`` data, not
    a per-row value broadcast over the row)."""
    from ...dependencies import MemoryDep

    out = set()
    for dep in node.read_writes.reads:
        if not isinstance(dep, MemoryDep) or dep.is_indirect():
            continue
        used = dep.index.free_symbols
        touched = prod([s for v, s in zip(dep.var_names, dep.size) if v in used])
        if touched == numel:
            out.add(dep.name)
    return out


# -- code generation -----------------------------------------------------------------------


def row_column_configs(rnumel: int, rows: int, itemsize: int = 2) -> list[dict[str, Any]]:
    """(XBLOCK rows per iteration, warps) with 8 or 16 elements of a 2-byte row tile per
    thread (half as many of 4 bytes: the next block's raw loads are held too): at
    8192 x 4096 bf16 (layer-norm backward) ptxas gives 64 registers for 8 (32 warps allow
    no more), 128 for 16, and spills at 32; fp32 at 16384 x 1024 spills at 16. XBLOCK
    divides a part's rows: every iteration is whole. One program runs per SM: more rows
    or warps per program keep more loads in flight, which autotuning weighs against
    registers."""
    rblock = next_power_of_2(rnumel)
    cap = min(rows & -rows, 64)  # the largest power of two dividing the rows of a part
    scale = max(1, itemsize // 2)
    out: list[dict[str, Any]] = []
    for per_thread, warps in ((8, 16), (16, 16), (8, 32), (16, 8)):
        xblock = max(1, min(cap, per_thread // scale * warps * 32 // rblock))
        if xblock * rblock > MAX_PER_THREAD // scale * warps * 32:
            continue
        cfg = {"XBLOCK": xblock, "RBLOCK": rblock, "num_warps": warps, "num_stages": 1}
        if cfg not in out:
            out.append(cfg)
    return out or [{"XBLOCK": 1, "RBLOCK": rblock, "num_warps": 16, "num_stages": 1}]


def row_itemsize(node: BaseSchedulerNode, numel: int) -> int:
    """Bytes of the widest element the node reads over the whole ``[M, N]`` space."""
    names = _whole_reads(node, numel)
    return max((V.graph.get_dtype(name).itemsize for name in names), default=2)


def render_frame(kernel: Any, rows: int, code: IndentedBuffer) -> None:
    """The kernel's frame: program ``pid`` loops over its part's rows; column
    accumulators start before the loop and are stored after it. The loop is software
    pipelined: the next block's row loads are issued before this block's reductions and
    converted only at the next iteration, so one program per SM keeps its memory busy
    while it reduces (nothing else runs on that SM to hide the latency)."""
    pid = "tl.program_id(0)"
    if kernel.index_dtype == "tl.int64":
        pid += ".to(tl.int64)"
    end = f"pid * {rows} + {rows}"
    prefetched, hoisted, body = _split_row_loads(kernel.body.lines)
    code.writeline(f"xnumel = {kernel.xnumel}")
    code.writeline(f"rnumel = {kernel.rnumel}")
    code.writeline(f"pid = {pid}")
    code.writeline("rindex = tl.arange(0, RBLOCK)[None, :]")
    code.writeline("rmask = rindex < rnumel")
    code.writeline("xbase = tl.arange(0, XBLOCK)[:, None]")
    code.writeline(f"xoffset_0 = pid * {rows}")
    code.writeline("xindex_0 = xoffset_0 + xbase")
    code.writeline("xmask_0 = xindex_0 < xnumel")
    for name, load, _ in prefetched:
        code.writeline(f"p{name} = {_rename(load, '_0')}")
    for line in hoisted:  # the same in every iteration (a weight): loaded once
        code.writeline(_rename(line, "_0"))
    code.splice(kernel.column_pre)
    code.writeline(f"for xoffset in range(pid * {rows}, {end}, XBLOCK):")
    with code.indent():
        code.writeline("xindex = xoffset + xbase")
        code.writeline("xmask = xindex < xnumel")
        for name, _, convert in prefetched:
            code.writeline(f"{name} = p{name}{convert}")
        if prefetched:
            code.writeline("xoffset_n = xoffset + XBLOCK")
            code.writeline("xindex_n = xoffset_n + xbase")
            code.writeline(f"xmask_n = (xindex_n < xnumel) & (xindex_n < {end})")
        for name, load, _ in prefetched:
            code.writeline(f"p{name} = {_rename(load, '_n')}")
        code.lines.extend("    " * code.level + line if line else "" for line in body)
    code.splice(kernel.column_post)


# ``tmpN = tl.load(in_ptrK + (index), mask, other=...)`` with an optional conversion.
_LOAD = re.compile(r"^(?P<name>tmp\d+) = (?P<load>tl\.load\(in_ptr\d+ \+ \((?P<index>[^()]*|"
                   r"[^()]*\([^()]*\)[^()]*)\), (?P<mask>[^,]*), other=[^)]*\))"
                   r"(?P<convert>\.to\(tl\.\w+\))?$")
_FRAME_NAMES = re.compile(r"\b(xindex|xmask|xoffset)\b")
_KNOWN = {"xindex", "xmask", "xoffset", "rindex", "rmask", "pid"}


def _split_row_loads(lines: list[str]
                     ) -> tuple[list[tuple[str, str, str]], list[str], list[str]]:
    """The body's loads of the kernel's inputs at addresses of the frame's names alone:
    (name, load, conversion) of those that change with the rows, the lines of those
    that do not (every part has whole blocks of rows: ``xmask`` is the same in every
    iteration), and the other lines."""
    prefetched, hoisted, rest = [], [], []
    for line in lines:
        m = _LOAD.match(line)
        names = set(re.findall(r"[A-Za-z_]\w*", m.group("index") + " " + m.group("mask"))) \
            if m else set()
        if not m or not names <= _KNOWN:
            rest.append(line)
        elif names & {"xindex", "xoffset"}:
            prefetched.append((m.group("name"), m.group("load"), m.group("convert") or ""))
        else:
            hoisted.append(line)
    return prefetched, hoisted, rest


def _rename(load: str, suffix: str) -> str:
    return _FRAME_NAMES.sub(lambda m: m.group(1) + suffix, load)
