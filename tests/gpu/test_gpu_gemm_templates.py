"""The GEMM template on the GPU: every tile config, with and without fused epilogues,
against eager; the real benchmark of a matmul problem; and max-autotune end to end
(choices timed on this GPU, cached in the store, reused by a second model)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kiln.compiler.codegen.triton.templates import gemm_configs, standalone_spec
from kiln.compiler.compiled_graph import load
from kiln.compiler.ir.template import GemmProblem
from tests.gemm_helpers import compile_tuned, config_number
from tests.numerics_cases import rand, tolerance
from tests.triton_interp.helpers import assert_close_to_eager

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
N_CONFIGS = max(len(gemm_configs(GemmProblem("mm", 1, 512, 512, 512, d, d, d, (0, 512, 1),
                                             (0, 512, 1))))
                for d in ("float16", "float32"))


def target() -> dict[str, object]:
    major, minor = torch.cuda.get_device_capability()
    return {"kind": "cuda", "backend": "cuda", "arch": major * 10 + minor, "warp_size": 32}


def gelu_bias_residual(x, w, b, r):  # type: ignore[no-untyped-def]
    return F.gelu(x @ w + b) + r


def run_tuned(fn, args, config: int, options=None):  # type: ignore[no-untyped-def]
    compiled = compile_tuned(fn, args, options or {}, config_number(config),
                             compile_kernels=True, target=target())
    assert any(k.kind == "template" for k in compiled.kernels)
    assert set(compiled.binaries) == {k.name for k in compiled.kernels}
    outs = load(compiled)([a.clone() for a in args])
    refs = fn(*args)
    refs = refs if isinstance(refs, tuple) else (refs,)
    wide = [a.double() for a in args]
    for i, (out, ref) in enumerate(zip(outs, refs)):
        def truth(i: int = i) -> torch.Tensor:
            r = fn(*wide)
            return (r if isinstance(r, tuple) else (r,))[i]

        assert_close_to_eager(out, ref, truth, tolerance(ref.dtype, reduction=True))
    return compiled


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", range(N_CONFIGS))
def test_every_config_with_fused_epilogue(dtype: torch.dtype, config: int) -> None:
    torch.manual_seed(config)
    args = [rand(512, 384, dtype=dtype).cuda(), rand(384, 320, dtype=dtype).cuda(),
            rand(320, dtype=dtype).cuda(), rand(512, 320, dtype=dtype).cuda()]
    compiled = run_tuned(gelu_bias_residual, args, config)
    assert len(compiled.kernels) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("config", range(N_CONFIGS))
def test_every_config_ragged_transposed(dtype: torch.dtype, config: int) -> None:
    torch.manual_seed(100 + config)
    args = [rand(300, 200, dtype=dtype).cuda(), rand(170, 200, dtype=dtype).cuda()]
    run_tuned(lambda x, w: torch.relu(x @ w.t()), args, config)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_bmm_and_tf32(dtype: torch.dtype) -> None:
    args = [rand(6, 96, 64, dtype=dtype).cuda(), rand(6, 64, 80, dtype=dtype).cuda()]
    run_tuned(lambda a, b: torch.sigmoid(torch.bmm(a, b)), args, 0)
    if dtype == torch.float32:
        x, w = rand(256, 256).cuda(), rand(256, 256).cuda()
        compiled = compile_tuned(lambda x, w: x @ w, [x, w], {"allow_tf32": True},
                                 config_number(0), compile_kernels=True, target=target())
        out = load(compiled)([x, w])[0]
        torch.testing.assert_close(out, x @ w, atol=1e-1, rtol=1e-2)  # TF32: 10-bit mantissa


@pytest.mark.gpu
def test_real_benchmark_times_every_candidate() -> None:
    from kiln.compiler.kernel_compile import compile_kernel
    from kiln.workers.autotune import benchmark_gemm

    p = GemmProblem("mm", 1, 2048, 2048, 2048, "float16", "float16", "float16",
                    (0, 2048, 1), (0, 2048, 1), epilogue=True)
    specs = [standalone_spec(p, c, f"tem_bench_{i}") for i, c in enumerate(gemm_configs(p))]
    binaries = [compile_kernel(s, s.configs[0], target()) for s in specs]
    timings = benchmark_gemm(p, specs, list(binaries))
    assert 0 < timings["extern_ms"] < 10 and 0 < timings["round_trip_ms"] < 1
    assert len(timings["template_ms"]) == len(specs)
    assert all(math.isfinite(t) and t > 0 for t in timings["template_ms"])


CLIENT_MODELS = {
    "a": gelu_bias_residual,
    "b": lambda x, w, b, r: torch.tanh(torch.addmm(b, x, w)) * r,
}


@pytest.mark.gpu
def test_max_autotune_end_to_end_second_model_benchmarks_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.compiler.decompositions import trace_aten
    from kiln.frontend.config import KilnConfig
    from kiln.frontend.core.client import KilnClient
    from kiln.frontend.core.compile import build_request

    for name, value in (("KILN_FARM", "inprocess"), ("KILN_STORE", str(tmp_path / "store")),
                        ("KILN_LOCAL_CACHE", "off"), ("KILN_STATS_FILE", "off")):
        monkeypatch.setenv(name, value)
    args = [rand(1024, 768, dtype=torch.float16).cuda(),
            rand(768, 1024, dtype=torch.float16).cuda(),
            rand(1024, dtype=torch.float16).cuda(), rand(1024, 1024, dtype=torch.float16).cuda()]
    seen = []
    for name, fn in CLIENT_MODELS.items():
        config = KilnConfig.resolve().with_mode("max-autotune")
        gm = trace_aten(fn, args)
        result = KilnClient(config).compile(build_request(gm, args, config), name)
        out = load(result.compiled, {}, args[0].device)([a.clone() for a in args])[0]
        wide = [a.double() for a in args]
        assert_close_to_eager(out, fn(*args), lambda fn=fn, wide=wide: fn(*wide),
                              tolerance(torch.float16, reduction=True))
        seen.append(result.compiled.stats["gemm_selection"])
        choice = next(iter(result.compiled.stats["gemm_choices"].values()))
        assert len(choice["timings"]) > 4, name
    assert seen[0]["benchmarked"] == 1 and seen[1] == {
        "problems": 1, "cached": 1, "benchmarked": 0, "untuned": 0}
