"""What max-autotune weighs for a matmul (no GPU): template configs that cannot fit the
target's shared memory are never compiled (the estimate checked against the figures of
Triton's own sm_90 cubins), the library call is timed in the problem's TF32 precision,
and an addmm whose row bias cuBLASLt adds in its epilogue is charged no round trip
unless pointwise work follows it."""

from __future__ import annotations

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.compiler.codegen.triton.templates import (
    SHARED_MEMORY_BYTES,
    gemm_configs,
    shared_memory_estimate,
    standalone_spec,
)
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.ir.template import GemmProblem
from kiln.compiler.kernel_compile import compile_kernel
from kiln.compiler.runtime.kernel_files import interpreter_active
from kiln.compiler.select_algorithm import Candidate, candidates, describe_choice, pick_winner
from kiln.workers.autotune import library_precision
from tests.gemm_helpers import aot_graphs, as_fake_cuda, compile_tuned
from tests.targets import SM90

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


def problem(dtype: str = "float16", tf32: bool = False) -> GemmProblem:
    return GemmProblem("mm", 1, 4096, 4096, 1024, dtype, dtype, dtype, (0, 1024, 1),
                       (0, 4096, 1), True, tf32)


def config(bm: int, bn: int, bk: int, stages: int, warps: int, **flags: int
           ) -> dict[str, int]:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "num_warps": warps,
            "num_stages": stages, **flags}


@pytest.mark.parametrize("p, cfg", [
    (problem(), config(64, 64, 128, 5, 4)),  # wgmma: num_stages buffers
    (problem("float32"), config(128, 128, 32, 3, 8)),  # fp32 IEEE: one fewer
    (problem("float32", tf32=True), config(128, 128, 32, 3, 8)),
    (problem(), config(128, 128, 64, 4, 8, TMA=1, NUM_SMS=132)),  # persistent epilogue
], ids=["fp16", "fp32", "tf32", "fp16-tma-persistent"])
def test_estimate_bounds_what_triton_allocates(p: GemmProblem, cfg: dict[str, int]) -> None:
    binary = compile_kernel(standalone_spec(p, cfg, "tem_smem"), cfg, SM90)
    shared = int(binary.metadata["shared"])
    assert shared <= shared_memory_estimate(p, cfg) <= shared + 2048, shared


def test_configs_that_do_not_fit_are_pruned_before_compiling() -> None:
    # Inductor's configs that failed to launch on the H200 (fp32, IEEE): "Required:
    # 262144 Hardware limit: 232448"; the estimate says so before any compile.
    assert shared_memory_estimate(problem("float32"), config(64, 64, 128, 5, 4)) > 232448
    assert shared_memory_estimate(problem("float32"), config(128, 128, 64, 5, 8)) > 232448
    for p in (problem(), problem("float32"), problem("float32", tf32=True)):
        every = gemm_configs(p)
        assert gemm_configs(p, SM90) == every  # Kiln's own tables fit Hopper
        small = gemm_configs(p, {**SM90, "arch": 86})  # 99 KiB per block
        assert small == [c for c in every if shared_memory_estimate(p, c) <= 101376]
        assert small and all(shared_memory_estimate(p, c) <= SHARED_MEMORY_BYTES[86]
                             for c in small)
        assert gemm_configs(p, {**SM90, "arch": 75}) == every  # unknown: nothing pruned
    p = problem()
    assert len(gemm_configs(p, {**SM90, "arch": 86})) < len(gemm_configs(p))
    cands = candidates(p, {**SM90, "arch": 86})
    assert cands[0] == Candidate("extern")
    assert [c.config for c in cands[1:]] == gemm_configs(p, {**SM90, "arch": 86})


def test_library_call_is_timed_in_the_problems_precision() -> None:
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    try:
        for process_flag in (False, True):
            matmul.allow_tf32 = process_flag
            for wanted in (False, True):
                with library_precision(problem("float32", tf32=wanted)):
                    assert matmul.allow_tf32 is wanted
                assert matmul.allow_tf32 is process_flag
    finally:
        matmul.allow_tf32 = before


def _pending(fn, *shapes: tuple[int, ...]) -> list[GemmProblem]:  # type: ignore[no-untyped-def]
    gm = trace_aten(fn, [torch.randn(s, dtype=torch.float16) for s in shapes])
    with FakeTensorMode():
        args = [torch.empty(s, dtype=torch.float16, device="cuda") for s in shapes]
    first = compile_graph(gm, args, {"max_autotune": True}, name="sel", compile_kernels=False)
    return [GemmProblem.from_dict(p) for p in first.stats["gemm_pending"].values()]


def test_row_bias_in_the_library_call_is_no_epilogue() -> None:
    shapes = ((256, 128), (128, 192), (192,))
    # The product goes on to another matmul: cuBLASLt adds the bias, nothing to fuse.
    chained = _pending(lambda x, w, b: torch.addmm(b, x, w) @ w.t(), *shapes)
    assert {(p.m, p.n, p.k, p.epilogue) for p in chained} >= {(256, 192, 128, False)}
    # Pointwise work follows: the library call would write and re-read the product.
    act = _pending(lambda x, w, b: torch.relu(torch.addmm(b, x, w)), *shapes)
    assert [p.epilogue for p in act] == [True]
    # A 16-bit activation computed in fp32: the cast is pointwise work too.
    gelu = _pending(lambda x, w, b: torch.nn.functional.gelu(torch.addmm(b, x, w).float()),
                    *shapes)
    assert [p.epilogue for p in gelu] == [True]
    # A scaled bias or a 2-D one is a kernel of its own after the library call.
    scaled = _pending(lambda x, w, b: torch.addmm(b, x, w, beta=0.5) @ w.t(), *shapes)
    assert (256, 192, 128, True) in {(p.m, p.n, p.k, p.epilogue) for p in scaled}
    full = _pending(lambda x, w, b: torch.addmm(b, x, w) @ w.t(), (256, 128), (128, 192),
                    (256, 192))
    assert (256, 192, 128, True) in {(p.m, p.n, p.k, p.epilogue) for p in full}


def test_mlp_step_with_library_choices_is_library_calls_and_minimal_pointwise() -> None:
    """gpu_bench's fp32 MLP training step (Linear, GELU, Linear, mean-square loss) where
    max-autotune chose the library call for every matmul (as on the H200, ALLOW_TF32
    off): the wrapper calls addmm / mm on transposed views of the weights and of the
    gradients (never a copy), and the kernels besides are only what eager also runs:
    the GELU and its derivative, the loss and its gradient, the two bias-gradient sums."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(),
                              torch.nn.Linear(256, 64))

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = mlp(x).square().mean()
        loss.backward()
        return loss

    compiled = {name.split("_")[0]: compile_tuned(
        lambda: None, as_fake_cuda(inputs), {}, graph=gm, pick=lambda p: {"kind": "extern"})
        for name, gm, inputs in aot_graphs(step, [torch.randn(512, 64)])}
    fw, bw = compiled["forward"], compiled["backward"]
    assert [len(c.stats["gemm_choices"]) for c in (fw, bw)] == [2, 3]
    assert all(c["kind"] == "extern" for g in (fw, bw) for c in g.stats["gemm_choices"].values())
    calls = {name: re.findall(r"torch\.(\w+)\((.*)\)$", c.wrapper_source, re.M)
             for name, c in compiled.items()}
    assert [op for op, _ in calls["forward"]] == ["addmm", "addmm"]
    assert [op for op, _ in calls["backward"]] == ["mm", "mm", "mm"]
    # Every transposed operand is a strided view (reinterpret_tensor with a unit first
    # stride), read in place by the library: forward both weights, backward the first
    # weight gradient's left operand. The second one's (the GELU derivative, only ever
    # taken transposed) is allocated transposed: the buffer itself is the operand.
    transposed = r"reinterpret_tensor\(\w+, \(\d+, \d+\), \(1, \d+\), 0\)"
    assert [len(re.findall(transposed, args)) for _, args in calls["forward"]] == [1, 1]
    assert sorted(len(re.findall(transposed, args)) for _, args in calls["backward"]) == \
        [0, 0, 1]
    (flipped,) = re.findall(r"(buf\d+) = empty_strided_cuda\(\(256, 512\), \(1, 256\), "
                            r"torch.float32\)  # as its one view", bw.wrapper_source)
    assert f"torch.mm({flipped}, primals_3)" in bw.wrapper_source, bw.wrapper_source
    for c in (fw, bw):
        assert not re.search(r"\.(clone|contiguous|copy_)\(|extern_kernels", c.wrapper_source)
    kinds = {name: [k.kind for k in c.kernels] for name, c in compiled.items()}
    # Forward: the GELU (one pointwise kernel), then the loss's mean (a reduction).
    assert kinds["forward"] == ["pointwise", "reduction"]
    # Backward: the loss's gradient and the GELU's derivative (two pointwise kernels),
    # each bias gradient a column sum (one reduction each at 512 rows).
    assert sorted(kinds["backward"]) == ["pointwise", "pointwise", "reduction", "reduction"]
    assert all("sum" in k.name for k in bw.kernels if k.kind != "pointwise")


def test_a_choice_is_described_in_one_line() -> None:
    """What the selection logs and gpu_bench prints for each problem: the winner, the
    library call's time, the best template's (and how many ran), the round trip."""
    p = GemmProblem("mm", 1, 4096, 4096, 1024, "float32", "float32", "float32",
                    (0, 1, 4096), (0, 1024, 1), True, False)
    cands = candidates(p)
    library_wins = pick_winner(p, [(c, 0.7 + 0.1 * i) for i, c in enumerate(cands)], 0.03)
    line = describe_choice(p, library_wins)
    assert line.startswith("mm 4096x4096x1024 float32 (a^T, b) +epilogue: chose extern; ")
    first = gemm_configs(p)[0]
    tile = f"{first['BLOCK_M']}x{first['BLOCK_N']}x{first['BLOCK_K']}"
    assert f"extern 0.700 ms; best template 0.800 ms ({tile} " in line
    assert f"of {len(cands) - 1}; round trip 0.030 ms" in line
    # The last template is the fastest, even with the extern's round trip forgiven.
    fast = pick_winner(p, [(c, 1.0 - 0.05 * i) for i, c in enumerate(cands)], 0.03)
    last = cands[-1].config
    assert last is not None
    assert f"chose template {last['BLOCK_M']}x{last['BLOCK_N']}x{last['BLOCK_K']} " \
        f"s{last['num_stages']} w{last['num_warps']}; extern 1.000 ms" in describe_choice(p, fast)
    assert describe_choice(p, {"kind": "extern", "timings": []}).endswith(
        "chose extern; not benchmarked")


def test_gpu_bench_reports_each_graphs_gemm_choices() -> None:
    """bench/gemm_report.py (gpu_bench's choice lines) as an observer of compiles: one
    line per problem of the graphs compiled since the last ``take``, and a graph whose
    choices cannot be read is reported, never raised into the compile."""
    import importlib.util
    import types
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "gemm_report.py"
    spec = importlib.util.spec_from_file_location("gemm_report", path)
    assert spec is not None and spec.loader is not None
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    with FakeTensorMode():
        args = [torch.empty(s, dtype=torch.float16, device="cuda")
                for s in ((256, 128), (128, 192), (192,))]
    compiled = compile_tuned(lambda x, w, b: torch.relu(torch.addmm(b, x, w)) @ w.t(), args,
                             {}, trace_args=[torch.randn(s, dtype=torch.float16)
                                             for s in ((256, 128), (128, 192), (192,))])
    report._note("g", types.SimpleNamespace(compiled=compiled))
    lines = report.take()
    assert sorted(line.split(" (")[0] for line in lines) == ["mm 256x128x192 float16",
                                                               "mm 256x192x128 float16"]
    assert all(": chose template " in line and line.endswith("not benchmarked")
               for line in lines)
    assert report.take() == []
    compiled.stats["gemm_choices"] = {"k": {"problem": {"op": "mm"}}}
    report._note("g", types.SimpleNamespace(compiled=compiled))
    assert report.take() == ["(choices of graph g not described: KeyError: 'batch')"]
