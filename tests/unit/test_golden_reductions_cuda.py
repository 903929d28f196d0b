"""Golden code of layer-norm backward at the GPU bench's size (8192 x 4096 bf16), generated
on this CPU machine from fake CUDA tensors and cross-compiled for sm_90: the column
reduction's first stage keeps the contiguous columns across the lanes, loads a per-row
value (mean, rstd) once per row of the tile, and converts no layouts inside its loop (a
conversion there goes through shared memory on every iteration). Numerics of the same
kernels at a smaller size run under Triton's interpreter in
tests/triton_interp/test_split_reductions.py."""

from __future__ import annotations

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.kernel_compile import triton_compiled
from kiln.compiler.runtime.kernel_files import interpreter_active

SM90 = {"kind": "cuda", "backend": "cuda", "arch": 90, "warp_size": 32}
ROWS, COLS = 8192, 4096

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


def _ln_backward(g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                 w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.ops.aten.native_layer_norm_backward(g, x, [x.shape[-1]], mean, rstd, w, b,
                                                     [True, True, True])


@pytest.fixture(scope="module")
def compiled() -> CompiledGraph:
    bf = torch.bfloat16
    with FakeTensorMode():
        args = [torch.empty(ROWS, COLS, dtype=bf, device="cuda"),
                torch.empty(ROWS, COLS, dtype=bf, device="cuda"),
                torch.empty(ROWS, 1, device="cuda"), torch.empty(ROWS, 1, device="cuda"),
                torch.empty(COLS, dtype=bf, device="cuda"),
                torch.empty(COLS, dtype=bf, device="cuda")]
    return compile_graph(trace_aten(_ln_backward, args), args, {}, compile_kernels=False)


def _loop_body(ttgir: str) -> str:
    start = ttgir.index("scf.for")
    return ttgir[start:ttgir.index("scf.yield", start)]


def test_column_stage_one_loads(compiled: CompiledGraph) -> None:
    kinds = [(k.kind, k.xnumel, k.rnumel) for k in compiled.kernels]
    # rows (grad input), the weight and bias partials of 8 parts x 4096 columns, and the
    # two second stages (one kernel, launched twice).
    assert kinds == [("persistent_reduction", ROWS, COLS), ("reduction", 8 * COLS, 1024),
                     ("reduction", COLS, 8)], kinds
    stage1 = compiled.kernels[1]
    loads = re.findall(r"tl\.load\((in_ptr\d) \+ \((.*?)\), (.*?), other", stage1.source)
    wide = [(idx, mask) for _, idx, mask in loads if "xindex" in idx]
    per_row = [(idx, mask) for _, idx, mask in loads if "xindex" not in idx]
    # g and x: columns (xindex) contiguous, rows (rindex) strided, the part per program.
    assert wide == [("(xindex % 4096) + 4096*rindex + 4194304*(xoffset // 4096)",
                     "xmask & rmask")] * 2
    # mean and rstd: one value per row of the tile, [1, RBLOCK], not [XBLOCK, RBLOCK].
    assert per_row == [("1024*(xoffset // 4096) + rindex", "rmask")] * 2
    assert stage1.source.count("tl.store(") == 2


def test_column_stage_one_tile_and_cubin(compiled: CompiledGraph) -> None:
    stage1 = compiled.kernels[1]
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


def test_row_kernel_loads_per_row_values_once(compiled: CompiledGraph) -> None:
    spec = compiled.kernels[0]
    assert "tl.load(in_ptr3 + (xindex), xmask, other=0.0)" in spec.source  # mean: [X, 1]
    assert "tl.load(in_ptr4 + (xindex), xmask, other=0.0)" in spec.source  # rstd
    # the weight stays a full tile, in the tile's layout (see TritonKernel._load_mask)
    assert "tl.load(in_ptr1 + (rindex), xmask & rmask, other=0.0)" in spec.source
    warps = [c["num_warps"] for c in spec.configs]
    assert 8 in warps and 16 in warps  # autotuning times both
    for config in spec.configs:
        kernel = triton_compiled(spec, dict(config), SM90)
        assert kernel.asm["cubin"][:4] == b"\x7fELF"
        # g, x, weight: one 16-byte load per thread and 8 elements each (or two); mean and
        # rstd once per row, not once per element (19 loads per thread before)
        assert kernel.asm["ptx"].count("ld.global") <= 8, config
        assert "ttg.convert_layout" not in kernel.asm["ttgir"], config


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
