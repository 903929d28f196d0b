"""Triton output code and the backend, run under Triton's interpreter on CPU tensors."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from kiln.compiler.compiled_graph import load
from kiln.compiler.runtime import triton_launcher
from tests.models import Block, assert_training_step_matches, mlp
from tests.numerics_cases import rand
from tests.triton_interp.helpers import assert_matches_eager, compile_fn

OPTIONS = {"cpu_backend": "triton-interpret"}


def seed_fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return ((a + b) * c.relu()).sum(dim=-1)


def test_seed_golden_output_code() -> None:
    args = [rand(64, 128) for _ in range(3)]
    compiled = assert_matches_eager(seed_fn, args, {"atol": 1e-4, "rtol": 1e-4})
    assert [k.name for k in compiled.kernels] == ["triton_per_fused_add_mul_relu_sum_0"]
    kernel = compiled.kernels[0].source
    assert len(re.findall(r"tl\.load\(in_ptr\d", kernel)) == 3
    assert "tl.sum(" in kernel and kernel.count("tl.store(") == 1
    lines = [ln.strip() for ln in compiled.wrapper_source.splitlines()]
    body = lines[lines.index("args.clear()") + 1:]
    assert body == [
        "buf0 = empty_strided((64,), (1,), device=DEVICE, dtype=torch.float32)",
        "triton_per_fused_add_mul_relu_sum_0.run(arg0_1, arg1_1, arg2_1, buf0)",
        "del arg0_1", "del arg1_1", "del arg2_1", "return (buf0, )",
    ]


def test_looped_reduction_and_persistent_names() -> None:
    small = compile_fn(lambda x: torch.softmax(x, -1), [rand(8, 100)])
    big = compile_fn(lambda x: torch.softmax(x, -1), [rand(2, 6000)])
    assert small.kernels[0].name.startswith("triton_per_fused_")
    assert big.kernels[0].name.startswith("triton_red_fused_")
    assert big.kernels[0].source.count("for roffset in range(0, rnumel, RBLOCK):") == 3
    assert "RBLOCK" in big.kernels[0].source and "rmask" in big.kernels[0].source


def test_welford_in_looped_layer_norm() -> None:
    x, w, b = rand(3, 5000), rand(5000), rand(5000)
    compiled = assert_matches_eager(lambda x, w, b: F.layer_norm(x, (5000,), w, b), [x, w, b],
                                    {"atol": 1e-4, "rtol": 1e-4})
    assert "th.welford_step(" in compiled.kernels[0].source
    assert "th.welford(" in compiled.kernels[0].source


def test_pointwise_chain_one_kernel_with_masks_and_configs() -> None:
    compiled = compile_fn(lambda a, b: (a.exp() + b).tanh() * 2, [rand(33, 65), rand(65)])
    (spec,) = compiled.kernels
    assert spec.name.startswith("triton_poi_fused_") and "xmask" in spec.source
    assert len(spec.configs) >= 3
    assert all({"XBLOCK", "num_warps", "num_stages"} <= set(c) for c in spec.configs)


def test_second_call_compiles_and_imports_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    args = [rand(64, 128) for _ in range(3)]
    call = load(compile_fn(seed_fn, args))
    first = call([a.clone() for a in args])[0]

    def fail(*a: object, **k: object) -> None:
        raise AssertionError("compiled again on a second call")

    monkeypatch.setattr(triton_launcher, "import_source", fail)
    monkeypatch.setattr("kiln.compiler.kernel_compile.compile_kernel", fail)
    second = call([a.clone() for a in args])[0]
    torch.testing.assert_close(first, second)


def test_fallback_op_runs_correctly() -> None:
    fn = lambda a: torch.cumprod(a.exp(), 1) * 2  # noqa: E731
    compiled = assert_matches_eager(fn, [rand(9, 13)], {"atol": 1e-5, "rtol": 1e-4})
    assert "torch.ops.aten.cumprod.default(" in compiled.wrapper_source


@pytest.mark.parametrize("make, shape", [(mlp, (8, 32)), (Block, (2, 8, 32))],
                         ids=["mlp", "block"])
def test_training_step_matches_eager(make: type, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    assert_training_step_matches(make(), torch.randn(*shape), {"atol": 1e-5, "rtol": 1e-4},
                                 OPTIONS)


def test_kernel_compile_failure_falls_back_to_eager_with_one_warning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.compiler.codegen.cpp import build

    def broken(spec: object, target: object) -> None:
        raise RuntimeError("g++: internal compiler error (injected)")

    monkeypatch.setattr(build, "compile_cpp", broken)
    torch._dynamo.reset()
    model = nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(model, backend="kiln", dynamic=False,
                            options={"cpu_backend": "cpp"})(x)
    kiln = [w for w in caught if "kiln" in str(w.message)]
    assert len(kiln) == 1, [str(w.message) for w in kiln]
    message = str(kiln[0].message)
    assert "kernel cpp_fused_" in message and "graph forward" in message, message
    assert "graph key " in message, message
    assert "kernel source: " in message and "injected" in message, message
    torch.testing.assert_close(out, model(x))


def _adam_like(*flat: torch.Tensor) -> list[torch.Tensor]:
    """An optimizer step's list ops over 6 parameters with 0-d step counts, as a compiled
    capturable AdamW traces them."""
    p, g, m, v, steps = (list(flat[i::5]) for i in range(5))
    steps = torch._foreach_add(steps, 1)
    m = torch._foreach_lerp(m, g, 0.1)
    v = torch._foreach_addcmul(torch._foreach_mul(v, 0.999), g, g, 0.001)
    bc = torch._foreach_sub(torch._foreach_pow(0.9, steps), 1)
    p = torch._foreach_addcdiv(p, m, torch._foreach_add(torch._foreach_sqrt(v), 1e-8),
                               0.01)
    return p + m + v + steps + bc


def test_independent_one_element_kernels_are_one_kernel() -> None:
    """Each parameter's update is one kernel; the six 0-d step updates (and their bias
    corrections) share one kernel instead of a launch each."""
    shapes = [(16, 8), (8,), (4, 4), (32,), (2, 3), (5,)]  # one kernel each
    args = [t for s in shapes for t in
            (rand(*s), rand(*s), rand(*s), rand(*s, low=0.1), torch.randint(1, 9, ()).float())]
    compiled = assert_matches_eager(_adam_like, args, {"atol": 1e-5, "rtol": 1e-5})
    scalar = [k for k in compiled.kernels if k.xnumel == 1]
    assert len(scalar) == 1 and len(compiled.kernels) == 6 + 1, \
        [(k.name, k.xnumel) for k in compiled.kernels]
    assert compiled.wrapper_source.count(".run(") == 6 + 1  # launches: 12 before
    # steps + 1 and 0.9 ** steps - 1 for each parameter
    assert scalar[0].source.count("tl.store(") == 12
