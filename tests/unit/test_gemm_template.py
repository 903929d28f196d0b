"""The GEMM template on fake CUDA tensors (no GPU): golden output code of a fused
epilogue, fusion decisions, every config cross-compiled for sm_90, and the choice
bookkeeping (keys, the winner rule, records read from outside)."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.compiler.codegen.triton.templates import gemm_configs, standalone_spec
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.ir.template import GemmProblem
from kiln.compiler.kernel_compile import compile_kernel
from kiln.compiler.runtime.kernel_files import interpreter_active
from kiln.compiler.select_algorithm import (
    Candidate,
    candidates,
    check_record,
    choice_key,
    pick_winner,
)
from tests.gemm_helpers import aot_graphs, as_fake_cuda, compile_tuned
from tests.targets import SM90

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


def fake_cuda(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float16
              ) -> list[torch.Tensor]:
    with FakeTensorMode():
        return [torch.empty(s, dtype=dtype, device="cuda") for s in shapes]


def gelu_bias_residual(x, w, b, r):  # type: ignore[no-untyped-def]
    return F.gelu(x @ w + b) + r


def problem(**changes: object) -> GemmProblem:
    base = dict(op="mm", batch=1, m=8192, n=4096, k=4096, dtype="float16",
                a_dtype="float16", b_dtype="float16", a_stride=(0, 4096, 1),
                b_stride=(0, 4096, 1), epilogue=True)
    base.update(changes)
    return GemmProblem(**base)  # type: ignore[arg-type]


def test_golden_fused_epilogue() -> None:
    args = fake_cuda((256, 128), (128, 192), (192,), (256, 192))
    compiled = compile_tuned(gelu_bias_residual, args, {})
    assert [k.name for k in compiled.kernels] == ["triton_tem_fused_mm_add_erf_mul_0"]
    lines = [ln.strip() for ln in compiled.wrapper_source.splitlines()]
    body = lines[lines.index("args.clear()") + 1:]
    assert body == [
        "if (arg0_1.data_ptr() | arg1_1.data_ptr() | arg2_1.data_ptr() | arg3_1.data_ptr()) "
        "% 16:",
        "arg0_1 = align_input(arg0_1)", "arg1_1 = align_input(arg1_1)",
        "arg2_1 = align_input(arg2_1)", "arg3_1 = align_input(arg3_1)",
        "empty_strided_cuda = cuda_allocator(DEVICE)",
        "buf1 = empty_strided_cuda((256, 192), (192, 1), torch.float16)",
        "triton_tem_fused_mm_add_erf_mul_0.run(arg0_1, arg1_1, arg2_1, arg3_1, buf1)",
        "del arg0_1", "del arg1_1", "del arg2_1", "del arg3_1", "return (buf1, )",
    ]
    spec = compiled.kernels[0]
    src = spec.source
    assert spec.kind == "template" and spec.tile_shape == (1, 256, 192)
    assert spec.configs == (gemm_configs(GemmProblem.from_dict(
        next(iter(compiled.stats["gemm_choices"].values()))["problem"]))[0],)
    # The product never reaches memory: one store, of the epilogue's result.
    assert src.count("tl.store(") == 1
    assert "tl.store(out_ptr0 + (192*tm + tn), tmp14.to(tl.float16), xmask)" in src
    assert "acc += tl.dot(a, b)" in src and "tmp1 = acc + tmp0" in src
    assert "tl.load(in_ptr2 + (tn), xmask, other=0.0)" in src  # the bias, per column
    assert "tl.load(in_ptr3 + (192*tm + tn), xmask, other=0.0)" in src  # the residual
    assert "tl.erf(" in src
    # 256 rows divide the tile (aligned hints); 192 columns do not (wrapped indices).
    assert "ram = tl.max_contiguous(tl.multiple_of(rm, BLOCK_M), BLOCK_M)" in src
    assert "rbn = rn % N" in src
    assert compiled.stats["buffers"] == 1


def test_default_mode_keeps_the_library_call() -> None:
    args = fake_cuda((256, 128), (128, 192), (192,), (256, 192))
    gm = trace_aten(gelu_bias_residual, args)
    compiled = compile_graph(gm, args, {}, compile_kernels=False)
    assert "torch.mm(" in compiled.wrapper_source
    assert not any(k.kind == "template" for k in compiled.kernels)
    assert "gemm_choices" not in compiled.stats


def test_product_read_by_a_reduction_is_stored_and_not_fused_into() -> None:
    args = fake_cuda((128, 64), (64, 96))
    def fn(x, w):  # type: ignore[no-untyped-def]
        y = x @ w
        return y.relu(), y.sum(0)

    compiled = compile_tuned(fn, args, {})
    names = [k.name for k in compiled.kernels]
    assert len(names) == 2 and names[0].startswith("triton_tem_fused_mm_relu")
    tem = compiled.kernels[0].source
    assert tem.count("tl.store(") == 2  # the product (for the reduction) and the relu


def test_transposed_read_of_the_product_is_not_fused() -> None:
    args = fake_cuda((128, 64), (64, 128))
    compiled = compile_tuned(lambda x, w: (x @ w).t() + 1, args, {})
    kinds = [k.kind for k in compiled.kernels]
    assert kinds == ["template", "pointwise"]


def test_bmm_epilogue_golden_and_batch_index() -> None:
    args = fake_cuda((4, 64, 32), (4, 32, 48), (4, 64, 48))
    compiled = compile_tuned(lambda a, b, c: torch.bmm(a, b) * c, args, {})
    (spec,) = compiled.kernels
    assert spec.name == "triton_tem_fused_bmm_mul_0" and spec.tile_shape == (4, 64, 48)
    assert "tb = pid // tiles" in spec.source
    assert "tl.store(out_ptr0 + (3072*tb + 48*tm + tn)" in spec.source


def test_fp32_uses_ieee_unless_tf32_is_allowed() -> None:
    args = fake_cuda((64, 64), (64, 64), dtype=torch.float32)
    ieee = compile_tuned(lambda x, w: x @ w, args, {})
    tf32 = compile_tuned(lambda x, w: x @ w, args, {"allow_tf32": True})
    assert 'input_precision="ieee"' in ieee.kernels[0].source
    assert 'input_precision="tf32"' in tf32.kernels[0].source
    assert ieee.stats["gemm_choices"].keys() != tf32.stats["gemm_choices"].keys()


def test_every_config_compiles_for_sm90_on_hopper_mma() -> None:
    """Each 16-bit config of the 8192x4096x4096 problem and each fp32 one, as the
    autotuner compiles them, gives an sm_90 cubin whose tl.dot is a wgmma."""
    problems = [problem(), problem(dtype="float32", a_dtype="float32", b_dtype="float32",
                                   allow_tf32=True)]
    for p in problems:
        for i, cfg in enumerate(gemm_configs(p)):
            spec = standalone_spec(p, cfg, f"tem_cfg_{i}")
            binary = compile_kernel(spec, cfg, SM90)
            assert binary.binary[:4] == b"\x7fELF" and binary.metadata["target"]["arch"] == 90
            assert binary.metadata["shared"] <= 227 * 1024, cfg
    ptx = _ptx(standalone_spec(problems[0], gemm_configs(problems[0])[1], "tem_ptx"))
    assert "wgmma.mma_async" in ptx
    # TMA configs (16-bit, aligned unit-stride operands): descriptor loads, bulk copies.
    tma = [c for c in gemm_configs(problems[0]) if c.get("TMA")]
    assert len(tma) == 5 and not any(c.get("TMA") for c in gemm_configs(problems[1]))
    persistent = [c for c in tma if c.get("NUM_SMS")]
    spec = standalone_spec(problems[0], persistent[0], "tem_persistent")
    assert spec.grid(persistent[0]) == (132, 1, 1)
    assert "for tile in tl.range(start, tiles, 132, flatten=True):" in spec.source
    assert "        tl.store(out_ptr0 + (xindex)" in spec.source  # inside the tile loop
    spec = standalone_spec(problems[0], tma[0], "tem_tma")
    assert "tl.make_tensor_descriptor(in_ptr0, shape=[M, K]" in spec.source
    assert "cp.async.bulk.tensor" in _ptx(spec)
    transposed_b = problem(b_stride=(0, 1, 4096))
    spec = standalone_spec(transposed_b, gemm_configs(transposed_b)[-1], "tem_tma_t")
    assert "b_desc.load([pid_n * BLOCK_N, k]).T" in spec.source
    unaligned = problem(n=4100, b_stride=(0, 4100, 1))
    assert not any(c.get("TMA") for c in gemm_configs(unaligned))


def _ptx(spec):  # type: ignore[no-untyped-def]
    import triton
    from triton.compiler import ASTSource

    from kiln.compiler.kernel_compile import triton_target
    from kiln.compiler.runtime.kernel_files import import_source

    fn = getattr(import_source(spec.source), spec.name)
    cfg = spec.configs[0]
    constexprs = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")}
    src = ASTSource(fn, dict(spec.signature), constexprs=constexprs,
                    attrs={(i,): [["tt.divisibility", 16]] for i in range(3)})
    compiled = triton.compile(src, target=triton_target(SM90),
                              options={"num_warps": cfg["num_warps"],
                                       "num_stages": cfg["num_stages"]})
    return compiled.asm["ptx"]


def test_choice_keys_name_what_decides_speed() -> None:
    p = problem()
    assert choice_key(p, SM90) == choice_key(problem(), dict(SM90))
    differs = [problem(m=4096), problem(dtype="bfloat16", a_dtype="bfloat16",
                                        b_dtype="bfloat16"),
               problem(b_stride=(0, 1, 4096)), problem(epilogue=False)]
    keys = {choice_key(q, SM90) for q in differs} | {choice_key(p, {**SM90, "arch": 100})}
    assert choice_key(p, SM90) not in keys and len(keys) == 5


def test_winner_rule_charges_the_extern_call_its_round_trip() -> None:
    p = problem()
    cands = candidates(p)
    assert cands[0] == Candidate("extern") and len(cands) == 1 + len(gemm_configs(p))
    timed = [(cands[0], 0.40), (cands[1], 0.43), (cands[2], math.inf)]
    # Fused, the template saves the output's trip through memory (0.05 ms): it wins.
    assert pick_winner(p, timed, round_trip_ms=0.05)["config"] == cands[1].config
    # Without an epilogue there is nothing to save: the faster library call wins.
    assert pick_winner(problem(epilogue=False), timed, 0.05)["kind"] == "extern"
    # Nothing ran: the library call, and failures are reported as such.
    failed = pick_winner(p, [(c, math.inf) for c in cands[:3]])
    assert failed["kind"] == "extern" and failed["timings"][1]["ms"] is None


@pytest.mark.parametrize("record", [
    None, [], {"kind": "shell"}, {"kind": "template"},
    {"kind": "template", "config": {"BLOCK_M": "128"}},
    {"kind": "template", "config": {"BLOCK_M": 1 << 20, "BLOCK_N": 64, "BLOCK_K": 32,
                                    "GROUP_M": 8, "num_warps": 4, "num_stages": 3}},
])
def test_hostile_choice_records_are_refused(record: object) -> None:
    with pytest.raises(ValueError):
        check_record(record)


def test_tma_flag_survives_the_record_check() -> None:
    tma = gemm_configs(problem())[-1]
    assert tma["TMA"] == 1 and check_record({"kind": "template", "config": tma})["config"] == tma
    with pytest.raises(ValueError):
        check_record({"kind": "template", "config": {**tma, "TMA": "yes"}})


def test_checked_record_keeps_only_known_fields() -> None:
    cfg = gemm_configs(problem())[0]
    record = check_record({"kind": "template", "config": {**cfg, "extra": "x"},
                           "timings": [], "payload": "__import__('os')"})
    assert record == {"kind": "template", "config": cfg, "timings": [], "round_trip_ms": 0.0}


def test_kernel_names_and_template_constexprs() -> None:
    spec = standalone_spec(problem(), gemm_configs(problem())[0], "triton_tem_mm_x_0")
    assert re.search(r"def triton_tem_mm_x_0\(in_ptr0, in_ptr1, out_ptr0, BLOCK_M: "
                     r"tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, "
                     r"GROUP_M: tl.constexpr\)", spec.source)
    assert spec.grid(spec.configs[0]) == (64 * 32, 1, 1)
    assert spec.arg_bytes == (8192 * 4096 * 2, 4096 * 4096 * 2, 8192 * 4096 * 2)


@pytest.mark.parametrize("options", [{}, {"max_autotune": True}], ids=["default", "tuned"])
def test_convolution_is_an_extern_call_and_one_fused_epilogue_kernel(
        options: dict[str, object]) -> None:
    """Convolution: cuDNN through ATen, then bias, activation and residual in one kernel
    (in both modes: there is no convolution template)."""
    args = fake_cuda((8, 16, 32, 32), (32, 16, 3, 3), (32,), (8, 32, 32, 32))

    def fn(x, w, b, r):  # type: ignore[no-untyped-def]
        return F.relu(F.conv2d(x, w, b, padding=1)) + r

    compiled = compile_graph(trace_aten(fn, args), args, options, compile_kernels=False)
    wrapper = compiled.wrapper_source
    assert wrapper.count("torch.convolution(") == 1
    kernels = [k for k in compiled.kernels if "convolution" not in k.name]
    epilogue = [k for k in kernels if "relu" in k.name or "add" in k.name]
    assert len(epilogue) == 1, [k.name for k in compiled.kernels]
    src = epilogue[0].source
    assert src.count("tl.store(") == 1 and "tl.where(" in src  # bias, relu, residual: one pass
    if options:
        assert compiled.stats["gemm_choices"] == {} and compiled.stats["gemm_pending"] == {}


def test_epilogue_overwriting_a_template_input_is_not_fused() -> None:
    """``x.copy_(relu(x @ w))``: tiles still read ``x`` while others would overwrite it."""
    args = fake_cuda((64, 64), (64, 64))

    def fn(x, w):  # type: ignore[no-untyped-def]
        x.copy_(torch.relu(x @ w))
        return x

    compiled = compile_tuned(fn, args, {}, trace_args=[torch.randn(64, 64), torch.randn(64, 64)])
    kinds = [k.kind for k in compiled.kernels]
    assert kinds == ["template", "pointwise"], [k.name for k in compiled.kernels]


def test_mlp_training_step_every_matmul_a_template_forward_and_backward() -> None:
    """What max-autotune makes of gpu_bench's MLP training step (Linear, GELU, Linear,
    mean-square loss; fp32) on fake CUDA tensors: the 2 forward and 3 backward matmuls
    (the weight gradients read a transposed operand) are each a template with its own
    choice key, none is left to the library call, the GELU fuses into the first forward
    template and its derivative into the backward template of the input gradient."""
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(),
                              torch.nn.Linear(128, 32))

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = mlp(x).square().mean()
        loss.backward()
        return loss

    graphs = aot_graphs(step, [torch.randn(64, 32)])
    assert [name.split("_")[0] for name, _, _ in graphs] == ["forward", "backward"]
    keys: set[str] = set()
    problems = []
    for name, gm, inputs in graphs:
        compiled = compile_tuned(lambda: None, as_fake_cuda(inputs), {}, graph=gm)
        choices = compiled.stats["gemm_choices"]
        keys |= choices.keys()
        problems += [GemmProblem.from_dict(c["problem"]) for c in choices.values()]
        assert compiled.stats["gemm_pending"] == {}
        names = [k.name for k in compiled.kernels]
        templates = [n for n in names if n.startswith("triton_tem_fused_mm")]
        assert len(templates) == len(choices) == (2 if name.startswith("forward") else 3)
        for call in ("aten.mm", "aten.addmm", "torch.mm(", "torch.addmm("):
            assert call not in compiled.wrapper_source
        fused = "erf" if name.startswith("forward") else "exp"  # GELU, then its derivative
        assert any(fused in n for n in templates), names
    assert len(keys) == 5  # every problem its own key: layouts differ forward and backward
    transposed_a = [p for p in problems if p.a_stride[1] == 1 and p.a_stride[2] > 1]
    assert len(transposed_a) == 2 and all(not p.epilogue for p in transposed_a)
    assert all(p.dtype == "float32" and not p.allow_tf32 for p in problems)
