"""Dynamic shapes under Triton's interpreter: every lowering family with a symbolic
dimension against eager at sizes 1, 2, a prime and a large one, kernels taking xnumel,
rnumel and sizes as arguments, and the decoder model over 25 shapes."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dynamic_cases import (
    CASES,
    DynamicCase,
    check_conv_net,
    check_pools,
    run_case,
    run_decoder,
)

OPTIONS = {"cpu_backend": "triton-interpret"}


@pytest.fixture(autouse=True)
def _isolated(kiln_isolated: None) -> None:
    """Every test: a fresh store, in process (tests/conftest.py)."""


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_lowering_family_matches_eager_at_every_size(case: DynamicCase) -> None:
    assert run_case(case, OPTIONS) <= 2


def test_kernel_takes_numels_and_sizes_as_arguments() -> None:
    from kiln.frontend.core import compile as kiln_compile

    seen: list[Any] = []
    kiln_compile.observers.append(lambda name, result: seen.append(result))
    fn = lambda x: (x.view(x.shape[0], 4, 8) * 2).sum(-1)  # noqa: E731
    try:
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="kiln", options=OPTIONS)
        for k, n in enumerate((5, 3, 17)):
            x = torch.randn(n, 32)
            if k == 0:
                torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), fn(x), rtol=1e-5, atol=1e-5)
    finally:
        kiln_compile.observers.pop()
    (result,) = seen
    (kernel,) = result.compiled.kernels
    assert kernel.kind == "persistent_reduction"  # a static row of 8 fits one block
    head = kernel.source.split("XBLOCK: tl.constexpr")[0]
    assert "xnumel, rnumel" in head, kernel.source
    assert "xnumel = " not in kernel.source, kernel.source
    assert kernel.size_args[:2] == ("4*s0", "8"), kernel.size_args
    assert "s0 = arg" in result.compiled.wrapper_source


def test_symbolic_row_reduction_is_guarded() -> None:
    """A row of unbounded symbolic length cannot be proved to fit one block: a looped
    kernel, and persistent ones the wrapper picks for short rows at run time."""
    from kiln.frontend.core import compile as kiln_compile

    seen: list[Any] = []
    kiln_compile.observers.append(lambda name, result: seen.append(result))
    try:
        torch._dynamo.reset()
        compiled = torch.compile(lambda x: x.sum(-1), backend="kiln", options=OPTIONS)
        for k, n in enumerate((6, 4099)):
            x = torch.randn(3, n)
            if k == 0:
                torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(compiled(x), x.sum(-1), rtol=1e-4, atol=1e-4)
    finally:
        kiln_compile.observers.pop()
    (result,) = seen
    kinds = sorted(k.kind for k in result.compiled.kernels)
    assert kinds == ["persistent_reduction"] * 5 + ["reduction"], kinds
    wrapper = result.compiled.wrapper_source
    assert "if s0 <= 256:" in wrapper and "elif s0 <= 2048:" in wrapper, wrapper
    rblocks = sorted(k.configs[0]["RBLOCK"] for k in result.compiled.kernels
                     if k.kind == "persistent_reduction")
    assert rblocks == [256, 512, 1024, 2048, 4096], rblocks


def test_decoder_without_fallback() -> None:
    # The interpreter is slow: 2 batch sizes by 2 lengths (tests/cpu runs all 25 shapes);
    # the third call is the first with a symbolic batch and length.
    result = run_decoder(OPTIONS, batches=(2, 3), lengths=(5, 7))
    assert result["asked"] <= 3, result
    assert result["counters"].get("compiles", 0) <= result["asked"], result


def test_a_conv_net_under_dynamic_true_compiles_one_graph_for_every_size() -> None:
    check_conv_net(OPTIONS)


def test_pooling_and_its_backward_with_symbolic_height_and_width() -> None:
    check_pools(OPTIONS)
