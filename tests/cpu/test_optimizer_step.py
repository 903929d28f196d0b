"""A compiled optimizer step (``torch.compile(opt.step, backend="kiln")``), as the model
suite's training rows run it: every op lowered (core ATen's ``addcmul`` decomposition
leaves ``prims.fma``, defined late by Inductor's prims; with ``foreach=True``, the default
on a GPU, the ``_foreach_*`` list ops of compiler/lowering/foreach.py), weights as
eager's after each step. On fake CUDA tensors: the update of one parameter is one kernel
that reads each of its tensors once."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from kiln import KilnFallbackWarning


@pytest.fixture(autouse=True)
def _isolated(kiln_isolated: None) -> None:
    """Compiles in this process against a fresh store."""


def _params() -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.randn(8))]


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, lr=1e-2),
    # The multi-tensor forms a GPU takes by default: lists of every parameter.
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, foreach=True),
    lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, foreach=True),
], ids=["adamw", "adam", "adamw-foreach", "adam-amsgrad-foreach", "sgd-nesterov-foreach"])
def test_compiled_adam_step_matches_eager_with_no_eager_op(make: Any) -> None:
    from kiln.frontend.core import compile as kiln_compile

    eager = _params()
    compiled = [torch.nn.Parameter(p.detach().clone()) for p in eager]
    opt_eager, opt_kiln = make(eager), make(compiled)
    step = torch.compile(opt_kiln.step, backend="kiln")
    fallbacks: list[dict[str, int]] = []
    observe = lambda name, result: fallbacks.append(result.compiled.stats["fallback_ops"])
    kiln_compile.observers.append(observe)
    try:
        for _ in range(2):
            grads = [torch.randn_like(p) for p in eager]
            for p, q, g in zip(eager, compiled, grads):
                p.grad, q.grad = g, g.clone()
            opt_eager.step()
            with warnings.catch_warnings():
                warnings.simplefilter("error", KilnFallbackWarning)
                step()
            for p, q in zip(eager, compiled):
                torch.testing.assert_close(q.detach(), p.detach(), rtol=1e-5, atol=1e-6)
    finally:
        kiln_compile.observers.remove(observe)
    assert fallbacks, "Kiln compiled no graph"
    assert all(not f for f in fallbacks), f"ops run eagerly in the step: {fallbacks}"


def _list_ops(*flat: torch.Tensor) -> list[torch.Tensor]:
    """An AdamW-like update written with list ops, every overload kind: Scalar, List,
    ScalarList, ScalarAndTensor, a compound op (lerp, addcmul, addcdiv) and unary ops."""
    p, g, m, v = (list(flat[i::4]) for i in range(4))
    scalars = [0.5 + 0.25 * i for i in range(len(p))]
    p = torch._foreach_mul(p, 1 - 1e-3 * 0.01)
    m = torch._foreach_lerp(m, g, 0.1)
    v = torch._foreach_addcmul(torch._foreach_mul(v, 0.999), g, g, 0.001)
    denom = torch._foreach_add(torch._foreach_sqrt(torch._foreach_abs(v)), scalars)
    p = torch._foreach_addcdiv(p, m, denom, -1e-3)
    p = torch._foreach_clamp_min(torch._foreach_sub(p, g, alpha=0.5), -2.0)
    return p + torch._foreach_pow(2.0, torch._foreach_neg(m)) + v


def _list_args(device: str) -> list[torch.Tensor]:
    shapes = [(64, 32), (32,), (8, 64), (8,)]
    return [torch.randn(s, device=device) for s in shapes for _ in range(4)]


def test_list_ops_match_eager() -> None:
    from kiln.compiler.compiled_graph import load
    from kiln.compiler.decompositions import trace_aten

    args = _list_args("cpu")
    compiled = _compile(trace_aten(_list_ops, args), args)
    assert compiled.stats.get("fallback_ops", {}) == {}
    got = load(compiled)([a.clone() for a in args])
    for out, ref in zip(got, _list_ops(*args), strict=True):
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_list_ops_for_a_gpu_are_one_kernel_per_parameter() -> None:
    """Fake CUDA tensors, Triton code: four parameters, four kernels, each reading the
    parameter's four tensors (p, g, m, v) and writing its three results."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kiln.compiler.decompositions import trace_aten

    with FakeTensorMode():
        args = _list_args("cuda")
    compiled = _compile(trace_aten(_list_ops, args), args)
    assert compiled.stats.get("fallback_ops", {}) == {}
    assert [k.backend for k in compiled.kernels] == ["triton"] * 4
    for kernel in compiled.kernels:
        assert len(kernel.arg_buffers) == 4 + 3, kernel.arg_buffers
    assert "_foreach" not in compiled.wrapper_source


def _compile(gm: torch.fx.GraphModule, args: list[torch.Tensor]) -> Any:
    from kiln.compiler.driver import compile_graph

    return compile_graph(gm, args, {}, compile_kernels=args[0].device.type == "cpu")


def test_a_graph_of_list_ops_is_never_cut_into_regions() -> None:
    """Regions would cut each parameter's chain of list ops (about 17 kernels per
    parameter for BERT's AdamW step on the H100); the same ops one tensor at a time are
    cut as usual."""
    from kiln.compiler.decompositions import trace_aten
    from kiln.frontend.config import KilnConfig
    from kiln.frontend.core.regions import region_nodes, wanted

    args = _list_args("cpu")
    config = KilnConfig.resolve({"regions": "on", "region_nodes": 8})
    listed = trace_aten(_list_ops, args)

    def one_at_a_time(*flat: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for i in range(4):
            p, g, m, v = flat[4 * i:4 * i + 4]
            outs += [(p * 0.5 + m.lerp(g, 0.1) / (v.abs().sqrt() + 1.0)).clamp_min(-2.0)]
        return outs

    single = trace_aten(one_at_a_time, args)
    assert len(single.graph.nodes) >= 2 * region_nodes(config)  # large enough to cut
    assert wanted(single, args, config)
    assert not wanted(listed, args, config)
