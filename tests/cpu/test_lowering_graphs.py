"""Whole graphs: extern kernels mixed with loops, eager fallbacks, random ops, input
mutation as AOTAutograd leaves it, and graphs Kiln must refuse with a clear error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._functorch.aot_autograd import aot_function, make_boxed_func

from kiln.compiler.decompositions import kiln_decompositions, trace_aten
from kiln.compiler.driver import lower_and_schedule
from kiln.compiler.errors import LoweringError, MalformedGraphError
from kiln.compiler.interpreter import run_graph
from kiln.compiler.ir.extern import ExternKernel, FallbackKernel

Draw = Callable[..., torch.Tensor]


def _kinds(sg: Any) -> list[str]:
    return [type(b).__name__ for b in sg.graph.buffers]


# -- extern kernels -------------------------------------------------------------------

EXTERN: dict[str, tuple[Callable[..., Any], list[tuple[int, ...]]]] = {
    "mm_relu": (lambda a, b: torch.relu(a @ b) * 2, [(6, 8), (8, 5)]),
    "mm_transposed_inputs": (lambda a, b: (a.t() @ b.t()).sum(1), [(8, 6), (5, 8)]),
    "addmm_scaled": (lambda c, a, b: torch.addmm(c, a, b, beta=0.5, alpha=2.0).tanh(),
                     [(5,), (6, 8), (8, 5)]),
    "addmm_2d_bias": (lambda c, a, b: torch.addmm(c, a, b) + c, [(6, 5), (6, 8), (8, 5)]),
    "linear_3d": (lambda x, w, b: torch.sigmoid(F.linear(x, w, b)), [(3, 4, 8), (5, 8), (5,)]),
    "bmm": (lambda a, b: torch.bmm(a.exp(), b) + 1, [(2, 3, 4), (2, 4, 5)]),
    "baddbmm": (lambda c, a, b: torch.baddbmm(c, a, b, beta=2.0, alpha=0.5),
                [(3, 5), (2, 3, 4), (2, 4, 5)]),
    "matmul_broadcast": (lambda a, b: torch.softmax(a @ b, -1), [(2, 3, 4), (4, 5)]),
    "conv2d_bias_relu": (lambda x, w, b: F.relu(F.conv2d(x, w, b, padding=1)),
                         [(2, 3, 8, 8), (4, 3, 3, 3), (4,)]),
    "conv2d_strided_grouped": (lambda x, w: F.conv2d(x * 2, w, stride=2, groups=2) + 1,
                               [(1, 4, 7, 7), (6, 2, 3, 3)]),
}


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", EXTERN)
def test_extern_kernel_with_pointwise(name: str, dtype: torch.dtype, draw: Draw,
                                      check_lowering: Any) -> None:
    fn, shapes = EXTERN[name]
    sg = check_lowering(fn, *[draw(s, dtype) for s in shapes], reduction=True)
    assert any(type(b) is ExternKernel for b in sg.graph.buffers), _kinds(sg)


# -- chains: views of realized buffers, reshapes of lazy transposes, indexing into loops ---


def _views_of_a_realized_buffer(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = a.exp()
    s0, s1 = x.sum(0), x.sum(1)  # two reductions read x: it is realized
    return x.t()[::2].reshape(-1) * 2, s0, s1, x[1:, ::2].permute(1, 0).reshape(2, -1)


def _reshape_of_a_lazy_transpose(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = (a.t() * 2).reshape(6, 20)
    return (x - x.amax(1, keepdim=True)).exp().sum(1), x[:, 3:17:3]


def _matmul_then_views(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    c = a @ b
    return c.t().contiguous().view(-1)[::3], torch.softmax(c, 0).t()


def _expand_reshape_reduce(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
    y = a.unsqueeze(0).expand(3, 8, 15).reshape(24, 15)
    return y.sum(0), y * y.mean(1, keepdim=True)


def _pad_cat_flip(a: torch.Tensor) -> torch.Tensor:
    p = F.pad(a, (1, 1))
    return torch.cat([p, p.flip(1)], 0).reshape(-1, 4)[:, 1::2].sum(1)


def _index_into_loops(a: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x, i = a.exp(), torch.tensor([0, -1, 3, 3, 7])
    return x[i].sum(1), x.t()[i] * 2, x.sum()


CHAINS: dict[str, Callable[..., Any]] = {
    "views_of_a_realized_buffer": _views_of_a_realized_buffer,
    "reshape_of_a_lazy_transpose": _reshape_of_a_lazy_transpose,
    "matmul_then_views": _matmul_then_views,
    "expand_reshape_reduce": _expand_reshape_reduce,
    "pad_cat_flip": _pad_cat_flip,
    "index_into_loops": _index_into_loops,
}


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=["float32", "float16"])
@pytest.mark.parametrize("name", CHAINS)
def test_chains_of_views_reductions_and_loops(name: str, dtype: torch.dtype, draw: Draw,
                                              check_lowering: Any) -> None:
    fn = CHAINS[name]
    extra = [draw((15, 6), dtype)] if name == "matmul_then_views" else []
    for a in (draw((8, 15), dtype), draw((15, 8), dtype).t(), draw((16, 15), dtype)[::2]):
        check_lowering(fn, a, *extra, reduction=True)


# -- fallbacks: ops with no lowering run eagerly --------------------------------------

FALLBACKS: dict[str, Callable[..., Any]] = {
    "cummax": lambda x: torch.cummax(x * 2, 1)[0] + 1,
    "cumprod_transposed_int": lambda x: torch.cumprod(x.t().to(torch.int32), 0),
    "sort": lambda x: torch.sort(x + 1, dim=-1),
    "sort_values_then_exp": lambda x: torch.sort(x.t(), 0, descending=True)[0].exp(),
    "topk": lambda x: torch.topk(x, 2, dim=1),
    "topk_indices_then_add": lambda x: torch.topk(x * x, 3)[1] + 1,
    "cumprod_of_view": lambda x: torch.cumprod(x[:, 1::2] * 0.5, 1),
}


@pytest.mark.parametrize("name", FALLBACKS)
def test_op_without_lowering_falls_back(name: str, draw: Draw, check_lowering: Any) -> None:
    sg = check_lowering(FALLBACKS[name], draw((5, 6), torch.float32),
                        allow_fallback=("aten.cummax", "aten.cumprod", "aten.sort", "aten.topk"))
    assert any(isinstance(b, FallbackKernel) for b in sg.graph.buffers), _kinds(sg)


@pytest.mark.parametrize("p", [0.3, 0.5])
def test_dropout_matches_eager_under_the_same_seed(p: float, draw: Draw,
                                                   compile_graph: Any) -> None:
    """Random ops stay eager (a FallbackKernel), so the random stream is eager's exactly.

    Eager dropout fills ``empty_like(x)`` in place with ``bernoulli_``, in memory order:
    for a transposed ``x`` the mask is only eager's if the empty buffer has eager's
    strides. The trace is not functionalized here: functionalization turns ``bernoulli_``
    into ``bernoulli``, whose result is contiguous, and no compiler could then match.
    """

    def fn(x: torch.Tensor) -> list[torch.Tensor]:
        return [F.dropout(x, p, training=True) * 2, F.dropout(x.t(), p) + 1]

    x = draw((8, 9), torch.float32)
    sg = compile_graph(fn, [x], functionalize=False)
    assert any(isinstance(b, FallbackKernel) for b in sg.graph.buffers), _kinds(sg)
    torch.manual_seed(1234)
    expected = fn(x)
    torch.manual_seed(1234)
    actual = run_graph(sg.graph, [x])
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    assert not torch.equal(expected[0], fn(x)[0]), "dropout drew the same mask twice"


# -- input mutation, as AOTAutograd leaves it (copy_ into the input) ------------------


def _aot_inference_graph(fn: Callable[..., Any], args: list[torch.Tensor]
                         ) -> torch.fx.GraphModule:
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return make_boxed_func(gm)

    compiled = aot_function(fn, capture, decompositions=kiln_decompositions(),
                            keep_inference_input_mutations=True)
    compiled(*[a.clone() for a in args])
    (gm,) = graphs
    return gm


def _batch_norm_train(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor,
                      w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.batch_norm(x, mean, var, w, b, training=True, momentum=0.1)


def _read_then_mutate(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    z = x * 3  # must read x before the add_ overwrites it
    x.add_(y)
    return z + x


MUTATIONS: dict[str, tuple[Callable[..., Any], list[tuple[int, ...]]]] = {
    "add_": (lambda x, y: x.add_(1).mul(y), [(3, 4), (3, 4)]),
    "two_inputs": (lambda x, y: (x.mul_(2), y.sub_(x[0]))[1].sum(), [(3, 4), (4,)]),
    "read_then_mutate": (_read_then_mutate, [(3, 4), (3, 4)]),
    "slice_of_input": (lambda x: x[1:, ::2].add_(5).sum(), [(4, 6)]),
    "transposed_view": (lambda x: x.t().mul_(3).exp(), [(4, 5)]),
    "batch_norm_running_stats": (_batch_norm_train, [(4, 3, 5), (3,), (3,), (3,), (3,)]),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_input_mutation_updates_the_input_in_place(name: str, draw: Draw,
                                                   assert_same: Any) -> None:
    fn, shapes = MUTATIONS[name]
    args = [draw(s, torch.float32).abs() + 0.5 for s in shapes]
    gm = _aot_inference_graph(fn, args)
    assert any(n.target is torch.ops.aten.copy_.default for n in gm.graph.nodes), gm.code
    eager_args = [a.clone() for a in args]
    expected = fn(*eager_args)
    sg = lower_and_schedule(gm, args, name=name)
    kiln_args = [a.clone() for a in args]
    storages = [a.data_ptr() for a in kiln_args]
    actual = run_graph(sg.graph, kiln_args)
    assert_same(actual, [expected], reduction=True)
    assert_same(kiln_args, eager_args, reduction=True)  # mutated inputs, in place
    assert [a.data_ptr() for a in kiln_args] == storages
    assert sg.graph.mutated_inputs, "no buffer writes into an input"


def test_output_read_by_two_reductions_keeps_eager_strides(draw: Draw,
                                                            check_lowering: Any) -> None:
    """``y`` is realized when lowered (two reductions read it), before it is an output,
    and still comes back with eager's (transposed) strides."""

    def fn(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        y = x.t() * 2
        return y, y.sum(0), y.sum(1)

    check_lowering(fn, draw((5, 4), torch.float32), reduction=True)


# -- graphs Kiln must refuse ------------------------------------------------------------


def _graph_with(insert: Callable[[torch.fx.GraphModule, torch.fx.Node], torch.fx.Node]
                ) -> torch.fx.GraphModule:
    """The graph of ``x + 1`` with a node inserted after the add and returned."""
    gm = trace_aten(lambda x: x + 1, [torch.randn(3)])
    add = next(n for n in gm.graph.nodes if n.op == "call_function")
    with gm.graph.inserting_after(add):
        bad = insert(gm, add)
    gm.graph.output_node().args = ((bad,),)
    gm.recompile()
    return gm


def _call_module(gm: torch.fx.GraphModule, arg: torch.fx.Node) -> torch.fx.Node:
    gm.add_submodule("act", torch.nn.ReLU())
    return gm.graph.call_module("act", (arg,))


MALFORMED: dict[str, tuple[Callable[..., torch.fx.Node], str, str]] = {
    # name: (insert the bad node, its node name, what the message names as the op)
    "print": (lambda gm, a: gm.graph.call_function(print, (a,)), "print_1", "print"),
    "python_function": (lambda gm, a: gm.graph.call_function(torch.sigmoid, (a,)), "sigmoid",
                        "sigmoid"),
    "call_module": (_call_module, "act", "call_module"),
    "call_method": (lambda gm, a: gm.graph.call_method("relu", (a,)), "relu", "relu"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_malformed_graph_names_the_node_and_the_op(name: str) -> None:
    insert, node_name, op = MALFORMED[name]
    gm = _graph_with(insert)
    with pytest.raises((LoweringError, MalformedGraphError)) as info:
        lower_and_schedule(gm, [torch.randn(3)], name="bad_graph")
    message = str(info.value)
    assert f"node {node_name}" in message and op in message, message
    assert "bad_graph" in message, message
