"""An HF Llama (grouped-query attention, rotary embeddings, HF's causal mask) with dynamic
shapes compiles for sm_90 on this machine, which has no GPU: traced on fake CUDA tensors
through the kiln backend's path, every ATen graph compiled from its request's bytes and
every kernel built to a cubin, for each way a user makes shapes dynamic. Numerics of
the same kernels run under Triton's interpreter (tests/triton_interp/test_dynamic_hf.py)
and on a GPU (tests/gpu/test_gpu_dynamic_hf.py)."""

from __future__ import annotations

import re

import pytest
import torch

from kiln.compiler.runtime.kernel_files import interpreter_active
from tests.dynamic_hf import (
    ODD_LENGTHS,
    assert_built_for_sm90,
    fake_cuda_model,
    fake_ids,
    hidden_states,
    sm90_graphs,
    tiny_llama,
)

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")

# A product or power printed as a bare divisor: read as (x // a) * b.
_UNPARENTHESIZED_DIVISOR = re.compile(r"(//|%) s\d+\*")


def _llama() -> tuple[torch.nn.Module, object]:
    torch.manual_seed(0)
    return fake_cuda_model(tiny_llama(dtype=torch.bfloat16).eval())


def _check_dynamic(graph: object) -> None:
    assert graph.symbols, graph.name  # type: ignore[attr-defined]
    assert_built_for_sm90(graph)  # type: ignore[arg-type]
    compiled = graph.compiled  # type: ignore[attr-defined]
    assert "s0 = arg" in compiled.wrapper_source
    for spec in compiled.kernels:
        assert not _UNPARENTHESIZED_DIVISOR.search(spec.source), spec.source


def test_dynamic_true_compiles_one_graph_for_sm90() -> None:
    """``dynamic=True``: the rotary half-rotation (a cat of two slices, its loads
    guarded) and the (batch, 1, s, s) causal mask compile; before, the guard's bound
    recursed forever and the graph ran eagerly."""
    model, mode = _llama()
    calls = [[fake_ids(mode, 4, n)] for n in ODD_LENGTHS]
    (graph,) = sm90_graphs(hidden_states(model), calls, dynamic=True)
    _check_dynamic(graph)
    assert len(graph.symbols) == 2  # batch and length
    sources = "\n".join(k.source for k in graph.compiled.kernels)
    assert "tl.cos(" in sources and "tl.sin(" in sources  # the rotary table, fused


def test_automatic_dynamic_after_a_second_length() -> None:
    model, mode = _llama()
    calls = [[fake_ids(mode, 4, n)] for n in (200, 333, 700)]
    static, dynamic = sm90_graphs(hidden_states(model), calls)
    assert not static.symbols
    assert_built_for_sm90(static)
    _check_dynamic(dynamic)
    assert len(dynamic.symbols) == 1  # the length only: the batch never changed


def test_mark_dynamic_on_batch_and_length_together() -> None:
    model, mode = _llama()
    first = fake_ids(mode, 4, 200)
    torch._dynamo.mark_dynamic(first, 0)
    torch._dynamo.mark_dynamic(first, 1)
    calls = [[first], [fake_ids(mode, 3, 333)], [fake_ids(mode, 2, 700)]]
    (graph,) = sm90_graphs(hidden_states(model), calls, dynamic=False)
    _check_dynamic(graph)
    assert len(graph.symbols) == 2
