"""The scatter family on CPU: every case against eager through the IR interpreter and
through C++ kernels (atomic updates from OpenMP threads), the order of a scatter after
its target's other readers, the kernels it makes, and the deterministic fallback."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from kiln.compiler.compiled_graph import load
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph, lower_and_schedule
from kiln.compiler.interpreter import run_graph
from kiln.compiler.ir.extern import FallbackKernel
from kiln.compiler.ir.nodes import ComputedBuffer, Scatter
from tests.models import assert_training_step_matches
from tests.numerics_cases import rand
from tests.scatter_cases import (
    SCATTER_CASES,
    assert_case_matches,
    expand_scatter_cases,
    flat_outputs,
    scatter_case_id,
)

CASES = expand_scatter_cases()


def _scatters(graph: Any) -> list[ComputedBuffer]:
    return [b for b in graph.buffers if isinstance(b, ComputedBuffer)
            and isinstance(b.data, Scatter)]


@pytest.mark.parametrize("item", CASES, ids=[scatter_case_id(c) for c in CASES])
def test_interpreter_matches_eager(item: Any) -> None:
    case, dtype = item
    args = case.inputs(dtype)
    sg = lower_and_schedule(trace_aten(lambda *a: flat_outputs(case.fn(*a)), args), args)
    assert _scatters(sg.graph), "no Scatter node: the op fell back"
    assert not any(isinstance(b, FallbackKernel) for b in sg.graph.buffers)
    assert_case_matches(case, args, run_graph(sg.graph, args), dtype)


@pytest.mark.parametrize("item", CASES, ids=[scatter_case_id(c) for c in CASES])
def test_cpp_matches_eager(item: Any) -> None:
    case, dtype = item
    args = case.inputs(dtype)
    gm = trace_aten(lambda *a: flat_outputs(case.fn(*a)), args)
    compiled = compile_graph(gm, args, {}, name=case.name)
    assert_case_matches(case, args, list(load(compiled)([a.clone() for a in args])), dtype)
    assert "aten." not in compiled.wrapper_source  # no op ran as ATen's kernel
    if case.name != "as_strided_scatter":  # a plain store: the window's elements are unique
        assert any("kiln_atomic_" in k.source or "scatter" in k.name for k in compiled.kernels)


def test_cpp_atomic_add_under_threads() -> None:
    """Enough work for OpenMP threads, few rows: many threads add into the same row."""
    x, idx, v = rand(4, 256), torch.randint(0, 4, (4096,)), rand(4096, 256)
    fn = lambda x, i, v: torch.index_put(x, (i,), v, accumulate=True)  # noqa: E731
    compiled = compile_graph(trace_aten(fn, [x, idx, v]), [x, idx, v], {})
    scatter = next(k for k in compiled.kernels if "kiln_atomic_add<float>" in k.source)
    assert "#pragma omp parallel for" in scatter.source and "simd" not in scatter.source
    out = load(compiled)([x.clone(), idx, v])[0]
    torch.testing.assert_close(out, fn(x, idx, v), atol=1e-3, rtol=1e-4)


def test_kernels_of_a_scatter() -> None:
    """Target copy, scatter (its value's producer fused in), consumer: three kernels."""
    case = next(c for c in SCATTER_CASES if c.name == "index_put_accumulate")
    args = case.inputs(torch.float32)
    sg = lower_and_schedule(trace_aten(case.fn, args), args)
    assert sg.scheduler.kernel_count() == 3, sg.scheduler.debug_str()
    exp_node = next(n for n in sg.scheduler.nodes if "exp" in n.read_writes.op_names)
    assert "scatter_add" in exp_node.read_writes.op_names


def test_scatter_runs_after_other_readers_of_its_target() -> None:
    case = next(c for c in SCATTER_CASES if c.name == "target_read_twice")
    args = case.inputs(torch.float32)
    sg = lower_and_schedule(trace_aten(lambda *a: list(case.fn(*a)), args), args)
    (scatter,) = _scatters(sg.graph)
    order = [n.get_name() for n in sg.scheduler.nodes]
    target = scatter.layout.target  # type: ignore[union-attr]
    writer = next(i for i, n in enumerate(sg.scheduler.nodes) if target in n.get_names())
    at = next(i for i, n in enumerate(sg.scheduler.nodes) if scatter.get_name() in n.get_names())
    assert writer < at, order
    assert scatter.get_name() not in sg.scheduler.nodes[writer].get_names()


@pytest.mark.parametrize("how", ["option", "torch"])
def test_deterministic_uses_aten(how: str) -> None:
    case = next(c for c in SCATTER_CASES if c.name == "index_put_accumulate")
    args = case.inputs(torch.float32)
    gm = trace_aten(case.fn, args)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        if how == "torch":
            torch.use_deterministic_algorithms(True)
        options = {"deterministic": True} if how == "option" else {}
        sg = lower_and_schedule(gm, args, options=options)
    finally:
        torch.use_deterministic_algorithms(before)
    assert not _scatters(sg.graph)
    kinds = [b.op_overload for b in sg.graph.buffers if isinstance(b, FallbackKernel)]
    assert kinds == [torch.ops.aten.index_put.default]
    # Integer sums are exact in any order: they keep the atomic kernel.
    ints = [rand(10, 6, dtype=torch.int64), torch.randint(0, 10, (15,)),
            rand(15, 6, dtype=torch.int64)]
    sg = lower_and_schedule(trace_aten(lambda x, i, s: x.index_add(0, i, s), ints), ints,
                            options={"deterministic": True})
    assert _scatters(sg.graph)


class _EmbeddingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.proj = nn.Linear(16, 8)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.proj(self.emb(idx)).tanh()


def test_embedding_training_step_matches_eager() -> None:
    torch.manual_seed(0)
    model = _EmbeddingModel()
    idx = torch.randint(0, 50, (6, 20))
    assert_training_step_matches(model, idx, {"atol": 1e-5, "rtol": 1e-4})


@pytest.mark.parametrize("base", ["transposed", "offset", "gaps"])
def test_as_strided_scatter_counts_strides_in_the_inputs_storage(base: str) -> None:
    """Eager's copy has the input's geometry (strides and storage offset), and the window's
    offset counts in it: a transposed input and one starting at row 2 lower to a copy and
    a store; an input with gaps runs ATen's kernel. All match eager."""
    def fn(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        y = {"transposed": lambda: x.t() * 2, "offset": lambda: x[2:],
             "gaps": lambda: x[:, 1:5]}[base]()
        return torch.as_strided_scatter(y, s.exp(), (2, 3), (1, 8), 13) + 1

    args = [rand(8, 6), rand(2, 3)]
    sg = lower_and_schedule(trace_aten(fn, args), args)
    assert bool(_scatters(sg.graph)) == (base != "gaps")
    torch.testing.assert_close(run_graph(sg.graph, args)[0], fn(*args))
    compiled = compile_graph(trace_aten(fn, args), args, {}, name=f"ass_{base}")
    torch.testing.assert_close(load(compiled)([a.clone() for a in args])[0], fn(*args))
