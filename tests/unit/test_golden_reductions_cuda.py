"""Golden code of layer-norm backward at the GPU bench's size (8192 x 4096 bf16), generated
on this CPU machine from fake CUDA tensors and cross-compiled for sm_90: one row-column
kernel reads g and x once (input gradient, and the weight and bias partials of its
part of the rows), then a small second stage sums the partials. A column reduction with
no row reduction to join keeps its own first stage: the contiguous columns across the
lanes, a per-row value (mean, rstd) loaded once per row of the tile, no layout converted
inside its loop (a conversion there goes through shared memory on every iteration).
Numerics of the same kernels at smaller sizes run under Triton's interpreter in
tests/triton_interp/test_split_reductions.py."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.compiler.codegen.kernel_spec import KernelSpec
from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.kernel_compile import triton_compiled
from kiln.compiler.runtime.kernel_files import interpreter_active
from tests.targets import SM90

ROWS, COLS = 8192, 4096

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


def _ln_backward(g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                 w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.ops.aten.native_layer_norm_backward(g, x, [x.shape[-1]], mean, rstd, w, b,
                                                     [True, True, True])


def _ln_backward_args(with_weights: bool) -> list[torch.Tensor]:
    """Fake CUDA g and x (bf16, [ROWS, COLS]), mean and rstd (float32, [ROWS, 1]), and
    with ``with_weights`` the bf16 weight and bias."""
    bf = torch.bfloat16
    with FakeTensorMode():
        args = [torch.empty(ROWS, COLS, dtype=bf, device="cuda"),
                torch.empty(ROWS, COLS, dtype=bf, device="cuda"),
                torch.empty(ROWS, 1, device="cuda"), torch.empty(ROWS, 1, device="cuda")]
        if with_weights:
            args += [torch.empty(COLS, dtype=bf, device="cuda") for _ in range(2)]
    return args


@pytest.fixture(scope="module")
def compiled() -> CompiledGraph:
    args = _ln_backward_args(with_weights=True)
    return compile_graph(trace_aten(_ln_backward, args), args, {}, compile_kernels=False)


def _loop_body(ttgir: str) -> str:
    """The r loop of a kernel's TTGIR (up to the results: a loop of one iteration is
    folded away, its body then runs before the reduction)."""
    if "scf.for" not in ttgir:
        return ttgir[:ttgir.index('"tt.reduce"')]
    start = ttgir.index("scf.for")
    return ttgir[start:ttgir.index("scf.yield", start)]


def _ptxas_usage(ptx: str) -> tuple[int, int] | None:
    """(registers, spill store bytes) that Triton's own ptxas reports for sm_90, or None
    where this Triton does not say where its ptxas is."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        ptxas = str(get_ptxas(90).path)  # type: ignore[call-arg]
    except (ImportError, AttributeError, TypeError, RuntimeError):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([ptxas, "--gpu-name", "sm_90a", "-v", src, "-o",
                              os.path.join(tmp, "k.cubin")], capture_output=True, text=True)
    regs = re.search(r"Used (\d+) registers", out.stderr)
    spills = re.search(r"(\d+) bytes spill stores", out.stderr)
    assert out.returncode == 0 and regs and spills, out.stderr
    return int(regs.group(1)), int(spills.group(1))


def test_one_row_column_kernel_and_one_second_stage(compiled: CompiledGraph) -> None:
    """g and x are read once: one program per SM-sized part of the rows (128 parts of
    64 rows) computes the input gradient and the weight and bias partials; one kernel
    sums the 128 partials of each column of both (two launches in all)."""
    kinds = [(k.kind, k.xnumel, k.rnumel, k.programs) for k in compiled.kernels]
    assert kinds == [("row_column", ROWS, COLS, 128), ("reduction", COLS, 128, 0)], kinds
    assert compiled.wrapper_source.count(".run(") == 2
    stage2 = compiled.kernels[1].source
    assert stage2.count("tl.load(") == 2 and stage2.count("tl.store(") == 2
    assert compiled.wrapper_source.count("empty_strided_cuda((128, 4096), (4096, 1), "
                                         "torch.float32)") == 2
    row = compiled.kernels[0]
    assert all(row.grid(dict(c)) == (128, 1, 1) for c in row.configs)
    # the fixed grid survives a manifest round trip (artifacts store specs as dicts)
    assert KernelSpec.from_dict(row.to_dict()).grid({"XBLOCK": 2}) == (128, 1, 1)


def test_row_column_kernel_reads_each_row_once(compiled: CompiledGraph) -> None:
    src = compiled.kernels[0].source
    loop = src.index("for xoffset in range(pid * 64, pid * 64 + 64, XBLOCK):")
    loads = re.findall(r"(\w+) = tl\.load\((in_ptr\d) \+ \((.*?)\), (.*?), other", src)
    wide = [(ptr, idx, mask) for _, ptr, idx, mask in loads if "4096*xindex" in idx]
    # g and x: the first block before the loop, then each next block a step ahead
    assert sorted((idx, mask) for _, idx, mask in wide) == sorted(
        [("4096*xindex_0 + rindex", "xmask_0 & rmask")] * 2
        + [("4096*xindex_n + rindex", "xmask_n & rmask")] * 2), wide
    assert len({ptr for ptr, _, _ in wide}) == 2
    # mean and rstd once per row, prefetched the same way; the weight once per program
    per_row = [(idx, mask) for _, _, idx, mask in loads if idx in ("xindex_0", "xindex_n")]
    assert sorted(per_row) == sorted([("xindex_0", "xmask_0")] * 2
                                     + [("xindex_n", "xmask_n")] * 2)
    weight = [(name, idx) for name, _, idx, _ in loads if idx == "rindex"]
    assert len(weight) == 1 and src.index(f"{weight[0][0]} = tl.load(") < loop
    assert len(loads) == 9
    # the column partials accumulate across the loop and are stored once, after it
    assert src.count("tl.full([XBLOCK, RBLOCK], 0.0, tl.float32)") == 2
    after = src[src.index("tl.sum(_tmp"):]
    assert re.findall(r"tl\.store\(out_ptr\d \+ \((.*?)\), \w+, (\w+)\)", after) == \
        [("4096*pid + rindex", "rmask")] * 2
    assert re.findall(r"tl\.store\(out_ptr\d \+ \((.*?)\)", src[loop:]).count(
        "4096*xindex + rindex") == 1  # the input gradient, in the loop


def test_row_column_candidates_compile_for_sm90_without_spills(compiled: CompiledGraph
                                                               ) -> None:
    row = compiled.kernels[0]
    warps = {(c["XBLOCK"], c["num_warps"]) for c in row.configs}
    assert warps == {(1, 16), (2, 16), (2, 32), (1, 8)}, warps
    for config in row.configs:
        kernel = triton_compiled(row, dict(config), SM90)
        assert kernel.asm["cubin"][:4] == b"\x7fELF"
        assert "ttg.convert_layout" not in _loop_body(kernel.asm["ttgir"]), config
        usage = _ptxas_usage(kernel.asm["ptx"])
        if usage is not None:
            regs, spilled = usage
            # 64K registers per SM: a program of 32 warps gets at most 64 each
            assert spilled == 0 and regs * config["num_warps"] * 32 <= 65536, (config, usage)


def _weight_bias_grads(g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                       rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xf, gf = x.float(), g.float()
    bf = torch.bfloat16
    return (gf * ((xf - mean) * rstd)).sum(0).to(bf), gf.sum(0).to(bf)


@pytest.fixture(scope="module")
def columns_only() -> CompiledGraph:
    """The weight and bias gradients with no row reduction to join: two stages."""
    args = _ln_backward_args(with_weights=False)
    return compile_graph(trace_aten(_weight_bias_grads, args), args, {},
                         compile_kernels=False)


def test_column_stage_one_loads(columns_only: CompiledGraph) -> None:
    kinds = [(k.kind, k.xnumel, k.rnumel) for k in columns_only.kernels]
    # 128 parts of 64 rows (one per SM, as a row-column kernel would have them)
    assert kinds == [("reduction", 128 * COLS, 64), ("reduction", COLS, 128)], kinds
    stage1 = columns_only.kernels[0]
    loads = re.findall(r"tl\.load\((in_ptr\d) \+ \((.*?)\), (.*?), other", stage1.source)
    wide = [(idx, mask) for _, idx, mask in loads if "xindex" in idx]
    per_row = [(idx, mask) for _, idx, mask in loads if "xindex" not in idx]
    # g and x: columns (xindex) contiguous, rows (rindex) strided, the part per program.
    assert wide == [("(xindex % 4096) + 262144*(xoffset // 4096) + 4096*rindex",
                     "xmask & rmask")] * 2
    # mean and rstd: one value per row of the tile, [1, RBLOCK], not [XBLOCK, RBLOCK].
    assert per_row == [("64*(xoffset // 4096) + rindex", "rmask")] * 2
    assert stage1.source.count("tl.store(") == 2


def test_column_stage_one_tile_and_cubin(columns_only: CompiledGraph) -> None:
    stage1 = columns_only.kernels[0]
    first = dict(stage1.configs[0])
    # 64 columns (128 bytes of bf16 per row) x 64 rows: 16 KiB of loads per iteration.
    assert (first["XBLOCK"], first["RBLOCK"], first["num_warps"]) == (64, 64, 8)
    assert all(c["XBLOCK"] <= 4096 and 4096 % c["XBLOCK"] == 0 for c in stage1.configs)
    for config in stage1.configs:
        kernel = triton_compiled(stage1, dict(config), SM90)
        assert kernel.asm["cubin"][:4] == b"\x7fELF"
        body = _loop_body(kernel.asm["ttgir"])
        assert "ttg.convert_layout" not in body, config
        # the wide loads' layout: columns fastest (order [0, 1])
        wide = re.findall(r"tt\.load .*?tensor<\d+x\d+x!tt\.ptr<bf16>, #(\w+)>", body)
        assert len(wide) == 2, config
        layout = re.search(rf"#{wide[0]} = #ttg\.blocked<\{{.*?order = \[(\d), (\d)\]",
                           kernel.asm["ttgir"])
        assert layout is not None and layout.groups() == ("0", "1"), config


def test_encoder_layer_norm_candidates_convert_no_layouts() -> None:
    """The 12-layer encoder's norm (a residual add, 4096 rows of 512 fp16): autotuning
    chooses among tiles up to 16 warps and Inductor's one warp per row; none converts a
    layout through shared memory (a [1, RBLOCK] weight load did, with 8 rows a block)."""
    h = torch.float16
    with FakeTensorMode():
        args = [torch.empty(8, 512, 512, dtype=h, device="cuda"),
                torch.empty(8, 512, 512, dtype=h, device="cuda"),
                torch.empty(512, dtype=h, device="cuda"), torch.empty(512, dtype=h, device="cuda")]
    fn = lambda x, y, w, b: torch.nn.functional.layer_norm(x + y, (512,), w, b)  # noqa: E731
    compiled = compile_graph(trace_aten(fn, args), args, {}, compile_kernels=False)
    [spec] = compiled.kernels
    assert spec.kind == "persistent_reduction" and (spec.xnumel, spec.rnumel) == (4096, 512)
    shapes = [(c["XBLOCK"], c["num_warps"]) for c in spec.configs]
    assert shapes[0] == (8, 16) and (2, 1) in shapes, shapes
    for config in spec.configs:
        kernel = triton_compiled(spec, dict(config), SM90)
        assert "ttg.convert_layout" not in kernel.asm["ttgir"], config


def test_fp32_row_column_candidates_hold_fewer_elements_per_thread() -> None:
    """fp32 rows (16384 x 1024): the raw next-block loads are twice as wide as bf16's,
    so candidates hold half the elements per thread (16 spilled)."""
    with FakeTensorMode():
        args = [torch.empty(16384, 1024, device="cuda"), torch.empty(16384, 1024, device="cuda"),
                torch.empty(16384, 1, device="cuda"), torch.empty(16384, 1, device="cuda"),
                torch.empty(1024, device="cuda"), torch.empty(1024, device="cuda")]
    compiled = compile_graph(trace_aten(_ln_backward, args), args, {}, compile_kernels=False)
    row = compiled.kernels[0]
    assert (row.kind, row.programs) == ("row_column", 128)
    for config in row.configs:
        assert config["XBLOCK"] * 1024 <= 8 * config["num_warps"] * 32, config
        usage = _ptxas_usage(triton_compiled(row, dict(config), SM90).asm["ptx"])
        assert usage is None or usage[1] == 0, (config, usage)
