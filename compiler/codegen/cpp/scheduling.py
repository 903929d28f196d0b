"""Turn one (fused) scheduler node into a C++ kernel source.

The kernel's x loop nest is the merged loop nest of one of its nodes (the one whose
accesses merge least, so broadcasts stay plain indices); the other nodes' loops are
mapped onto it by flattening and splitting, which simplifies back to plain indices
when the shapes line up. Reductions iterate one flat ``r0``.
"""

from __future__ import annotations

from collections.abc import Sequence

import sympy

from ...dependencies import MemoryDep
from ...ir.nodes import ComputedBuffer
from ...ir.sym import Expr, prod, unflatten_index
from ...scheduler import BaseSchedulerNode, SchedulerNode
from ...virtualized import V
from ..common import IndentedBuffer, linear_substitution, merge_loops
from ..kernel_spec import KernelSpec
from ..triton.scheduling import NAME_PLACEHOLDER, UnforwardedBuffers
from .columns import ColumnPlan, plan_columns
from .kernel import RINDEX, CppKernel, NotColumnKernel, xvar
from .overrides import CppIndexPrinter, storage_type
from .prelude import PRELUDE_NAME

# Kernels with less work than this many elements run on one thread.
PARALLEL_MIN_WORK = 1 << 15
# Reductions with fewer rows than this split their reduction loop across threads.
SPLIT_R_MAX_ROWS = 16
# A pointwise loop nest parallelizes its outer loops when they have this many iterations.
PARALLEL_MIN_OUTER = 64


def codegen_cpp(node: BaseSchedulerNode, removed: set[str]) -> tuple[str, KernelSpec]:
    """Source (function named ``KERNEL_NAME``) and spec of the C++ kernel for ``node``.

    Buffers in ``removed`` stay in variables; one read back in a later loop phase raises
    ``UnforwardedBuffers`` and the caller retries with it stored.
    """
    xnumel, rnumel = (sympy.sympify(v) for v in node.group)
    subs = [_scheduler_node(sub) for sub in node.get_nodes()]
    has_red = any(sub.is_reduction() for sub in subs)
    xsizes = _choose_xsizes(subs, xnumel, has_red)
    sizevars = V.graph.sizevars
    mode = _parallel_mode(sizevars.size_hint(xnumel), sizevars.size_hint(rnumel), has_red)
    # Column blocks need static sizes (blocks of a known width over a known row count).
    static = not sizevars.is_dynamic()
    plan = _column_plan(subs, xsizes, mode) if has_red and static else None
    try:
        kernel, body = _generate(subs, xsizes, rnumel if has_red else 1, removed, mode, plan)
    except NotColumnKernel:
        kernel, body = _generate(subs, xsizes, rnumel, removed, mode, None)
    lost = kernel.unforwarded & removed
    if lost:
        raise UnforwardedBuffers(lost)
    kind = "reduction" if has_red else "pointwise"
    spec = KernelSpec(
        name=NAME_PLACEHOLDER, backend="cpp", kind=kind, source=render(kernel, body, has_red),
        arg_buffers=tuple(buf for _, buf in kernel.args.call_args()),
        signature=_signature(kernel), xnumel=sizevars.size_hint(xnumel),
        rnumel=sizevars.size_hint(rnumel), configs=({"parallel": kernel.mode},),
        size_args=tuple(s.name for s in kernel.size_symbols_sorted()))
    ops = [op for sub in subs for op in sub.read_writes.op_names]
    return _base_name(ops), spec


def _generate(subs: Sequence[SchedulerNode], xsizes: list[Expr], rnumel: Expr, removed: set[str],
              mode: str, plan: ColumnPlan | None) -> tuple[CppKernel, IndentedBuffer]:
    has_red = any(sub.is_reduction() for sub in subs)
    kernel = CppKernel(xsizes, rnumel, removed, mode, plan)
    with V.set_ops_handler(kernel), V.set_kernel_handler(kernel):
        for sub in subs:
            _codegen_subnode(kernel, sub, has_red)
        return kernel, kernel.render_body()


def _column_plan(subs: Sequence[SchedulerNode], xsizes: list[Expr], mode: str
                 ) -> ColumnPlan | None:
    red = next(sub for sub in subs if sub.is_reduction())
    ranges, rranges = _sizes(red)
    return plan_columns(red, [int(s) for s in ranges], [int(s) for s in rranges],
                        [int(s) for s in xsizes], mode)


def _scheduler_node(sub: BaseSchedulerNode) -> SchedulerNode:
    assert isinstance(sub, SchedulerNode) and isinstance(sub.node, ComputedBuffer)
    return sub


def _base_name(ops: Sequence[str]) -> str:
    unique = sorted(dict.fromkeys(o for o in ops if o.isidentifier()))
    return f"cpp_fused_{'_'.join(unique[:6]) or 'copy'}"


def _parallel_mode(xnumel: int, rnumel: int, has_red: bool) -> str:
    if xnumel * max(rnumel, 1) < PARALLEL_MIN_WORK:
        return "serial"
    if has_red and xnumel < SPLIT_R_MAX_ROWS:
        return "r"
    return "x"


def _sizes(sub: SchedulerNode) -> tuple[list[Expr], list[Expr]]:
    buf = sub.node
    assert isinstance(buf, ComputedBuffer)
    return ([sympy.sympify(s) for s in buf.data.get_size()],
            [sympy.sympify(s) for s in buf.data.get_reduction_size()])


def _variables(n: int) -> list[sympy.Symbol]:
    # The names extract_read_writes gives, so that access expressions use them too.
    return [sympy.Symbol(f"c{i}", integer=True, nonnegative=True) for i in range(n)]


def _choose_xsizes(subs: Sequence[SchedulerNode], xnumel: Expr, has_red: bool) -> list[Expr]:
    """The x loop nest: the merged loops of the node whose accesses merge least."""
    best: list[Expr] | None = None
    for sub in subs:
        if has_red and not sub.is_reduction():
            continue
        ranges, _ = _sizes(sub)
        if not V.graph.sizevars.statically_known_equals(prod(ranges), xnumel):
            continue
        merged, _, _ = merge_loops(ranges, _access_exprs(sub), _variables(len(ranges)))
        sizes = [sympy.sympify(s) for s in merged]
        if best is None or len(sizes) > len(best):
            best = sizes
    if best is None:
        best = [xnumel] if xnumel != 1 else []
    return best


def _codegen_subnode(kernel: CppKernel, sub: SchedulerNode, has_red: bool) -> None:
    buf = sub.node
    assert isinstance(buf, ComputedBuffer)
    ranges, rranges = _sizes(sub)
    is_red = sub.is_reduction()
    in_phase = is_red or (has_red and not V.graph.sizevars.statically_known_equals(
        prod(ranges), prod(kernel.xsizes)))
    _place_in_phase(kernel, sub, in_phase)
    variables = _variables(len(ranges) + len(rranges))
    exprs = _access_exprs(sub)
    xvars = [xvar(i) for i in range(len(kernel.xsizes))]
    if is_red:
        mapping = _map_onto(ranges, variables[: len(ranges)], exprs, xvars, kernel.xsizes)
        mapping.update(_map_onto(rranges, variables[len(ranges):], exprs, [RINDEX],
                                 [kernel.rnumel]))
    elif in_phase:
        mapping = _mapunflatten_index(ranges, variables, exprs, kernel, xvars)
    else:
        mapping = _map_onto(ranges, variables, exprs, xvars, kernel.xsizes)
    kernel.set_index_map(mapping)
    body = buf.store_body()
    if is_red:
        body(variables[: len(ranges)], variables[len(ranges):])
        assert kernel.phase is not None
        kernel.phase.reductions.add(buf.get_name())
    else:
        body(variables)


def _place_in_phase(kernel: CppKernel, sub: SchedulerNode, in_phase: bool) -> None:
    """x-level work runs between phases; a node that needs a reduction finished in the
    current phase starts the next one."""
    if not in_phase:
        kernel.end_phase()
        return
    if kernel.phase is not None and sub.read_writes.read_names() & kernel.phase.reductions:
        kernel.end_phase()
    if kernel.phase is None:
        kernel.begin_phase()


def _access_exprs(sub: SchedulerNode) -> list[Expr]:
    rw = sub.read_writes
    exprs = [d.index for d in rw.reads | rw.writes if isinstance(d, MemoryDep)]
    return exprs + list(rw.index_exprs)


def _flat(kvars: Sequence[sympy.Symbol], ksizes: Sequence[Expr]) -> Expr:
    flat: Expr = sympy.Integer(0)
    stride: Expr = sympy.Integer(1)
    for var, size in zip(reversed(kvars), reversed(ksizes)):
        flat = flat + var * stride
        stride *= size
    return flat


def _map_onto(sizes: Sequence[Expr], variables: Sequence[sympy.Symbol], exprs: list[Expr],
              kvars: Sequence[sympy.Symbol], ksizes: Sequence[Expr]
              ) -> dict[sympy.Symbol, Expr]:
    """Express a node's loop variables in the kernel's loop variables ``kvars``."""
    if not sizes:
        return {}
    new_sizes, subs, new_vars = merge_loops([sympy.sympify(s) for s in sizes], exprs,
                                            variables)
    linear = linear_substitution(subs)
    equals = V.graph.sizevars.statically_known_equals
    if len(new_sizes) == len(ksizes) and all(equals(a, b) for a, b in zip(new_sizes, ksizes)):
        target: dict[sympy.Symbol, Expr] = dict(zip(new_vars, kvars))
    else:
        target = dict(zip(new_vars, unflatten_index(_flat(kvars, ksizes), new_sizes)))
    return {v: sympy.expand(linear[v]).xreplace(target) for v in variables}


def _mapunflatten_index(ranges: Sequence[Expr], variables: Sequence[sympy.Symbol],
                        exprs: list[Expr], kernel: CppKernel, xvars: Sequence[sympy.Symbol]
                        ) -> dict[sympy.Symbol, Expr]:
    """A pointwise node inside a reduction loop: its loops split into x and r parts."""
    xnumel = prod(kernel.xsizes)
    equals = V.graph.sizevars.statically_known_equals
    for k in range(len(ranges) + 1):
        if equals(prod(ranges[:k]), xnumel) and equals(prod(ranges[k:]), kernel.rnumel):
            mapping = _map_onto(ranges[:k], variables[:k], exprs, xvars, kernel.xsizes)
            mapping.update(_map_onto(ranges[k:], variables[k:], exprs, [RINDEX],
                                     [kernel.rnumel]))
            return mapping
    flat = _flat(xvars, kernel.xsizes) * kernel.rnumel + RINDEX
    return dict(zip(variables, unflatten_index(flat, list(ranges))))


def _signature(kernel: CppKernel) -> dict[str, str]:
    sig = {}
    for arg, buf in kernel.args.call_args():
        const = "const " if arg.startswith("in_ptr") else ""
        sig[arg] = f"{const}{storage_type(V.graph.get_dtype(buf))}*"
    for sym in kernel.size_symbols_sorted():  # sizes of a graph with dynamic shapes
        sig[sym.name] = "const int64_t"
    return sig


def render(kernel: CppKernel, body: IndentedBuffer, has_red: bool) -> str:
    """The kernel's translation unit: the prelude, then one ``extern "C"`` function."""
    params = [f"{ct} {arg}" for arg, ct in _signature(kernel).items()]
    code = IndentedBuffer()
    code.writeline(f'#include "{PRELUDE_NAME}"')
    code.writeline("")
    code.writeline(f'extern "C" void {NAME_PLACEHOLDER}(')
    with code.indent():
        code.writelines([p + ("," if i + 1 < len(params) else ")") for i, p in enumerate(params)])
    if not params:
        code.writeline(")")
    code.writeline("{")
    with code.indent():
        if has_red:
            _reduction_loops(kernel, body, code)
        else:
            _pointwise_loops(kernel, body, code)
    code.writeline("}")
    return code.getvalue()


def _loop(code: IndentedBuffer, i: int, size: Expr) -> None:
    code.writeline(f"for (int64_t x{i} = 0; x{i} < {CppIndexPrinter().print(size)}; ++x{i})")


def _collapse(n: int) -> str:
    return f" collapse({n})" if n > 1 else ""


def _pointwise_loops(kernel: CppKernel, body: IndentedBuffer, code: IndentedBuffer) -> None:
    """Outer loops across threads (when there is enough work), the inner one vectorized."""
    sizes = kernel.xsizes
    if not sizes:
        _braced(body, code)
        return
    outer = sizes[:-1]
    parallel = kernel.mode != "serial"
    outer_parallel = parallel and V.graph.sizevars.size_hint(prod(outer)) >= PARALLEL_MIN_OUTER
    if outer_parallel:
        code.writeline(f"#pragma omp parallel for{_collapse(len(outer))} schedule(static)")
    for i, size in enumerate(outer):
        _loop(code, i, size)
    simd = "" if kernel.atomics else " simd"  # atomic updates may collide across lanes
    if parallel and not outer_parallel:
        code.writeline(f"#pragma omp parallel for{simd} schedule(static)")
    elif simd:
        code.writeline("#pragma omp simd")
    _loop(code, len(outer), sizes[-1])
    _braced(body, code)


def _reduction_loops(kernel: CppKernel, body: IndentedBuffer, code: IndentedBuffer) -> None:
    """Rows across threads (mode "x"), or rows in turn with each phase split (mode "r")."""
    if kernel.columns is not None:
        _column_loops(kernel, body, code)
        return
    if kernel.mode == "x" and kernel.xsizes:
        code.writeline(f"#pragma omp parallel for{_collapse(len(kernel.xsizes))} "
                       "schedule(static)")
    for i, size in enumerate(kernel.xsizes):
        _loop(code, i, size)
    _braced(body, code)


def _column_loops(kernel: CppKernel, body: IndentedBuffer, code: IndentedBuffer) -> None:
    """Outer x loops and blocks of columns across threads, unless rows are split."""
    outer = kernel.xsizes[:-1]
    if kernel.mode == "x" and not kernel.columns.split_rows:
        code.writeline(f"#pragma omp parallel for{_collapse(len(outer) + 1)} schedule(static)")
    for i, size in enumerate(outer):
        _loop(code, i, size)
    code.writeline(f"for (int64_t xb = 0; xb < {kernel.xsizes[-1]}; "
                   f"xb += {kernel.columns.width})")
    _braced(body, code)


def _braced(body: IndentedBuffer, code: IndentedBuffer) -> None:
    code.writeline("{")
    with code.indent():
        code.splice(body)
    code.writeline("}")
