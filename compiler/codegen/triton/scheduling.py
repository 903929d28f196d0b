"""Turn one (fused) scheduler node into a Triton kernel source."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import sympy

from ...dependencies import MemoryDep
from ...errors import KilnCompileError
from ...ir.nodes import ComputedBuffer, Scatter
from ...ir.sym import Expr, prod, unflatten_index
from ...kernel_compile import ALIGN_KEY
from ...scheduler import BaseSchedulerNode, RowColumnSchedulerNode, SchedulerNode
from ...virtualized import V
from ..common import IndentedBuffer, linear_substitution, merge_loops
from ..kernel_spec import KernelSpec
from ..simd import is_outer_reduction
from .heuristics import PERSISTENT_RNUMEL, configs_for
from .kernel import RINDEX, XINDEX, TritonKernel
from .overrides import SIGNATURE_DTYPES
from .row_column import PID, render_frame, row_column_configs, row_itemsize

HEADER = """import triton
import triton.language as tl
from triton.language.extra import libdevice

from kiln.compiler.runtime import triton_helpers as th
"""

KIND_PREFIX = {"pointwise": "poi", "persistent_reduction": "per", "reduction": "red",
               "row_column": "per"}
NAME_PLACEHOLDER = "KERNEL_NAME"


class UnforwardedBuffers(Exception):
    def __init__(self, names: set[str]) -> None:
        super().__init__(f"buffers read back in the same kernel: {sorted(names)}")
        self.names = names


def kernel_kind(rnumel: Expr | int, outer: bool = False) -> str:
    """Pointwise, persistent (a row in one block) or looped reduction. With a symbolic
    ``rnumel`` a row fits one block only if every admitted size provably fits."""
    if rnumel == 1:
        return "pointwise"
    if outer:  # a strided reduction loops over short r blocks, wide in x
        return "reduction"
    fits = V.graph.sizevars.statically_known_leq(rnumel, PERSISTENT_RNUMEL)
    return "persistent_reduction" if fits else "reduction"


# A reduction over a symbolic row also gets persistent variants for rows up to these
# lengths; the wrapper picks one at run time from the row's length (a guarded choice).
# Powers of two, so that a power-of-two row (a sequence length of 512 or 2048) fills its
# block: a block twice the row masks off half the lanes (the H200 profile of the
# decoder's softmax at 2048 tokens ran RBLOCK 4096).
PERSISTENT_BUCKETS = (256, 512, 1024, 2048, PERSISTENT_RNUMEL)


def persistent_variants(node: BaseSchedulerNode, removed: set[str]
                        ) -> list[tuple[int, tuple[str, KernelSpec]]]:
    """(row bound, kernel) for each persistent variant of a looped reduction over a
    symbolic row (none for static rows, outer reductions or bounded symbolic rows)."""
    _, rnumel = (sympy.sympify(v) for v in node.group)
    if rnumel.is_Integer or is_outer_reduction(node) or \
            kernel_kind(rnumel) != "reduction":
        return []
    return [(bound, codegen_triton(node, removed, rbound=bound))
            for bound in PERSISTENT_BUCKETS]


def codegen_triton(node: BaseSchedulerNode, removed: set[str], rbound: int | None = None
                   ) -> tuple[str, KernelSpec]:
    """Source (named ``KERNEL_NAME``) and spec of the kernel for ``node``.

    Buffers in ``removed`` are kept in registers; if one cannot be (it is read in a later
    loop phase), ``UnforwardedBuffers`` names it and the caller retries with it stored.
    ``rbound``: a persistent kernel for rows of at most that many elements (the caller
    launches it only for such rows).
    """
    xnumel, rnumel = (sympy.sympify(v) for v in node.group)
    parts = node.parts if isinstance(node, RowColumnSchedulerNode) else 0
    outer = rnumel != 1 and not parts and is_outer_reduction(node)
    kind = kernel_kind(rnumel, outer) if rbound is None else "persistent_reduction"
    kind = "row_column" if parts else kind
    index_dtype = "tl.int64" if _needs_int64(node) else "tl.int32"
    sizevars = V.graph.sizevars
    rhint = (rbound or sizevars.upper_bound(rnumel)) if kind != "pointwise" and \
        kind != "reduction" else None
    xhint, rhint = sizevars.size_hint(xnumel), rhint or sizevars.size_hint(rnumel)
    rows = xhint // parts if parts else 0
    configs = tuple(row_column_configs(rhint, rows, row_itemsize(node, xhint * rhint))
                    if parts
                    else configs_for(kind, xhint, rhint, outer))
    kernel = TritonKernel(kind, xnumel, rnumel, removed, index_dtype,
                          max(int(c.get("XBLOCK", 1)) for c in configs), outer, parts)
    order = memory_order(node, removed) if kind == "pointwise" else None
    columns = node.column_names if isinstance(node, RowColumnSchedulerNode) else set()
    with V.set_ops_handler(kernel), V.set_kernel_handler(kernel):
        for sub in node.get_nodes():
            assert isinstance(sub, SchedulerNode) and isinstance(sub.node, ComputedBuffer)
            if sub.get_name() in columns:
                codegen_column_subnode(kernel, sub, rows)
            else:
                _codegen_subnode(kernel, sub, order)
        kernel.end_loop()
    lost = kernel.unforwarded & removed
    if lost:
        raise UnforwardedBuffers(lost)
    ops = [op for sub in node.get_nodes() for op in sub.read_writes.op_names]
    source = render(kernel, rows)
    if rbound is not None:  # the same body as other buckets: named apart by its bound
        source = source.replace("@triton.jit", f"# rows of at most {rbound}\n@triton.jit", 1)
    spec = KernelSpec(
        name=NAME_PLACEHOLDER, backend="triton", kind=kind, source=source,
        arg_buffers=tuple(buf for _, buf in kernel.args.call_args()),
        signature=_signature(kernel), xnumel=xhint, rnumel=rhint,
        configs=_with_alignment(kernel, configs),
        size_args=kernel.size_args(), programs=parts)
    return _base_name(kind, ops), spec


def _with_alignment(kernel: TritonKernel, configs: tuple[dict[str, Any], ...]
                    ) -> tuple[dict[str, Any], ...]:
    """A kernel with symbolic size arguments whose hints are all multiples of 16 compiles
    its ``ALIGN`` variant (``kernel_compile.divisible_args``); the launcher falls back to
    the generic one for a launch whose sizes are not."""
    exprs = [sympy.sympify(kernel.xnumel), sympy.sympify(kernel.rnumel),
             *kernel.size_symbols]
    symbolic = [e for e in exprs if e.free_symbols]
    if not kernel.dynamic or not symbolic or any(
            V.graph.sizevars.size_hint(e) % 16 for e in symbolic):
        return configs
    return tuple({**c, ALIGN_KEY: 16} for c in configs)


def _base_name(kind: str, ops: Sequence[str]) -> str:
    unique = sorted(dict.fromkeys(o for o in ops if o.isidentifier()))
    return f"triton_{KIND_PREFIX[kind]}_fused_{'_'.join(unique[:6]) or 'copy'}"


def _needs_int64(node: BaseSchedulerNode) -> bool:
    """64-bit indices unless every size the graph admits provably fits in 32 bits."""
    fits = V.graph.sizevars.statically_known_leq
    limit = 2**31 - 1
    for sub in node.get_nodes():
        for name in sub.used_buffer_names():
            try:
                buf = V.graph.get_buffer(name)
                if not fits(buf.get_layout().storage_size(), limit):
                    return True
            except (KeyError, AssertionError):
                continue
    xnumel, rnumel = node.group
    return not fits(xnumel * rnumel, limit)


def memory_order(node: BaseSchedulerNode, removed: set[str]) -> list[int] | None:
    """The loop order of a pointwise kernel: that of the memory it writes (outermost
    stride first), so a channels-last output is walked channels-last. All nodes share it,
    which needs them to have the same loops."""
    subs = [s for s in node.get_nodes() if isinstance(s, SchedulerNode)]
    ranges = {tuple(sympy.expand(r) for r in s.get_ranges()[0]) for s in subs}
    if len(ranges) != 1 or len(next(iter(ranges))) < 2:
        return None
    # A scatter's loops are its source's, not its target's: they give no order.
    subs = [s for s in subs if not isinstance(getattr(s.node, "data", None), Scatter)]
    stored = [s for s in subs if s.get_name() not in removed] or subs
    if not stored:
        return None
    # Loop order changes speed, never results: decided at the size hints.
    stride = V.graph.sizevars.size_hints(stored[-1].node.get_layout().stride)
    size = next(iter(ranges))
    order = sorted(range(len(size)), key=lambda d: (-stride[d] if size[d] != 1 else 0, d))
    return order if order != sorted(order) else None


def _codegen_subnode(kernel: TritonKernel, sub: SchedulerNode,
                     order: list[int] | None = None) -> None:
    buf = sub.node
    assert isinstance(buf, ComputedBuffer)
    ranges = [sympy.sympify(s) for s in buf.data.get_size()]
    rranges = [sympy.sympify(s) for s in buf.data.get_reduction_size()]
    is_red = bool(rranges)
    x_only = not is_red and kernel.rnumel != 1 and \
        V.graph.sizevars.statically_known_equals(prod(ranges), kernel.xnumel)
    _place_in_phase(kernel, sub, is_red, x_only)
    variables = [sympy.Symbol(f"c{i}", integer=True, nonnegative=True)
                 for i in range(len(ranges) + len(rranges))]
    exprs = _access_exprs(sub)
    if is_red:
        mapping = _map_loops(ranges, variables[: len(ranges)], exprs, XINDEX)
        mapping.update(_map_loops(rranges, variables[len(ranges):], exprs, RINDEX))
    elif x_only or kernel.rnumel == 1:
        perm = order or list(range(len(ranges)))
        mapping = _map_loops([ranges[d] for d in perm], [variables[d] for d in perm], exprs,
                             XINDEX)
    else:
        mapping = _map_split(ranges, variables, exprs, kernel.xnumel, kernel.rnumel)
    kernel.set_index_map(mapping, uses_r=not x_only and kernel.rnumel != 1)
    body = buf.store_body()
    if is_red:
        body(variables[: len(ranges)], variables[len(ranges):])
        if kernel.looped:
            kernel.phase_reductions.add(buf.get_name())
    else:
        body(variables)


def codegen_column_subnode(kernel: TritonKernel, sub: SchedulerNode, rows: int) -> None:
    """A column stage's body in the row loop: its part is ``pid``, its columns
    ``rindex``, its reduced row ``xindex - pid * rows``; its reduction accumulates across
    the loop (``TritonKernel.column``)."""
    buf = sub.node
    assert isinstance(buf, ComputedBuffer)
    ranges = [sympy.sympify(s) for s in buf.data.get_size()]
    variables = [sympy.Symbol(f"c{i}", integer=True, nonnegative=True)
                 for i in range(len(ranges) + 1)]
    part, columns, row = variables[0], variables[1:len(ranges)], variables[len(ranges)]
    mapping = _map_loops(ranges[1:], columns, _access_exprs(sub), RINDEX)
    mapping[part] = PID
    mapping[row] = XINDEX - rows * PID
    kernel.set_index_map(mapping, uses_r=True)
    kernel.column = True
    try:
        buf.store_body()(variables[:len(ranges)], variables[len(ranges):])
    finally:
        kernel.column = False


def _place_in_phase(kernel: TritonKernel, sub: SchedulerNode, is_red: bool,
                    x_only: bool) -> None:
    """Looped reductions: x-only work runs between loops; loop work that needs a
    reduction finished in the current loop starts the next loop."""
    if not kernel.looped:
        return
    if x_only:
        kernel.end_loop()
        return
    reads = sub.read_writes.read_names()
    if kernel.in_loop and reads & kernel.phase_reductions:
        kernel.end_loop()
    if not kernel.in_loop:
        kernel.begin_loop()


def _access_exprs(sub: SchedulerNode) -> list[Expr]:
    rw = sub.read_writes
    exprs = [d.index for d in rw.reads | rw.writes if isinstance(d, MemoryDep)]
    return exprs + list(rw.index_exprs)


def _map_loops(sizes: Sequence[Expr], variables: Sequence[sympy.Symbol], exprs: list[Expr],
               base: sympy.Symbol) -> dict[sympy.Symbol, Expr]:
    """Map a node's loops onto ``base`` (xindex or rindex), merging contiguous loops."""
    if not sizes:
        return {}
    new_sizes, subs, new_vars = merge_loops(sizes, exprs, variables)
    linear = linear_substitution(subs)
    kernel_exprs = dict(zip(new_vars, unflatten_index(base, new_sizes)))
    return {v: sympy.expand(linear[v]).xreplace(kernel_exprs) for v in variables}


def _map_split(ranges: Sequence[Expr], variables: Sequence[sympy.Symbol], exprs: list[Expr],
               xnumel: Expr, rnumel: Expr) -> dict[sympy.Symbol, Expr]:
    """A pointwise node inside a reduction kernel: its loops split into x and r parts."""
    equals = V.graph.sizevars.statically_known_equals
    for k in range(len(ranges) + 1):
        if equals(prod(ranges[:k]), xnumel) and equals(prod(ranges[k:]), rnumel):
            mapping = _map_loops(ranges[:k], variables[:k], exprs, XINDEX)
            mapping.update(_map_loops(ranges[k:], variables[k:], exprs, RINDEX))
            return mapping
    flat = XINDEX * rnumel + RINDEX
    return dict(zip(variables, unflatten_index(flat, ranges)))


def _signature(kernel: TritonKernel) -> dict[str, str]:
    sig = {}
    for arg, buf in kernel.args.call_args():
        dtype = V.graph.get_dtype(buf)
        if dtype not in SIGNATURE_DTYPES:  # complex values should be per-op fallbacks
            raise NotImplementedError(
                f"a Triton kernel would take buffer {buf} of dtype {dtype} (argument {arg}), "
                f"a type Triton does not have; the ops making or reading it should have been "
                f"per-op fallbacks")
        sig[arg] = "*" + SIGNATURE_DTYPES[dtype]
    for name in kernel.size_params():
        sig[name] = "i64"
    sig["XBLOCK"] = "constexpr"
    if kernel.is_reduction:
        sig["RBLOCK"] = "constexpr"
    return sig


def render(kernel: TritonKernel, rows: int = 0) -> str:
    """The kernel's module source: imports, then the ``@triton.jit`` function (a
    row-column kernel: ``rows`` per program)."""
    args = [arg for arg, _ in kernel.args.call_args()] + kernel.size_params()
    args.append("XBLOCK: tl.constexpr")
    if kernel.is_reduction:
        args.append("RBLOCK: tl.constexpr")
    code = IndentedBuffer()
    code.writeline("@triton.jit")
    code.writeline(f"def {NAME_PLACEHOLDER}({', '.join(args)}):")
    with code.indent():
        if kernel.parts:
            render_frame(kernel, rows, code)
            return HEADER + "\n\n" + code.getvalue()
        if not kernel.dynamic:  # a dynamic kernel takes xnumel and rnumel as arguments
            code.writeline(f"xnumel = {kernel.xnumel}")
        pid = "tl.program_id(0)"
        if kernel.index_dtype == "tl.int64":
            pid += ".to(tl.int64)"
        code.writeline(f"xoffset = {pid} * XBLOCK")
        if kernel.is_reduction:
            if not kernel.dynamic:
                code.writeline(f"rnumel = {kernel.rnumel}")
            code.writeline("xindex = xoffset + tl.arange(0, XBLOCK)[:, None]")
            code.writeline("xmask = xindex < xnumel")
            if kernel.looped:
                code.writeline("rbase = tl.arange(0, RBLOCK)[None, :]")
            else:
                code.writeline("rindex = tl.arange(0, RBLOCK)[None, :]")
                code.writeline("rmask = rindex < rnumel")
        else:
            code.writeline("xindex = xoffset + tl.arange(0, XBLOCK)[:]")
            code.writeline("xmask = xindex < xnumel")
        code.splice(kernel.body)
    return HEADER + "\n\n" + code.getvalue()


def check_kernel_name(name: str) -> str:
    if not name.isidentifier():
        raise KilnCompileError(f"bad kernel name {name!r}", stage="codegen")
    return name


