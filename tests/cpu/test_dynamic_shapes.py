"""Dynamic shapes on the C++ backend: every lowering family with a symbolic dimension
against eager at sizes 1, 2, a prime and a large one; one graph serving every size; the
generated code reading sizes from its inputs; a model over 25 shapes whose second process
compiles nothing."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
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

OPTIONS = {"cpu_backend": "cpp"}


@pytest.fixture(autouse=True)
def _isolated(kiln_isolated: None) -> None:
    """Every test: a fresh store, in process (tests/conftest.py)."""


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_lowering_family_matches_eager_at_every_size(case: DynamicCase) -> None:
    # One static graph for size 1 (Dynamo specializes it), one symbolic graph for the rest.
    assert run_case(case, OPTIONS) <= 2


def _output_code(fn: Any, make: Any, sizes: list[int], dim: int = 0) -> list[Any]:
    """The CompiledGraphs Kiln produced for ``fn`` called at ``sizes``."""
    from kiln.frontend.core import compile as kiln_compile

    seen: list[Any] = []
    kiln_compile.observers.append(lambda name, result: seen.append(result))
    try:
        torch._dynamo.reset()
        compiled = torch.compile(fn, backend="kiln", options=OPTIONS)
        for k, n in enumerate(sizes):
            x = make(n)
            if k == 0:
                torch._dynamo.mark_dynamic(x, dim)
            torch.testing.assert_close(compiled(x), fn(x), rtol=1e-5, atol=1e-5)
    finally:
        kiln_compile.observers.pop()
    return seen


def test_kernels_take_sizes_as_arguments() -> None:
    fn = lambda x: torch.softmax(x * 3, -1)  # noqa: E731
    (result,) = _output_code(fn, lambda n: torch.randn(6, n), [37, 5, 211], dim=1)
    wrapper = result.compiled.wrapper_source
    assert "s0 = arg0_1" in wrapper or "s0 = arg1_1.size(1)" in wrapper, wrapper
    body = wrapper.split("def call")[1]
    assert not re.search(r"\b37\b", body) and "(6, s0)" in body, wrapper
    (kernel,) = result.compiled.kernels
    assert "const int64_t s0" in kernel.source, kernel.source
    assert not re.search(r"\b37\b", kernel.source), kernel.source
    assert kernel.size_args == ("s0",)
    assert result.compiled.stats["dynamic"]["symbols"] == {"s0": [2, None]}


_POSITIONS = torch.arange(2048).unsqueeze(0)  # a module's position-id table (BERT's)


def test_slice_of_a_fixed_table_to_a_symbolic_length_is_a_view() -> None:
    """``table[:, :s1]`` of a 2048-wide table: Dynamo guarded ``s1 <= 2048`` when it
    traced the slice to length s1, a bound the symbol's range does not carry. The slice
    is a view read by the kernel, not ATen's slice run eagerly inside the graph."""
    fn = lambda x: x * 2 + _POSITIONS[:, : x.shape[1]]  # noqa: E731
    (result,) = _output_code(fn, lambda n: torch.randn(3, n), [37, 5, 211], dim=1)
    wrapper = result.compiled.wrapper_source
    assert "aten.slice" not in wrapper, wrapper
    assert len(result.compiled.kernels) == 1


def test_strided_slices_of_a_symbolic_dimension_are_views() -> None:
    """``x[:, ::2]`` and ``x[:, 1::2]`` of a symbolic width (a detection model's FPN,
    Swin's patch merging) have ceil(s/2) and floor(s/2) elements: views the kernel
    reads, not ATen's slice run eagerly inside the graph, at odd and even sizes."""
    fn = lambda x: (x[:, ::2] * 2).sum(1) + (x[:, 1::2].exp()).sum(1)  # noqa: E731
    results = _output_code(fn, lambda n: torch.randn(3, n), [37, 6, 211, 2], dim=1)
    (result,) = [r for r in results if r.compiled.stats.get("dynamic")]  # (2: static)
    wrapper = result.compiled.wrapper_source
    assert "aten.slice" not in wrapper and not result.compiled.stats.get("fallback_ops"), \
        (wrapper, result.compiled.stats.get("fallback_ops"))


def test_interleave_of_strided_slices_reshaped_back_is_a_view() -> None:
    """torchvision's ``clip_boxes_to_image``: ``stack((b[..., 0::2], b[..., 1::2]),
    dim=2).reshape(b.shape)``. The stacked size is (s0, (s1 + 1) // 2, 2) and the reshape
    to (s0, s1) is exact only for an even s1, which Dynamo guarded when the stack of two
    halves traced: the reshape is a view, not ATen's view run eagerly inside the graph."""
    def fn(b: torch.Tensor) -> torch.Tensor:
        x, y = b[..., 0::2].clamp(min=0, max=3), b[..., 1::2].clamp(min=-1, max=2)
        return torch.stack((x, y), dim=2).reshape(b.shape) * 2

    results = _output_code(fn, lambda n: torch.randn(5, n) * 4, [8, 4, 212, 36], dim=1)
    (result,) = [r for r in results if r.compiled.stats.get("dynamic")]
    wrapper = result.compiled.wrapper_source
    assert "aten.view" not in wrapper and "aten.reshape" not in wrapper and \
        not result.compiled.stats.get("fallback_ops"), \
        (wrapper, result.compiled.stats.get("fallback_ops"))


def test_equal_sizes_reuse_buffers_only_when_provably_equal() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = (x * 2).sum(-1)           # size s0
        b = (y + 1).sum(-1) * 3       # size s1: never takes a's storage
        return (a.exp() + 1, b.cos())

    torch._dynamo.reset()
    from kiln.frontend.core import compile as kiln_compile

    seen: list[Any] = []
    kiln_compile.observers.append(lambda name, result: seen.append(result))
    try:
        compiled = torch.compile(fn, backend="kiln", options=OPTIONS)
        x, y = torch.randn(9, 4), torch.randn(13, 4)
        torch._dynamo.mark_dynamic(x, 0)
        torch._dynamo.mark_dynamic(y, 0)
        for got, want in zip(compiled(x, y), fn(x, y)):
            torch.testing.assert_close(got, want)
    finally:
        kiln_compile.observers.pop()
    wrapper = seen[-1].compiled.wrapper_source
    for line in wrapper.splitlines():
        if "# reuse" in line:  # a reuse may only join buffers of one symbolic size
            assert "s0" not in line or "s1" not in line, line


def test_model_over_25_shapes_compiles_what_dynamo_asks_and_a_second_process_hits(
        tmp_path: Path) -> None:
    first = run_decoder(OPTIONS)
    counters = first["counters"]
    # Dynamo asks for a static graph first, then one with symbolic batch and length (it
    # marks a dimension dynamic when it sees it change): a few graphs for 25 shapes.
    assert first["asked"] <= 4, first
    assert counters.get("compiles", 0) <= first["asked"], counters
    assert counters.get("graphs", 0) == first["asked"], counters
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-m", "tests.dynamic_cases", json.dumps(OPTIONS)],
                          env=env, capture_output=True, text=True, timeout=600,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    second = json.loads(proc.stdout.strip().splitlines()[-1])
    # Every graph, static and symbolic, comes from the AOT cache: no AOTAutograd trace, no
    # request, no compile.
    served = second["counters"].get("aot_hits", 0)
    assert served == first["asked"] and second["asked"] == 0, second
    assert second["counters"].get("aot_traces", 0) == 0, second
    assert second["keys"] == first["keys"], (first, second)
    assert second["counters"].get("hits", 0) == first["asked"], (first, second)
    assert second["counters"].get("compiles", 0) == 0, second


def test_precompile_a_range_compiles_once_forward_and_backward(tmp_path: Path) -> None:
    """``--shapes 1-64x16`` with training: one forward and one backward graph (the backward
    takes SymInt inputs), both symbolic; a second run finds both in the store."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "KILN_FARM": "inprocess", "KILN_STORE": str(tmp_path / "store"),
           "KILN_LOCAL_CACHE": "off", "XDG_CACHE_HOME": str(tmp_path / "cache"),
           "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests" / "farm")])}
    args = [sys.executable, "-m", "kiln.frontend.cli.main", "precompile", "cli_models:mlp",
            "--shapes", "1-64x16", "--mode", "train", "--option", "cpu_backend=cpp", "--json"]
    runs = []
    for _ in range(2):
        proc = subprocess.run(args, env=env, cwd=root, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "runs eagerly" not in proc.stderr, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0]["graphs"] == runs[0]["misses"] == 2 and runs[0]["eager"] == 0, runs[0]
    assert runs[1]["graphs"] == runs[1]["hits"] == 2 and runs[1]["misses"] == 0, runs[1]


def test_parse_shapes_ranges() -> None:
    from kiln.frontend.cli.targets import parse_shapes

    assert parse_shapes("1-64x128,128") == [((1, 64), 128), (128,)]
    with pytest.raises(Exception, match="dynamic range"):
        parse_shapes("64-1x128")



def test_a_conv_net_under_dynamic_true_compiles_one_graph_for_every_size() -> None:
    check_conv_net(OPTIONS)


def test_pooling_and_its_backward_with_symbolic_height_and_width() -> None:
    check_pools(OPTIONS)
