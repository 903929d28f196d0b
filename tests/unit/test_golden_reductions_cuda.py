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
    rows = compiled.kernels[0].source
    assert "tl.load(in_ptr3 + (xindex), xmask, other=0.0)" in rows  # mean: [XBLOCK, 1]
    assert "tl.load(in_ptr1 + (rindex), rmask, other=0.0)" in rows  # weight: [1, RBLOCK]
    warps = [c["num_warps"] for c in compiled.kernels[0].configs]
    assert 8 in warps and 16 in warps  # autotuning times both
    kernel = triton_compiled(compiled.kernels[0], dict(compiled.kernels[0].configs[0]), SM90)
    assert kernel.asm["cubin"][:4] == b"\x7fELF"
