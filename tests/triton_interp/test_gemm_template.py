"""The Triton GEMM template and its fused epilogues, run under Triton's interpreter on
CPU tensors, against eager over dtypes, layouts and tile configs."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kiln.compiler.codegen.triton.templates import gemm_configs
from kiln.compiler.ir.template import GemmProblem
from tests.gemm_helpers import compile_tuned, config_number
from tests.models import Block, assert_training_step_matches, mlp
from tests.numerics_cases import rand, tolerance
from tests.triton_interp.helpers import assert_close_to_eager, run_compiled

OPTIONS = {"cpu_backend": "triton-interpret"}
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _tol(dtype: torch.dtype) -> dict[str, float]:
    # A K-long dot product rounds differently from eager's blocking: reduction tolerances.
    return tolerance(dtype, reduction=True)


def check(fn, args, pick=config_number(0), template_kernels=1):  # type: ignore[no-untyped-def]
    compiled = compile_tuned(fn, args, OPTIONS, pick)
    names = [k.name for k in compiled.kernels]
    assert sum(n.startswith("triton_tem_fused_") for n in names) == template_kernels, names
    outs = run_compiled(compiled, args)
    refs = fn(*args)
    refs = refs if isinstance(refs, tuple) else (refs,)
    wide = [a.double() if a.is_floating_point() else a for a in args]
    for i, (out, ref) in enumerate(zip(outs, refs)):

        def truth(i: int = i) -> torch.Tensor:
            r = fn(*wide)
            return (r if isinstance(r, tuple) else (r,))[i]

        assert out.shape == ref.shape and out.dtype == ref.dtype
        assert_close_to_eager(out, ref, truth, _tol(ref.dtype))
    return compiled


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_bias_residual_epilogue(dtype: torch.dtype) -> None:
    def fn(x, w, b, r):  # type: ignore[no-untyped-def]
        return F.gelu(x @ w + b) + r

    args = [rand(72, 40, dtype=dtype), rand(40, 48, dtype=dtype), rand(48, dtype=dtype),
            rand(72, 48, dtype=dtype)]
    compiled = check(fn, args)
    assert len(compiled.kernels) == 1  # matmul, bias, gelu and residual in one kernel
    assert compiled.stats["buffers"] == 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", [0, 1, 5])
def test_configs_with_ragged_edges_and_transposed_weight(dtype: torch.dtype,
                                                         config: int) -> None:
    # M, N and K divide no tile: wrapped rows and columns, masked K steps.
    def fn(x, w):  # type: ignore[no-untyped-def]
        return torch.relu(x @ w.t()) * 2

    check(fn, [rand(50, 70, dtype=dtype), rand(36, 70, dtype=dtype)], config_number(config))


@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_with_epilogue(dtype: torch.dtype) -> None:
    def fn(a, b, c):  # type: ignore[no-untyped-def]
        return torch.sigmoid(torch.bmm(a, b)) + c

    check(fn, [rand(3, 20, 24, dtype=dtype), rand(3, 24, 36, dtype=dtype),
               rand(3, 20, 36, dtype=dtype)])


def test_addmm_alpha_beta_and_matrix_bias() -> None:
    def fn(bias, x, w):  # type: ignore[no-untyped-def]
        return torch.addmm(bias, x, w, beta=0.5, alpha=2.0)

    check(fn, [rand(33, 40), rand(33, 24), rand(24, 40)])


def test_prologue_cast_folds_into_the_loads() -> None:
    def fn(x, w):  # type: ignore[no-untyped-def]
        return (x.float() @ w).tanh()

    compiled = check(fn, [rand(40, 32, dtype=torch.float16), rand(32, 24)])
    source = compiled.kernels[0].source
    assert "a = a.to(tl.float32)" in source and len(compiled.kernels) == 1


def test_template_output_used_twice_is_stored_and_reused() -> None:
    def fn(x, w):  # type: ignore[no-untyped-def]
        y = x @ w
        return y.relu(), y.sum(dim=0)

    compiled = check(fn, [rand(30, 20), rand(20, 26)])
    assert len(compiled.kernels) == 2  # the reduction reads the stored product


def test_linear_3d_input_flat_epilogue() -> None:
    lin = torch.nn.Linear(24, 40).half()

    def fn(x, w, b):  # type: ignore[no-untyped-def]
        return F.silu(F.linear(x, w, b))

    check(fn, [rand(2, 9, 24, dtype=torch.float16), lin.weight.detach().clone(),
               lin.bias.detach().clone()])


def test_every_fp16_config_matches_eager() -> None:
    problem = GemmProblem("mm", 1, 64, 96, 80, "float16", "float16", "float16",
                          (0, 80, 1), (0, 96, 1))
    x, w = rand(64, 80, dtype=torch.float16), rand(80, 96, dtype=torch.float16)
    for i in range(len(gemm_configs(problem))):
        check(lambda x, w: x @ w, [x, w], config_number(i))


def test_backend_max_autotune_falls_back_to_extern_without_choices(
        monkeypatch: pytest.MonkeyPatch, tmp_path: object) -> None:
    """``mode="max-autotune"`` through torch.compile on CPU, with no GPU to measure: the
    extern call stays, the result is eager's, and the key differs from the default's."""
    import kiln
    from kiln.frontend.config import KilnConfig
    from kiln.frontend.core.compile import build_request
    from kiln.frontend.core.keys import compute_key

    for name, value in (("KILN_CPU_BACKEND", "triton-interpret"), ("KILN_FARM", "inprocess"),
                        ("KILN_STORE", "memory://gemm-fallback"), ("KILN_LOCAL_CACHE", "off"),
                        ("KILN_STATS_FILE", "off")):
        monkeypatch.setenv(name, value)
    from kiln.frontend.core import compile as frontend_compile

    requests: list[Any] = []
    real_build = frontend_compile.build_request
    monkeypatch.setattr(frontend_compile, "build_request", lambda *a, **k: requests.append(
        real_build(*a, **k)) or requests[-1])
    x, w = rand(16, 8), rand(8, 12)
    fn = torch.compile(lambda x, w: (x @ w).relu(), backend="kiln", mode="max-autotune")
    with warnings.catch_warnings():
        warnings.simplefilter("error", kiln.KilnFallbackWarning)
        out = fn(x, w)
    torch.testing.assert_close(out, (x @ w).relu())
    assert [r.options.get("max_autotune") for r in requests] == [True]
    from kiln.compiler.decompositions import trace_aten

    gm = trace_aten(lambda x, w: x @ w, [x, w])
    plain = build_request(gm, [x, w], KilnConfig.resolve({}))
    tuned = build_request(gm, [x, w], KilnConfig.resolve({}).with_mode("max-autotune"))
    assert tuned.options["max_autotune"] is True
    assert compute_key(plain).key != compute_key(tuned).key


@pytest.mark.parametrize("make, shape", [(mlp, (8, 32)), (Block, (2, 8, 32))],
                         ids=["mlp", "block"])
def test_training_step_under_max_autotune(make: type, shape: tuple[int, ...],
                                          monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    """torch.compile(mode max-autotune) end to end, forward and backward graphs: choices
    made by the fake benchmark (templates win), every matmul a template kernel."""
    from kiln.frontend.core import compile as frontend_compile

    monkeypatch.setenv("KILN_TEST_FAKE_AUTOTUNE", "1")
    results: list[Any] = []
    monkeypatch.setattr(frontend_compile, "observers",
                        [lambda name, result: results.append(result)])
    torch.manual_seed(0)
    options = {**OPTIONS, "max_autotune": True, "farm": "inprocess",
               "store": f"file://{tmp_path}/store", "local_cache": "off"}
    assert_training_step_matches(make(), torch.randn(*shape), {"atol": 1e-4, "rtol": 1e-4},
                                 options)
    assert len(results) == 2  # forward and backward
    for result in results:
        sources = "\n".join(k.source for k in result.compiled.kernels)
        wrapper = result.compiled.wrapper_source
        assert "tl.dot(" in sources and "aten.mm" not in wrapper and "torch.mm(" not in wrapper
        assert result.compiled.stats["gemm_selection"]["problems"] >= 2
