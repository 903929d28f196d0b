"""The Triton GEMM template (``triton_tem_`` kernels): a tiled ``tl.dot`` main loop, and
the pointwise epilogue nodes fused into its store.

One program computes a ``BLOCK_M x BLOCK_N`` tile of ``out[tb]`` (tiles in groups of
``GROUP_M`` rows, so neighbouring programs share the tiles of ``a`` they read). The
fp32 accumulator ``acc`` is the template buffer's value: it is stored (rounded to the
buffer's dtype) only if something outside the kernel reads it; fused epilogue nodes
read it in registers, their loops mapped onto the tile's row and column indices
``tm`` / ``tn`` (or the tile's flat output index ``xindex``).

A template's source is made for one tile config (bounds checks and alignment hints
depend on whether the tile divides the problem), so the kernel's spec carries exactly
that config; the choice among configs is ``compiler.select_algorithm``'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import sympy
import torch

from ...errors import KilnCompileError
from ...ir.nodes import Buffer, ComputedBuffer, ReinterpretView
from ...ir.sym import Expr
from ...ir.template import GemmProblem, GemmTemplateBuffer, dtype_from_name
from ...scheduler import BaseSchedulerNode, SchedulerNode
from ...virtualized import V
from ..common import CSEVariable, IndentedBuffer, next_power_of_2
from ..kernel_spec import KernelSpec
from .kernel import XINDEX, TritonKernel
from .overrides import SIGNATURE_DTYPES, triton_type
from .scheduling import HEADER, NAME_PLACEHOLDER, UnforwardedBuffers, _access_exprs, _map_loops

TEMPLATE_CONSTEXPRS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")
TB = sympy.Symbol("tb", integer=True, nonnegative=True)
TM = sympy.Symbol("tm", integer=True, nonnegative=True)
TN = sympy.Symbol("tn", integer=True, nonnegative=True)

# (BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps): 16-bit inputs, then fp32. The first
# is the heuristic pick; the rest are what max-autotune measures.
_HALF_CONFIGS = ((128, 128, 64, 3, 4), (128, 256, 64, 3, 8), (256, 128, 64, 3, 8),
                 (128, 128, 64, 4, 8), (64, 256, 64, 4, 4), (128, 64, 64, 4, 4),
                 (64, 128, 64, 4, 4), (128, 256, 64, 4, 8), (64, 64, 64, 3, 4),
                 (128, 128, 32, 4, 4))
_FP32_CONFIGS = ((128, 128, 32, 3, 8), (128, 64, 32, 3, 4), (64, 128, 32, 3, 4),
                 (64, 64, 32, 4, 4), (128, 128, 16, 4, 8), (64, 64, 16, 2, 4))
# The same tiles fed by TMA (Hopper's tensor memory accelerator: descriptor loads, bounds
# handled by the hardware), where both operands allow it.
_TMA_CONFIGS = ((128, 256, 64, 3, 8), (128, 128, 64, 4, 4), (256, 128, 64, 3, 8))
# Persistent TMA kernels: one program per SM walks the tiles, so one tile's epilogue runs
# while the next tile's loads are in flight. 132 SMs: the H100 SXM / H200 (a GPU with
# fewer runs more programs than SMs, still correct).
_PERSISTENT_CONFIGS = ((128, 256, 64, 3, 8), (128, 128, 64, 4, 8))
NUM_SMS = 132
MIN_BLOCK = 16
GROUP_M = 8
# Shared memory one program may use, by GPU arch (bytes; the opt-in maximum per block).
SHARED_MEMORY_BYTES = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448,
                       100: 232448, 120: 101376}


def gemm_configs(problem: GemmProblem, target: dict[str, Any] | None = None
                 ) -> list[dict[str, Any]]:
    """Distinct tile configs for ``problem``, blocks clipped to its sizes; on a ``target``
    of known shared memory, only those whose tiles fit in it (a config that does not fit
    fails to launch: compiling and benchmarking it is wasted time)."""
    limit = SHARED_MEMORY_BYTES.get(int((target or {}).get("arch", -1)))
    return [cfg for cfg in _all_configs(problem)
            if limit is None or shared_memory_estimate(problem, cfg) <= limit]


def shared_memory_estimate(problem: GemmProblem, config: dict[str, Any]) -> int:
    """Bytes of shared memory a config needs, as Triton lays it out on Hopper (checked
    against the cubins' figures in tests/unit/test_gemm_selection.py): ``num_stages``
    tiles of ``a`` and ``b`` for the tensor-core (wgmma) path, one fewer for an fp32
    product in IEEE precision; a persistent kernel also stages its epilogue (32 KiB);
    1 KiB for barriers."""
    bm, bn, bk = config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    a_item = dtype_from_name(problem.a_dtype).itemsize
    b_item = dtype_from_name(problem.b_dtype).itemsize
    stages = int(config["num_stages"])
    if problem.dtype == "float32" and not problem.allow_tf32:
        stages = max(1, stages - 1)
    epilogue = 32 * 1024 if config.get("NUM_SMS") else 0
    return stages * (bm * bk * a_item + bk * bn * b_item) + epilogue + 1024


def _all_configs(problem: GemmProblem) -> list[dict[str, Any]]:
    table = _FP32_CONFIGS if problem.dtype == "float32" else _HALF_CONFIGS
    out: list[dict[str, Any]] = []
    for bm, bn, bk, stages, warps in table:
        cfg = {"BLOCK_M": _clip(bm, problem.m), "BLOCK_N": _clip(bn, problem.n),
               "BLOCK_K": _clip(bk, problem.k), "GROUP_M": GROUP_M,
               "num_warps": warps, "num_stages": stages}
        small = cfg["BLOCK_M"] * cfg["BLOCK_N"] < bm * bn
        if small:  # a clipped tile needs fewer warps
            cfg["num_warps"] = max(1, min(warps, cfg["BLOCK_M"] * cfg["BLOCK_N"] // 1024))
        if cfg not in out:
            out.append(cfg)
    if tma_possible(problem):
        flags = [(t, {"TMA": 1}) for t in _TMA_CONFIGS] + [
            (t, {"TMA": 1, "NUM_SMS": NUM_SMS}) for t in _PERSISTENT_CONFIGS]
        for (bm, bn, bk, stages, warps), flag in flags:
            cfg = {"BLOCK_M": _clip(bm, problem.m), "BLOCK_N": _clip(bn, problem.n),
                   "BLOCK_K": _clip(bk, problem.k), "GROUP_M": GROUP_M,
                   "num_warps": warps, "num_stages": stages, **flag}
            if cfg not in out:
                out.append(cfg)
    return out


def tma_possible(problem: GemmProblem) -> bool:
    """TMA descriptors: 16-bit operands of one dtype, one unit stride each, the other
    stride 16-byte aligned, and a problem large enough to be worth it."""
    p = problem
    if p.batch != 1 or p.dtype not in ("float16", "bfloat16") or \
            not p.a_dtype == p.b_dtype == p.dtype or min(p.m, p.n, p.k) < 64:
        return False
    return _tma_layout(p.a_stride[1], p.a_stride[2]) is not None and \
        _tma_layout(p.b_stride[1], p.b_stride[2]) is not None


def _tma_layout(rows: int, cols: int) -> str | None:
    """"row" (contiguous along the second dimension) or "col", if TMA can read it."""
    if cols == 1 and rows % 8 == 0:
        return "row"
    if rows == 1 and cols % 8 == 0:
        return "col"
    return None


def _clip(block: int, size: int) -> int:
    return max(MIN_BLOCK, min(block, next_power_of_2(size)))


class TemplateKernel(TritonKernel):
    """A pointwise kernel frame around a GEMM tile: ``xindex`` / ``xmask`` are 2-D."""

    def __init__(self, problem: GemmProblem, removed: set[str], index_dtype: str) -> None:
        numel = problem.batch * problem.m * problem.n
        super().__init__("pointwise", numel, 1, removed, index_dtype)
        self.problem = problem
        self.var_ranges.update({TB: sympy.Integer(problem.batch), TM: sympy.Integer(problem.m),
                                TN: sympy.Integer(problem.n)})

    def tile_symbols(self) -> list[sympy.Symbol]:
        return [TB, TM, TN] if self.problem.op == "bmm" else [TM, TN]

    def store_template_output(self, buf: GemmTemplateBuffer) -> None:
        """``acc`` is the buffer's value at the tile's elements: remember it for the
        epilogue (under both ways an epilogue addresses it) and store it if needed."""
        p = self.problem
        index = TB * p.m * p.n + TM * p.n + TN if p.op == "bmm" else TM * p.n + TN
        acc = CSEVariable("acc", torch.float32)
        self._store_to(self.body, buf.get_name(), index, acc, "xmask")
        self.stored[(buf.get_name(), "xindex")] = acc


def codegen_template(node: BaseSchedulerNode, removed: set[str]) -> tuple[str, KernelSpec]:
    """Source and spec of a template node and the epilogue nodes fused into it."""
    from .scheduling import _needs_int64

    subs = list(node.get_nodes())
    head = subs[0]
    assert isinstance(head, SchedulerNode) and isinstance(head.node, GemmTemplateBuffer)
    tem = head.node
    problem = tem.get_problem()
    index_dtype = "tl.int64" if _needs_int64(node) else "tl.int32"
    kernel = TemplateKernel(problem, removed, index_dtype)
    a, b = (_operand(kernel, x) for x in tem.inputs)
    with V.set_ops_handler(kernel), V.set_kernel_handler(kernel):
        kernel.store_template_output(tem)
        for sub in subs[1:]:
            assert isinstance(sub, SchedulerNode) and isinstance(sub.node, ComputedBuffer)
            _codegen_epilogue(kernel, sub)
    lost = kernel.unforwarded & removed
    if lost:
        raise UnforwardedBuffers(lost)
    if tem.get_name() in kernel.args.input_buffers:
        raise KilnCompileError(f"an epilogue reads template output {tem.get_name()} "
                               "outside its tile", stage="codegen")
    body = mainloop(problem, tem.config, a, b, index_dtype)
    source = _render(kernel.args.call_args(), body, kernel.body)
    ops = [op for sub in subs[1:] for op in sub.read_writes.op_names]
    signature = {arg: "*" + SIGNATURE_DTYPES[V.graph.get_dtype(buf)]
                 for arg, buf in kernel.args.call_args()}
    spec = _spec(problem, tem.config, source,
                 tuple(buf for _, buf in kernel.args.call_args()), signature)
    return _base_name(problem, ops), spec


def _base_name(problem: GemmProblem, ops: Sequence[str]) -> str:
    unique = sorted(dict.fromkeys(o for o in ops if o.isidentifier()))
    return "_".join(["triton_tem_fused", problem.op, *unique[:5]])


def _spec(problem: GemmProblem, config: dict[str, Any], source: str,
          arg_buffers: tuple[str, ...], signature: dict[str, str]) -> KernelSpec:
    signature = {**signature, **{k: "constexpr" for k in TEMPLATE_CONSTEXPRS}}
    numel = problem.batch * problem.m * problem.n
    return KernelSpec(name=NAME_PLACEHOLDER, backend="triton", kind="template", source=source,
                      arg_buffers=arg_buffers, signature=signature, xnumel=numel, rnumel=1,
                      configs=(dict(config),),
                      tile_shape=(problem.batch, problem.m, problem.n))


class _Operand:
    """How the main loop addresses one input: its pointer argument and storage offset."""

    def __init__(self, arg: str, offset: int) -> None:
        self.arg, self.offset = arg, offset


def _operand(kernel: TemplateKernel, x: Any) -> _Operand:
    assert isinstance(x, (Buffer, ReinterpretView))
    offset = int(x.layout.offset) if isinstance(x, ReinterpretView) else \
        int(x.get_layout().offset)
    return _Operand(kernel.args.input(x.get_name()), offset)


def _codegen_epilogue(kernel: TemplateKernel, sub: SchedulerNode) -> None:
    buf = sub.node
    assert isinstance(buf, ComputedBuffer)
    ranges = [sympy.Integer(int(s)) for s in buf.data.get_size()]
    variables = [sympy.Symbol(f"c{i}", integer=True, nonnegative=True)
                 for i in range(len(ranges))]
    mapping = _tile_mapping(kernel, ranges, variables)
    if mapping is None:  # another shape over the same elements: the flat output index
        mapping = _map_loops(ranges, variables, _access_exprs(sub), XINDEX)
    kernel.set_index_map(mapping, uses_r=False)
    buf.store_body()(variables)


def _tile_mapping(kernel: TemplateKernel, ranges: Sequence[Expr],
                  variables: Sequence[sympy.Symbol]) -> dict[sympy.Symbol, Expr] | None:
    """The node's loops as the tile's (batch,) row and column, where they are those."""
    p = kernel.problem
    tile = [(sym, n) for sym, n in zip(kernel.tile_symbols(), p.out_size()) if n != 1]
    loops = [(v, int(r)) for v, r in zip(variables, ranges) if int(r) != 1]
    if [n for _, n in tile] != [n for _, n in loops]:
        return None
    mapping: dict[sympy.Symbol, Expr] = {v: sympy.Integer(0) for v in variables}
    mapping.update({v: sym for (v, _), (sym, _) in zip(loops, tile)})
    return mapping


def mainloop(problem: GemmProblem, config: dict[str, Any], a: _Operand, b: _Operand,
             index_dtype: str) -> tuple[list[str], int]:
    """The tile's program: which tile, the ``tl.dot`` loop over K, the tile's indices;
    and the indentation the epilogue takes (inside the tile loop of a persistent kernel)."""
    tma = bool(config.get("TMA")) and a.offset % 8 == 0 and b.offset % 8 == 0
    if tma and config.get("NUM_SMS"):
        return _persistent(problem, int(config["NUM_SMS"]), a, b, index_dtype), 1
    return _tiled(problem, config, a, b, index_dtype, tma), 0


def _persistent(p: GemmProblem, num_sms: int, a: _Operand, b: _Operand,
                index_dtype: str) -> list[str]:
    start = "tl.program_id(0)" + (".to(tl.int64)" if index_dtype == "tl.int64" else "")
    loop = _tma_loop(p, a, b)
    body = ["first_m = (tile // width) * GROUP_M",
            "rows = tl.minimum(grid_m - first_m, GROUP_M)",
            "pid_m = first_m + (tile % width) % rows",
            "pid_n = (tile % width) // rows", *loop[2:],
            "rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
            "rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)", *_tile_indices(p)]
    return [f"M = {p.m}", f"N = {p.n}", f"K = {p.k}", f"start = {start}",
            "grid_m = (M + BLOCK_M - 1) // BLOCK_M", "grid_n = (N + BLOCK_N - 1) // BLOCK_N",
            "tiles = grid_m * grid_n", "width = GROUP_M * grid_n", "tb = 0", *loop[:2],
            f"for tile in tl.range(start, tiles, {num_sms}, flatten=True):",
            *("    " + line for line in body)]


def _tiled(problem: GemmProblem, config: dict[str, Any], a: _Operand, b: _Operand,
           index_dtype: str, tma: bool) -> list[str]:
    p, bm, bn, bk = problem, config["BLOCK_M"], config["BLOCK_N"], config["BLOCK_K"]
    pid = "tl.program_id(0)" + (".to(tl.int64)" if index_dtype == "tl.int64" else "")
    lines = [f"M = {p.m}", f"N = {p.n}", f"K = {p.k}", f"pid = {pid}",
             "grid_m = (M + BLOCK_M - 1) // BLOCK_M", "grid_n = (N + BLOCK_N - 1) // BLOCK_N",
             "tiles = grid_m * grid_n",
             "tb = pid // tiles" if p.op == "bmm" else "tb = 0",
             "tile = pid % tiles",
             "width = GROUP_M * grid_n",
             "first_m = (tile // width) * GROUP_M",
             "rows = tl.minimum(grid_m - first_m, GROUP_M)",
             "pid_m = first_m + (tile % width) % rows",
             "pid_n = (tile % width) // rows",
             "rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
             "rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
             # Rows and columns past the edge read row 0 / column 0; the store masks them.
             _wrapped("ram", "rm", "M", p.m % bm == 0, "BLOCK_M"),
             _wrapped("rbn", "rn", "N", p.n % bn == 0, "BLOCK_N"),
             "rk = tl.arange(0, BLOCK_K)"]
    if tma:
        return lines + _tma_loop(p, a, b) + _tile_indices(p)
    (sab, sam, sak), (sbb, sbk, sbn) = p.a_stride, p.b_stride
    lines += [f"a_ptrs = {a.arg} + ({a.offset} + tb * {sab} + ram[:, None] * {sam} "
              f"+ rk[None, :] * {sak})",
              f"b_ptrs = {b.arg} + ({b.offset} + tb * {sbb} + rk[:, None] * {sbk} "
              f"+ rbn[None, :] * {sbn})",
              "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
              "for k in range(0, K, BLOCK_K):"]
    even_k = p.k % bk == 0
    loop = [_load("a", "rk[None, :]", even_k), _load("b", "rk[:, None]", even_k)]
    compute = triton_type(dtype_from_name(p.dtype))
    loop += [f"{x} = {x}.to({compute})" for x, d in (("a", p.a_dtype), ("b", p.b_dtype))
             if d != p.dtype]
    loop += [f"acc += tl.dot(a, b{_precision(p)})",
             f"a_ptrs += BLOCK_K * {sak}", f"b_ptrs += BLOCK_K * {sbk}"]
    lines += ["    " + line for line in loop]
    return lines + _tile_indices(p)


def _tile_indices(p: GemmProblem) -> list[str]:
    flat = f"tb * {p.m * p.n} + tm * {p.n} + tn" if p.op == "bmm" else f"tm * {p.n} + tn"
    return ["tm = rm[:, None]", "tn = rn[None, :]", f"xindex = {flat}",
            "xmask = (tm < M) & (tn < N)"]


def _tma_loop(p: GemmProblem, a: _Operand, b: _Operand) -> list[str]:
    """The K loop over TMA descriptors (out-of-bounds blocks read as zeros)."""
    a_desc, a_load = _descriptor("a", a, "M", "K", p.a_stride, "BLOCK_M", "BLOCK_K",
                                 "pid_m * BLOCK_M", "k")
    b_desc, b_load = _descriptor("b", b, "K", "N", p.b_stride, "BLOCK_K", "BLOCK_N",
                                 "k", "pid_n * BLOCK_N")
    return [a_desc, b_desc, "acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
            "for k in range(0, K, BLOCK_K):", f"    a = {a_load}", f"    b = {b_load}",
            "    acc += tl.dot(a, b)"]


def _descriptor(x: str, op: _Operand, rows: str, cols: str, stride: tuple[int, int, int],
                block_r: str, block_c: str, at_r: str, at_c: str) -> tuple[str, str]:
    """A descriptor over ``x`` as stored (a column-major operand is read transposed)."""
    base = f"{op.arg} + {op.offset}" if op.offset else op.arg
    if _tma_layout(stride[1], stride[2]) == "row":
        desc = (f"{x}_desc = tl.make_tensor_descriptor({base}, shape=[{rows}, {cols}], "
                f"strides=[{stride[1]}, 1], block_shape=[{block_r}, {block_c}])")
        return desc, f"{x}_desc.load([{at_r}, {at_c}])"
    desc = (f"{x}_desc = tl.make_tensor_descriptor({base}, shape=[{cols}, {rows}], "
            f"strides=[{stride[2]}, 1], block_shape=[{block_c}, {block_r}])")
    return desc, f"{x}_desc.load([{at_c}, {at_r}]).T"


def _wrapped(name: str, rng: str, size: str, divides: bool, block: str) -> str:
    if divides:  # every tile lies inside: the indices are contiguous and aligned
        return f"{name} = tl.max_contiguous(tl.multiple_of({rng}, {block}), {block})"
    return f"{name} = {rng} % {size}"


def _load(x: str, k_index: str, even_k: bool) -> str:
    if even_k:
        return f"{x} = tl.load({x}_ptrs)"
    return f"{x} = tl.load({x}_ptrs, mask={k_index} < K - k, other=0.0)"


def _precision(p: GemmProblem) -> str:
    if p.dtype != "float32":
        return ""
    return ', input_precision="tf32"' if p.allow_tf32 else ', input_precision="ieee"'


def _render(call_args: list[tuple[str, str]], mainloop: tuple[list[str], int],
            epilogue: IndentedBuffer) -> str:
    params = [arg for arg, _ in call_args] + [f"{k}: tl.constexpr" for k in TEMPLATE_CONSTEXPRS]
    code = IndentedBuffer()
    code.writeline("@triton.jit")
    code.writeline(f"def {NAME_PLACEHOLDER}({', '.join(params)}):")
    lines, epilogue_indent = mainloop
    with code.indent():
        code.writelines(lines)
        with code.indent(epilogue_indent):
            code.splice(epilogue)
    return HEADER + "\n\n" + code.getvalue()


# ---------------------------------------------------------------------------------------
# A template alone (no graph): what max-autotune compiles and times for one config.


def standalone_spec(problem: GemmProblem, config: dict[str, Any], name: str) -> KernelSpec:
    """The template for ``problem`` with ``config``, storing its product and nothing else
    (arguments ``a``, ``b``, ``out``); named ``name``."""
    if not name.isidentifier():
        raise KilnCompileError(f"bad kernel name {name!r}", stage="codegen")
    index_dtype = "tl.int64" if _storage(problem)[2] > 2**31 - 1 else "tl.int32"
    body = mainloop(problem, config, _Operand("in_ptr0", 0), _Operand("in_ptr1", 0),
                    index_dtype)
    out_type = triton_type(problem.torch_dtype)
    store = IndentedBuffer()
    store.writeline(f"tl.store(out_ptr0 + (xindex), acc.to({out_type}), xmask)")
    args = [("in_ptr0", "a"), ("in_ptr1", "b"), ("out_ptr0", "out")]
    source = _render(args, body, store).replace(NAME_PLACEHOLDER, name)
    signature = {"in_ptr0": "*" + SIGNATURE_DTYPES[dtype_from_name(problem.a_dtype)],
                 "in_ptr1": "*" + SIGNATURE_DTYPES[dtype_from_name(problem.b_dtype)],
                 "out_ptr0": "*" + SIGNATURE_DTYPES[problem.torch_dtype]}
    spec = _spec(problem, config, source, ("a", "b", "out"), signature)
    sizes = _storage(problem)
    item = [dtype_from_name(d).itemsize for d in (problem.a_dtype, problem.b_dtype,
                                                   problem.dtype)]
    return dataclasses.replace(spec, name=name,
                               arg_bytes=tuple(n * i for n, i in zip(sizes, item)))


def _storage(problem: GemmProblem) -> tuple[int, int, int]:
    """Elements each of a, b and out spans (the furthest element plus one)."""
    p = problem
    a = (p.batch - 1) * p.a_stride[0] + (p.m - 1) * p.a_stride[1] + (p.k - 1) * p.a_stride[2]
    b = (p.batch - 1) * p.b_stride[0] + (p.k - 1) * p.b_stride[1] + (p.n - 1) * p.b_stride[2]
    return a + 1, b + 1, p.batch * p.m * p.n
