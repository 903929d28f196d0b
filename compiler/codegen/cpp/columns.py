"""Column reductions: reducing along a strided dimension, vectorized across the
contiguous one.

``x.sum(0)`` of a row-major matrix reads each column with a stride of a whole row:
reducing one column at a time touches a new cache line (and page) per element and does
not vectorize. Instead, a block of up to ``COLUMN_BLOCK`` adjacent columns is reduced
together: the r loop walks the rows, and an inner ``#pragma omp simd`` loop over the
block's columns updates one accumulator per column (lane ``xl``), reading each row's
segment contiguously. Blocks run across threads; when there are few, the rows are split
across threads instead, each keeping its own accumulators, merged in thread order.

A kernel takes this form when its reduction reads are column-wise and it is one phase
with no stores before it; otherwise ``NotColumnKernel`` sends it back to the row form.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from ...dependencies import MemoryDep
from ...scheduler import SchedulerNode
from ..common import IndentedBuffer
from .kernel import CppKernel, Phase

# Columns reduced together (accumulator arrays of this many elements, on the stack).
COLUMN_BLOCK = 4096
# Fewer contiguous columns than this are not worth vector lanes.
MIN_COLUMNS = 16
# With fewer blocks than this, rows are split across threads instead of blocks.
PARALLEL_BLOCKS = 8
# Rows accumulated afresh before they are folded into the totals.
ROW_CHUNK = 64


@dataclass(frozen=True)
class ColumnPlan:
    """How a column-reduction kernel walks its columns."""

    width: int  # columns per block
    split_rows: bool  # threads take rows of each block (few blocks) rather than blocks


def plan_columns(red: SchedulerNode, ranges: list[int], rranges: list[int],
                 xsizes: list[int], mode: str) -> ColumnPlan | None:
    """A column plan when ``red`` reads along strided rows and contiguous columns."""
    if mode == "r" or not xsizes or xsizes[-1] < MIN_COLUMNS or not rranges:
        return None
    names = [sympy.Symbol(f"c{i}", integer=True, nonnegative=True)
             for i in range(len(ranges) + len(rranges))]
    x_inner = _innermost(names[: len(ranges)], ranges)
    r_inner = _innermost(names[len(ranges):], rranges)
    if x_inner is None or r_inner is None:
        return None
    columns = rows = 0
    for dep in red.read_writes.reads:
        if not isinstance(dep, MemoryDep):
            continue
        expr = sympy.expand(dep.index)
        along_r, along_x = expr.coeff(r_inner), expr.coeff(x_inner)
        if along_r == 1:
            rows += 1
        elif along_x == 1 and along_r != 0:
            columns += 1
    if not columns or rows:
        return None
    width = min(xsizes[-1], COLUMN_BLOCK)
    blocks = -(-xsizes[-1] // width)
    for size in xsizes[:-1]:
        blocks *= size
    return ColumnPlan(width, split_rows=mode == "x" and blocks < PARALLEL_BLOCKS)


def _innermost(names: list[sympy.Symbol], sizes: list[int]) -> sympy.Symbol | None:
    inner = [n for n, s in zip(names, sizes) if s > 1]
    return inner[-1] if inner else None


def render_columns(k: CppKernel, plan: ColumnPlan) -> IndentedBuffer:
    """The code of one column block: the rows' loop, then each column's epilogue."""
    phases = [s for s in k.segments if isinstance(s, Phase)]
    before = k.segments[0]
    after = k.segments[-1]
    assert len(phases) == 1 and isinstance(before, IndentedBuffer)
    assert isinstance(after, IndentedBuffer)
    phase = phases[0]
    inner = f"x{len(k.xsizes) - 1}"
    code = IndentedBuffer()
    code.writeline(f"const int64_t xn = {k.xsizes[-1]} - xb < {plan.width} ? "
                   f"{k.xsizes[-1]} - xb : {plan.width};")
    code.splice(phase.pre)
    if plan.split_rows:  # the block's accumulators receive each thread's totals
        for acc in phase.accumulators:
            acc.declare(code, plan.width)
    else:
        _declare(phase, plan.width, code)
    if plan.split_rows:
        _rows_across_threads(k, phase, before, inner, plan, code)
    else:
        _rows(k, phase, before, inner, code)
    code.writeline("for (int64_t xl = 0; xl < xn; ++xl)")
    code.writeline("{")
    with code.indent():
        code.writeline(f"const int64_t {inner} = xb + xl;")
        code.splice(before)
        code.splice(phase.post)
        code.splice(after)
    code.writeline("}")
    return code


def _rows(k: CppKernel, phase: Phase, before: IndentedBuffer, inner: str,
          code: IndentedBuffer) -> None:
    """Rows in chunks: each chunk accumulates afresh and is then folded into the totals,
    so a sum of many rows adds numbers of like size (as a pairwise sum would)."""
    code.writeline(f"for (int64_t rc = 0; rc < {k.rnumel}; rc += {ROW_CHUNK})")
    code.writeline("{")
    with code.indent():
        code.writeline(f"const int64_t rend = rc + {ROW_CHUNK} < {k.rnumel} ? "
                       f"rc + {ROW_CHUNK} : {k.rnumel};")
        code.writeline("for (int64_t r0 = rc; r0 < rend; ++r0)")
        code.writeline("{")
        with code.indent():
            code.splice(phase.block_pre)
            code.writeline("#pragma omp simd")
            code.writeline("for (int64_t xl = 0; xl < xn; ++xl)")
            code.writeline("{")
            with code.indent():
                code.writeline(f"const int64_t {inner} = xb + xl;")
                code.splice(before)
                code.splice(phase.body)
            code.writeline("}")
        code.writeline("}")
        code.writeline("for (int64_t xl = 0; xl < xn; ++xl)")
        code.writeline("{")
        with code.indent():
            for acc in phase.accumulators:
                totals = [f"{acc.array(s)}_total[xl]" for s, _, _ in acc.parts]
                code.writeline(acc.merge(totals, acc.refs("xl")))
                for suffix, _, init in acc.parts:
                    code.writeline(f"{acc.array(suffix)}[xl] = {init};")
        code.writeline("}")
    code.writeline("}")
    code.writeline("for (int64_t xl = 0; xl < xn; ++xl)")
    code.writeline("{")
    with code.indent():
        for acc in phase.accumulators:
            for suffix, _, _ in acc.parts:
                code.writeline(f"{acc.array(suffix)}[xl] = {acc.array(suffix)}_total[xl];")
    code.writeline("}")


def _declare(phase: Phase, width: int, code: IndentedBuffer) -> None:
    """Each accumulator's chunk arrays and totals."""
    for acc in phase.accumulators:
        acc.declare(code, width)
        for suffix, ct, init in acc.parts:
            total = f"{acc.array(suffix)}_total"
            code.writeline(f"{ct} {total}[{width}];")
            code.writeline(f"for (int64_t l = 0; l < {width}; ++l) {total}[l] = {init};")


def _rows_across_threads(k: CppKernel, phase: Phase, before: IndentedBuffer, inner: str,
                         plan: ColumnPlan, code: IndentedBuffer) -> None:
    """Each thread reduces its rows into its own accumulators; they are merged into the
    block's in thread order (deterministic for a given number of threads)."""
    for acc in phase.accumulators:
        for suffix, _, _ in acc.parts:
            code.writeline(f"auto* const {acc.array(suffix)}_all = {acc.array(suffix)};")
    code.writeline("#pragma omp parallel")
    code.writeline("{")
    with code.indent():
        _declare(phase, plan.width, code)
        code.writeline("#pragma omp for schedule(static)")
        _rows(k, phase, before, inner, code)
        code.writeline("#pragma omp for ordered schedule(static, 1)")
        code.writeline("for (int64_t t = 0; t < omp_get_num_threads(); ++t)")
        code.writeline("{")
        with code.indent():
            code.writeline("#pragma omp ordered")
            code.writeline("for (int64_t xl = 0; xl < xn; ++xl)")
            code.writeline("{")
            with code.indent():
                for acc in phase.accumulators:
                    dst = [f"{acc.array(s)}_all[xl]" for s, _, _ in acc.parts]
                    code.writeline(acc.merge(dst, acc.refs("xl")))
            code.writeline("}")
        code.writeline("}")
    code.writeline("}")
