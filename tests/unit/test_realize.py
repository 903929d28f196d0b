"""Realization: which values become buffers (``register_buffer``) and which stay closures.

The rules are the seed's: outputs are realized; so are inputs of ops that need a real
tensor (extern kernels, fallbacks), values read by several reductions (inlining would
recompute them per reduction), and lazy readers of an input about to be mutated.
Everything else stays a closure inlined into its single consumer.
Also here: bad input (ops with no lowering, malformed graphs).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx

from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import ScheduledGraph, lower_and_schedule
from kiln.compiler.errors import KilnCompileError, LoweringError, MalformedGraphError
from kiln.compiler.graph import GraphLowering
from kiln.compiler.ir.extern import ExternKernel, FallbackKernel, MultiOutput
from kiln.compiler.ir.nodes import ComputedBuffer, Pointwise, Reduction
from kiln.compiler.scheduler import ExternKernelSchedulerNode, SchedulerNode


def compile_fn(fn: Callable[..., Any], *args: torch.Tensor) -> ScheduledGraph:
    return lower_and_schedule(trace_aten(fn, list(args)), list(args))


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def buffer_kinds(sg: ScheduledGraph) -> list[tuple[str, str]]:
    kinds = []
    for buf in sg.graph.buffers:
        kind = type(buf).__name__
        if isinstance(buf, ComputedBuffer):
            kind = type(buf.data).__name__
        kinds.append((buf.get_name(), kind))
    return kinds


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """Every ``register_buffer`` call, as (name given, buffer type)."""
    calls: list[tuple[str, str]] = []
    original = GraphLowering.register_buffer

    def counting(self: GraphLowering, buffer: Any) -> str:
        name = original(self, buffer)
        calls.append((name, type(buffer).__name__))
        return name

    monkeypatch.setattr(GraphLowering, "register_buffer", counting)
    return calls


def seed_fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return ((a + b) * c.relu()).sum(dim=-1)


def test_seed_registers_exactly_one_buffer(registered: list[tuple[str, str]]) -> None:
    sg = compile_fn(seed_fn, rand(64, 128), rand(64, 128), rand(64, 128))
    # add, relu and mul live inside the reduction's closure; only the output is a buffer.
    assert registered == [("buf0", "ComputedBuffer")]
    assert [b.get_name() for b in sg.graph.buffers] == ["buf0"]
    assert isinstance(sg.graph.buffers[0].data, Reduction)
    assert sg.graph.get_output_names() == ["buf0"]
    (node,) = sg.scheduler.nodes
    assert isinstance(node, SchedulerNode)
    assert node.read_writes.read_names() == {"arg0_1", "arg1_1", "arg2_1"}
    assert node.read_writes.write_names() == {"buf0"}
    assert node.is_reduction()


def test_value_read_by_two_reductions_over_different_dims_is_realized() -> None:
    def fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Any:
        y = a * b + c
        return y.sum(0), y.sum(1)

    sg = compile_fn(fn, rand(64, 128), rand(64, 128), rand(64, 128))
    assert buffer_kinds(sg) == [("buf0", "Pointwise"), ("buf1", "Reduction"),
                                ("buf2", "Reduction")]
    nodes = {n.get_name(): n for n in sg.scheduler.nodes for n in n.get_nodes()}
    # Both reductions read the realized y, not the inputs it was computed from.
    assert nodes["buf1"].read_writes.read_names() == {"buf0"}
    assert nodes["buf2"].read_writes.read_names() == {"buf0"}
    assert nodes["buf0"].read_writes.read_names() == {"arg0_1", "arg1_1", "arg2_1"}


def test_value_read_by_two_row_reductions_is_realized() -> None:
    def fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> Any:
        y = a * b + c
        return y.sum(-1), y.amax(-1)

    sg = compile_fn(fn, rand(64, 128), rand(64, 128), rand(64, 128))
    assert buffer_kinds(sg) == [("buf0", "Pointwise"), ("buf1", "Reduction"),
                                ("buf2", "Reduction")]
    assert [b.get_reduction_type() for b in sg.graph.buffers[1:]] == ["sum", "max"]


def test_mm_input_with_several_users_is_realized(registered: list[tuple[str, str]]) -> None:
    def fn(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> Any:
        y = a + b
        return y @ w, y * 2

    sg = compile_fn(fn, rand(64, 128), rand(64, 128), rand(128, 32))
    assert registered == [("buf0", "ComputedBuffer"), ("buf1", "ExternKernel"),
                          ("buf2", "ComputedBuffer")]
    mm = sg.graph.buffers[1]
    assert isinstance(mm, ExternKernel) and mm.input_names() == ["buf0", "arg2_1"]
    # y * 2 reads the realized y instead of recomputing a + b.
    mul = next(n for n in sg.scheduler.nodes for n in n.get_nodes() if n.get_name() == "buf2")
    assert mul.read_writes.read_names() == {"buf0"}


def test_single_user_pointwise_chain_is_never_realized(
        registered: list[tuple[str, str]]) -> None:
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return a.sin().cos().exp() + b * 3 - a.abs()

    sg = compile_fn(fn, rand(64, 128), rand(64, 128))
    assert registered == [("buf0", "ComputedBuffer")]
    assert buffer_kinds(sg) == [("buf0", "Pointwise")]
    (node,) = sg.scheduler.nodes
    assert node.read_writes.read_names() == {"arg0_1", "arg1_1"}


def test_cheap_value_with_two_pointwise_users_is_inlined_into_both() -> None:
    # One read is below the realize-on-reuse threshold: recomputing x + 1 is cheaper than
    # writing and reading it back.
    def fn(x: torch.Tensor) -> Any:
        y = x + 1
        return y.sin(), y.cos()

    sg = compile_fn(fn, rand(64, 128))
    assert buffer_kinds(sg) == [("buf0", "Pointwise"), ("buf1", "Pointwise")]
    for node in sg.scheduler.nodes[0].get_nodes():
        assert node.read_writes.read_names() == {"arg0_1"}


def test_expensive_value_with_two_users_is_realized() -> None:
    # Five reads exceed the threshold of four: the value is written once and read twice.
    def fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, d: torch.Tensor,
           e: torch.Tensor) -> Any:
        y = a + b + c + d + e
        return y.sin(), y.cos()

    sg = compile_fn(fn, *[rand(64, 128) for _ in range(5)])
    assert buffer_kinds(sg) == [("buf0", "Pointwise"), ("buf1", "Pointwise"),
                                ("buf2", "Pointwise")]
    readers = [n for node in sg.scheduler.nodes for n in node.get_nodes()
               if n.get_name() != "buf0"]
    assert [r.read_writes.read_names() for r in readers] == [{"buf0"}, {"buf0"}]


def test_lazy_reader_is_realized_before_the_input_is_mutated() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = x + 1
        x.copy_(y * 2)
        return z * 3

    sg = compile_fn(fn, rand(64, 128), rand(64, 128))
    # z must read x before the copy overwrites it, so it becomes buf0, ahead of the copy.
    assert buffer_kinds(sg) == [("buf0", "Pointwise"), ("buf1", "Pointwise"),
                                ("buf2", "Pointwise")]
    assert sg.graph.buffers[1].get_mutation_names() == ["arg0_1"]
    assert sg.graph.mutated_inputs == {"arg0_1": "buf1"}
    order = [n.get_name() for node in sg.scheduler.nodes for n in node.get_nodes()]
    assert order.index("buf0") < order.index("buf1")


def test_output_is_realized_with_eager_strides() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.t() * 2  # eager keeps the input's transposed layout

    sg = compile_fn(fn, rand(64, 128))
    (buf,) = sg.graph.buffers
    assert [int(s) for s in buf.get_size()] == [128, 64]
    assert [int(s) for s in buf.get_stride()] == [1, 128]


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["cumprod", "sort"])
def test_op_without_lowering_becomes_a_fallback_kernel(op: str) -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        y = x.cumprod(-1) if op == "cumprod" else torch.sort(x, -1)[0]
        return y + 1

    sg = compile_fn(fn, rand(64, 128))
    fallback = sg.graph.buffers[0]
    assert isinstance(fallback, FallbackKernel)
    assert f"aten.{op}." in fallback.kernel_name()
    extern = [n for n in sg.scheduler.nodes if isinstance(n, ExternKernelSchedulerNode)]
    assert [n.node for n in extern] == [fallback]
    # The fallback is a fusion barrier; the pointwise consumer is its own kernel.
    assert len(sg.scheduler.nodes) == 2
    assert isinstance(sg.scheduler.nodes[1].node.data, Pointwise)  # type: ignore[attr-defined]


def test_multi_output_fallback_whose_outputs_are_graph_outputs_is_kept() -> None:
    def fn(x: torch.Tensor) -> Any:
        return torch.sort(x, -1)

    sg = compile_fn(fn, rand(64, 128))
    kinds = [type(b).__name__ for b in sg.graph.buffers]
    assert kinds == ["FallbackKernel", "MultiOutput", "MultiOutput"]
    assert sg.graph.get_output_names() == ["buf1", "buf2"]
    # The node computing buf1 and buf2 is not dead code even though nobody reads "buf0".
    (node,) = sg.scheduler.nodes
    assert node.get_name() == "buf0"
    assert node.get_buffer_names() == {"buf0", "buf1", "buf2"}
    assert all(isinstance(b, MultiOutput) and b.parent is node.node
               for b in sg.graph.buffers[1:])


def _graph_with(node_op: str, target: Any, node_name: str) -> fx.GraphModule:
    root = torch.nn.Module()
    root.lin = torch.nn.Linear(4, 4)
    g = fx.Graph()
    x = g.placeholder("arg0_1")
    y = g.create_node(node_op, target, (x,), {}, name=node_name)
    g.output(y)
    return fx.GraphModule(root, g)


def test_non_aten_call_function_names_node_and_op() -> None:
    def add_one(t: torch.Tensor) -> torch.Tensor:
        return t + 1

    gm = _graph_with("call_function", add_one, "my_add_one")
    with pytest.raises(MalformedGraphError) as info:
        lower_and_schedule(gm, [rand(4)])
    msg = str(info.value)
    assert "node my_add_one" in msg and "add_one" in info.value.op and info.value.op in msg
    assert "stage graph check" in msg


def test_python_lambda_target_names_node_and_op() -> None:
    gm = _graph_with("call_function", lambda t: t + 1, "lam")
    with pytest.raises(KilnCompileError) as info:
        lower_and_schedule(gm, [rand(4)])
    msg = str(info.value)
    assert "node lam" in msg and "<lambda>" in msg


def test_call_module_names_node_and_module() -> None:
    gm = _graph_with("call_module", "lin", "my_linear")
    with pytest.raises(MalformedGraphError) as info:
        lower_and_schedule(gm, [rand(4)])
    msg = str(info.value)
    assert "node my_linear" in msg and "call_module lin" in msg


def test_failing_lowering_names_node_and_op() -> None:
    gm = trace_aten(lambda x: x.view(4, 16), [rand(64)])
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    node.args = (node.args[0], [3, 5])  # now impossible for 64 elements
    gm.recompile()
    with pytest.raises(LoweringError) as info:
        lower_and_schedule(gm, [rand(64)])
    assert f"node {node.name}" in str(info.value)
    assert "aten.view" in str(info.value)
