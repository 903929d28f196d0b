"""A large fp32 matmul in IEEE precision on Hopper goes to the library call by rule: no
template config is compiled and nothing is timed, even where a GPU could time it (cuBLAS's
SGEMM beat every Triton config on the H200). Small ones, TF32, 16-bit dtypes and other
GPUs are tuned as before; a graph whose winners are all library calls is lowered once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.compiler import trace
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.ir.template import GemmProblem
from kiln.compiler.runtime.kernel_files import interpreter_active
from kiln.compiler.select_algorithm import (
    EXTERN,
    candidates,
    describe_choice,
    library_only,
    library_record,
)
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.compile import build_request
from kiln.frontend.core.keys import compute_key
from kiln.workers.pipeline import KernelCache, compile_inprocess
from kiln.workers.select import by_rule
from tests.gemm_helpers import aot_graphs, as_fake_cuda
from tests.targets import SM90

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


def problem(dtype: str = "float32", tf32: bool = False, m: int = 4096, k: int = 1024
            ) -> GemmProblem:
    return GemmProblem("mm", 1, m, 4096, k, dtype, dtype, dtype, (0, k, 1), (0, 1, k), True,
                       tf32)


def test_only_fp32_ieee_on_hopper_is_ruled() -> None:
    ampere = {**SM90, "arch": 80}
    assert library_only(problem(), SM90)
    assert [c.kind for c in candidates(problem(), SM90)] == [EXTERN]
    assert library_only(problem(m=256, k=1024), SM90)  # 2^30 multiply-adds
    for p, target in ((problem(tf32=True), SM90), (problem("float16"), SM90),
                      (problem("bfloat16"), SM90), (problem(), ampere),
                      (problem(m=128), SM90),  # 2^29 multiply-adds: an epilogue may pay
                      (problem(m=65536, k=256), SM90)):  # short K: so may a round trip
        assert not library_only(p, target)
        assert len(candidates(p, target)) > 4
    # Without a target (the tests' forced choices) every template config stays possible.
    assert len(candidates(problem())) > 4
    ruled, rest = by_rule({"a": problem(), "b": problem(tf32=True)}, SM90)
    assert ruled == {"a": library_record()} and list(rest) == ["b"]
    line = describe_choice(problem(), library_record())
    assert line.endswith("chose extern; library only (fp32 IEEE: no template is compiled "
                         "or timed)")


def test_fp32_mlp_step_compiles_no_template_and_times_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """gpu_bench's fp32 MLP training step (smaller: every matmul 2^31 multiply-adds) in
    max-autotune, in process, where a (fake) GPU
    could time candidates: its 2 forward and 3 backward matmuls are library calls chosen
    by rule, the graphs are compiled once (no second pass), and no template compiles."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kcache"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv("KILN_TEST_FAKE_AUTOTUNE", "1")
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.GELU(),
                              torch.nn.Linear(2048, 1024))

    def step(x: torch.Tensor) -> torch.Tensor:
        loss = mlp(x).square().mean()
        loss.backward()
        return loss

    config = KilnConfig.resolve({"farm": "inprocess", "max_autotune": True})
    ruled = 0
    for name, gm, inputs in aot_graphs(step, [torch.randn(1024, 1024)]):  # 2^31 each
        request = build_request(gm, as_fake_cuda(inputs), config, target=dict(SM90))
        cache = KernelCache()
        with trace.capture() as events:
            compiled = compile_inprocess(request.to_bytes(), compute_key(request).key,
                                         cache=cache)
        spans = [e["name"] for e in events]
        compiles = [e["args"].get("kernel", "") for e in events
                    if e["name"] == "kernel compile"]
        assert "gemm benchmark" not in spans and spans.count("graph stage") <= 1, name
        assert compiles and not [k for k in compiles if k.startswith("triton_tem")], compiles
        assert compiled.stats["gemm_pending"] == {}
        assert compiled.stats["gemm_selection"] == {"problems": 0, "cached": 0,
                                                    "benchmarked": 0, "untuned": 0}
        choices = compiled.stats["gemm_choices"].values()
        assert all(c["kind"] == EXTERN and c["library_only"] for c in choices)
        assert all(GemmProblem.from_dict(c["problem"]).dtype == "float32" for c in choices)
        assert not [k.name for k in compiled.kernels if k.name.startswith("triton_tem")]
        assert cache.compiles == len(compiled.kernels)  # the graph's kernels, nothing else
        assert "torch.mm(" in compiled.wrapper_source or \
            "torch.addmm(" in compiled.wrapper_source
        ruled += len(choices)
    assert ruled == 5


def test_a_graph_whose_winners_are_all_library_calls_is_lowered_once(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp16 matmuls with nothing to time them here (no GPU, no fake): each stays the
    library call, untuned, and the first pass (which lowered them so) is the artifact: no
    second graph stage, the choices recorded as a second pass would record them."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kcache"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.delenv("KILN_TEST_FAKE_AUTOTUNE", raising=False)
    shapes = ((256, 128), (128, 192), (192,))
    trace_args = [torch.randn(s, dtype=torch.float16) for s in shapes]
    gm = trace_aten(lambda x, w, b: torch.relu(torch.addmm(b, x, w)) @ w.t(), trace_args)
    config = KilnConfig.resolve({"farm": "inprocess", "max_autotune": True})
    request = build_request(gm, as_fake_cuda(trace_args), config, target=dict(SM90))
    with trace.capture() as events:
        compiled = compile_inprocess(request.to_bytes(), compute_key(request).key,
                                     cache=KernelCache())
    assert [e["name"] for e in events].count("graph stage") == 1
    assert compiled.stats["gemm_pending"] == {}
    assert compiled.stats["gemm_selection"] == {"problems": 2, "cached": 0,
                                                "benchmarked": 0, "untuned": 2}
    choices = compiled.stats["gemm_choices"]
    assert len(choices) == 2 and all(c["kind"] == EXTERN and c["untuned"]
                                     for c in choices.values())
    assert {(p["m"], p["n"], p["k"]) for p in (c["problem"] for c in choices.values())} == \
        {(256, 192, 128), (256, 128, 192)}
    assert compiled.wrapper_source.count("torch.addmm(") + \
        compiled.wrapper_source.count("torch.mm(") == 2
