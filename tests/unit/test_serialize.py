"""Round trips of ATen graphs through frontend.core.serialize, checked against the original."""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import msgpack
import pytest
import torch
import torch._dynamo
import torch.nn.functional as F
from functorch.compile import aot_function, make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.frontend.core.serialize import (
    GRAPH_FORMAT_VERSION,
    CompileRequest,
    SerializationError,
    TensorMeta,
    deserialize_graph,
    example_inputs_from_metas,
    make_request,
    placeholder_metas,
    serialize_graph,
)

# ---------------------------------------------------------------------------------------
# Programs to capture: (function, input factory). Inputs that need grad get it in AOT.


def pointwise_sum(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return ((a + b) * c.relu()).sum(dim=-1)


def mlp(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    return F.linear(x, w1, b1).relu() @ w2


def layer_norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, dim=-1)


def cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, target, label_smoothing=0.1)


def scalar_args(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    y = torch.clamp(x, min=None, max=math.inf)
    total = y.sum(dim=[0, 1], keepdim=True, dtype=torch.float64)
    filled = torch.full((4, 6), -1.5, dtype=torch.float32, device="cpu")
    mean = torch.mean(x, dim=[-1], keepdim=False)
    return total, filled + x * 2, mean, F.leaky_relu(x, 0.25), x.to(torch.int32) + 3


def var_mean(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    var, mean = torch.var_mean(x, dim=1, correction=0)
    return var + 1, mean * 2


def constant(x: torch.Tensor) -> torch.Tensor:
    scale = torch.tensor([1.0, -2.0, 0.5, math.inf, 3.0, 0.0])
    return x * scale


def _randn(*shape: int, grad: bool = False) -> torch.Tensor:
    return torch.randn(*shape, requires_grad=grad)


PROGRAMS: dict[str, tuple[Callable[..., Any], Callable[[], list[torch.Tensor]]]] = {
    "pointwise_sum": (pointwise_sum, lambda: [_randn(4, 6, grad=True) for _ in range(3)]),
    "mlp": (
        mlp,
        lambda: [
            _randn(4, 8),
            _randn(16, 8, grad=True),
            _randn(16, grad=True),
            _randn(16, 5, grad=True),
        ],
    ),
    "layer_norm": (
        layer_norm,
        lambda: [_randn(4, 6, grad=True), _randn(6, grad=True), _randn(6, grad=True)],
    ),
    "softmax": (softmax, lambda: [_randn(4, 6, grad=True)]),
    "cross_entropy": (cross_entropy, lambda: [_randn(4, 6, grad=True), torch.randint(0, 6, (4,))]),
    "scalar_args": (scalar_args, lambda: [_randn(4, 6)]),
    "var_mean": (var_mean, lambda: [_randn(4, 6, grad=True)]),
    "constant": (constant, lambda: [_randn(4, 6, grad=True)]),
}


# ---------------------------------------------------------------------------------------
# Capture helpers.


def _sum_outputs(out: Any) -> torch.Tensor:
    leaves = out if isinstance(out, (tuple, list)) else (out,)
    return sum(t.float().sum() for t in leaves if t.requires_grad)  # type: ignore[return-value]


def capture_make_fx(fn: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> list[Any]:
    detached = [x.detach() for x in inputs]
    return [make_fx(fn)(*detached)]


def _run_and_backward(fn: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> None:
    loss = _sum_outputs(fn(*inputs))
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        loss.backward()


def capture_aot(fn: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> list[Any]:
    graphs: list[Any] = []

    def compiler(gm: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    _run_and_backward(aot_function(fn, fw_compiler=compiler, bw_compiler=compiler), inputs)
    return graphs


def capture_dynamo(fn: Callable[..., Any], inputs: Sequence[torch.Tensor]) -> list[Any]:
    graphs: list[Any] = []

    def compiler(gm: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler)
    _run_and_backward(torch.compile(fn, backend=backend, fullgraph=True), inputs)
    torch._dynamo.reset()
    return graphs


CAPTURES = {"make_fx": capture_make_fx, "aot": capture_aot, "dynamo": capture_dynamo}


def check_round_trip(gm: torch.fx.GraphModule, seed: int = 0) -> torch.fx.GraphModule:
    """Serialize, rebuild, and compare on fresh random inputs; returns the rebuilt graph."""
    data = serialize_graph(gm)
    rebuilt = deserialize_graph(data, with_fake_meta=True)
    # Canonical: the rebuilt graph, with new names and no stack traces, encodes the same.
    assert serialize_graph(rebuilt) == data
    originals = [n for n in gm.graph.nodes if n.op != "output"]
    copies = [n for n in rebuilt.graph.nodes if n.op != "output"]
    assert [n.target for n in copies if n.op == "call_function"] == [
        n.target for n in originals if n.op == "call_function"
    ]
    assert [n.name for n in copies if n.op == "placeholder"] == [
        f"arg{i}_1" for i in range(len(placeholder_metas(gm)))
    ]
    for old, new in zip(originals, copies):
        assert_same_meta(old.meta.get("val"), new.meta.get("val"))
    inputs = example_inputs_from_metas(
        placeholder_metas(gm), generator=torch.Generator().manual_seed(seed)
    )
    torch.testing.assert_close(rebuilt(*inputs), gm(*inputs), equal_nan=True)
    return rebuilt


def assert_same_meta(old: Any, new: Any) -> None:
    if isinstance(old, torch.Tensor):
        assert isinstance(new, FakeTensor)
        assert TensorMeta.from_tensor(new) == TensorMeta.from_tensor(old)
    elif isinstance(old, (tuple, list)):
        assert type(new) is type(old) and len(new) == len(old)
        for a, b in zip(old, new):
            assert_same_meta(a, b)
    else:
        assert new == old


# ---------------------------------------------------------------------------------------
# Round trips.


@pytest.mark.parametrize("capture", sorted(CAPTURES))
@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_round_trip(program: str, capture: str) -> None:
    fn, make_inputs = PROGRAMS[program]
    torch.manual_seed(0)
    inputs = make_inputs()
    graphs = CAPTURES[capture](fn, inputs)
    needs_backward = capture != "make_fx" and any(x.requires_grad for x in inputs)
    assert len(graphs) == (2 if needs_backward else 1)
    for i, gm in enumerate(graphs):
        check_round_trip(gm, seed=i)


def _all_args(gm: torch.fx.GraphModule) -> list[Any]:
    """Every argument value in the graph, containers and their items alike."""
    found: list[Any] = []

    def visit(value: Any) -> None:
        found.append(value)
        if isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    for node in gm.graph.nodes:
        visit(list(node.args) + list(node.kwargs.values()))
    return found


def test_scalar_args_graph_covers_every_scalar_kind() -> None:
    (gm,) = capture_make_fx(scalar_args, [torch.randn(4, 6)])
    kinds = {type(a) for a in _all_args(gm)}
    for kind in (int, float, bool, type(None), list, torch.dtype, torch.device):
        assert kind in kinds, kind
    assert any(isinstance(a, float) and math.isinf(a) for a in _all_args(gm))
    check_round_trip(gm)


def test_multi_output_getitem() -> None:
    (gm,) = capture_make_fx(var_mean, [torch.randn(4, 6)])
    rebuilt = check_round_trip(gm)
    getitems = [n for n in rebuilt.graph.nodes if n.target is operator.getitem]
    assert [n.args[1] for n in getitems] == [0, 1]
    (var_mean_node,) = [n for n in rebuilt.graph.nodes if "var_mean" in str(n.target)]
    assert isinstance(var_mean_node.meta["val"], tuple) and len(var_mean_node.meta["val"]) == 2


def test_constant_by_value() -> None:
    (gm,) = capture_make_fx(constant, [torch.randn(4, 6)])
    rebuilt = check_round_trip(gm)
    (attr,) = [n for n in rebuilt.graph.nodes if n.op == "get_attr"]
    assert attr.target == "_tensor_constant0"
    value = getattr(rebuilt, attr.target)
    torch.testing.assert_close(value, torch.tensor([1.0, -2.0, 0.5, math.inf, 3.0, 0.0]))


def _graph_with_constant(value: torch.Tensor) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    const = graph.get_attr("weird_name")
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (x, const)))
    root = torch.nn.Module()
    root.weird_name = value  # type: ignore[assignment]
    return torch.fx.GraphModule(root, graph)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.arange(12.0).reshape(3, 4).t(),  # transposed
        lambda: torch.arange(20.0).reshape(4, 5)[1:, 1:4],  # offset and gaps
        lambda: torch.tensor([1.0, 2.0, 3.0]).expand(4, 3),  # overlapping (stride 0)
        lambda: torch.tensor([[True, False]]).expand(3, 2),
        lambda: torch.tensor(math.nan, dtype=torch.bfloat16),  # 0-d
        lambda: torch.empty(0, 3, dtype=torch.int64),
    ],
)
def test_constant_layouts(make: Callable[[], torch.Tensor]) -> None:
    value = make()
    gm = _graph_with_constant(value)
    rebuilt = deserialize_graph(serialize_graph(gm))
    copy = getattr(rebuilt, "_tensor_constant0")  # noqa: B009 (a Tensor, not a Module)
    assert TensorMeta.from_tensor(copy) == TensorMeta.from_tensor(value)
    torch.testing.assert_close(copy, value, equal_nan=True)
    # Bytes depend on values, not on the layout of unreferenced memory.
    assert serialize_graph(rebuilt) == serialize_graph(gm)


def test_slices_and_python_targets() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    sliced = graph.call_function(operator.getitem, (x, (slice(1, None), slice(None, None, 2))))
    graph.output(graph.call_function(operator.neg, (sliced,)))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    rebuilt = deserialize_graph(serialize_graph(gm))
    x_val = torch.randn(4, 6)
    torch.testing.assert_close(rebuilt(x_val), -x_val[1:, ::2])


def test_a_decoded_graphs_code_is_generated_when_first_asked_for() -> None:
    """The compiler reads a decoded graph's nodes only: its Python code waits for a call
    or ``gm.code`` (a 700-node backward's decode spent 60 ms generating it)."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    doubled = graph.call_function(torch.ops.aten.mul.Tensor, (x, x))
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (doubled, x)))
    rebuilt = deserialize_graph(serialize_graph(torch.fx.GraphModule(torch.nn.Module(), graph)),
                                with_fake_meta=False)
    assert isinstance(rebuilt, torch.fx.GraphModule)
    assert type(rebuilt)._needs_recompile()  # type: ignore[attr-defined]
    x_val = torch.randn(5, 7)
    torch.testing.assert_close(rebuilt(x_val), x_val * x_val + x_val)
    assert not type(rebuilt)._needs_recompile()  # type: ignore[attr-defined]
    assert "torch.ops.aten.mul.Tensor" in rebuilt.code


def test_floats_are_exact() -> None:
    values = [math.inf, -math.inf, 0.1, -0.0, 1e-300, 5e-324]
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    outs = [graph.call_function(torch.ops.aten.mul.Scalar, (x, v)) for v in values]
    outs.append(graph.call_function(torch.ops.aten.mul.Scalar, (x, math.nan)))
    graph.output(tuple(outs))
    rebuilt = deserialize_graph(serialize_graph(torch.fx.GraphModule(torch.nn.Module(), graph)))
    scalars = [n.args[1] for n in rebuilt.graph.nodes if n.op == "call_function"]
    assert [math.copysign(1, v) for v in scalars[:-1]] == [math.copysign(1, v) for v in values]
    assert scalars[:-1] == values and math.isnan(scalars[-1])


def test_device_ordinal_is_dropped() -> None:
    def graph_on(device: str) -> torch.fx.GraphModule:
        graph = torch.fx.Graph()
        x = graph.placeholder(f"x_{device.replace(':', '_')}")
        with FakeTensorMode():
            x.meta["val"] = torch.empty(2, 3, device=device)
        full = graph.call_function(
            torch.ops.aten.full.default, ([2, 3], 1.0), {"device": torch.device(device)}
        )
        graph.output(graph.call_function(torch.ops.aten.add.Tensor, (x, full)))
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    data = serialize_graph(graph_on("cuda:0"))
    assert data == serialize_graph(graph_on("cuda:3"))
    assert data != serialize_graph(graph_on("cpu"))
    rebuilt = deserialize_graph(data, with_fake_meta=True)
    placeholder = next(iter(rebuilt.graph.nodes))
    assert placeholder.meta["val"].device.type == "cuda"
    (full,) = [n for n in rebuilt.graph.nodes if n.target == torch.ops.aten.full.default]
    assert full.kwargs["device"] == torch.device("cuda")


def test_unsupported_arg_names_node_and_op() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    bad = graph.call_function(torch.ops.aten.add.Tensor, (x, 1))
    bad.name = "my_add"
    graph.output(bad)
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    # Set after codegen: a Generator has no Python source form.
    bad.args = (x, torch.Generator())  # type: ignore[assignment]
    with pytest.raises(SerializationError, match=r"my_add.*aten\.add\.Tensor.*Generator"):
        serialize_graph(gm)


def test_unsupported_opcode_and_target() -> None:
    gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.ReLU()))
    with pytest.raises(SerializationError, match="call_module"):
        serialize_graph(gm)
    graph = torch.fx.Graph()
    graph.output(graph.call_function(print, ("hi",)))
    with pytest.raises(SerializationError, match="unsupported call target"):
        serialize_graph(torch.fx.GraphModule(torch.nn.Module(), graph))


def test_only_listed_python_functions_decode() -> None:
    graph = torch.fx.Graph()
    graph.output(graph.call_function(operator.attrgetter, ("__class__",)))
    with pytest.raises(SerializationError, match="unsupported call target"):
        serialize_graph(torch.fx.GraphModule(torch.nn.Module(), graph))
    hostile = msgpack.packb(
        [
            "kiln-graph",
            GRAPH_FORMAT_VERSION,
            [
                ["call_function", ["py", "operator.attrgetter"], ["__class__"], [], []],
                ["output", None, [["node", 0]], [], []],
            ],
        ]
    )
    with pytest.raises(SerializationError, match="cannot resolve|bad call target"):
        deserialize_graph(hostile)


def test_symbolic_shapes_need_a_symbol_table() -> None:
    from kiln.compiler.symwire import SymbolTable

    gm = make_fx(pointwise_sum, tracing_mode="symbolic")(*[torch.randn(4, 6)] * 3)
    with pytest.raises(SerializationError, match="symbolic"):
        serialize_graph(gm)
    table = SymbolTable()
    data = serialize_graph(gm, table)
    assert len(table.ranges) == 2  # the two sizes, named s0 and s1 by first appearance
    rebuilt = deserialize_graph(data, with_fake_meta=True, nsymbols=len(table.ranges))
    first = next(iter(rebuilt.graph.nodes)).meta["val"]
    assert [str(s) for s in first.shape] == ["s0", "s1"]


def test_corrupt_data_raises() -> None:
    with pytest.raises(SerializationError):
        deserialize_graph(b"\xc1garbage")
    with pytest.raises(SerializationError, match="not a serialized Kiln graph"):
        deserialize_graph(b"\x90")


# ---------------------------------------------------------------------------------------
# Metas, example inputs and requests.


def test_tensor_meta_from_real_and_fake() -> None:
    real = torch.randn(5, 4).t()[1:]
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(real)
    expected = TensorMeta(
        shape=(3, 5), stride=(1, 4), dtype="float32", device_type="cpu", storage_offset=1
    )
    assert TensorMeta.from_tensor(real) == expected
    assert TensorMeta.from_tensor(fake) == expected


def test_example_inputs_follow_metas() -> None:
    metas = [
        TensorMeta((3, 5), (1, 4), "float16", "cpu", 1),
        TensorMeta((2, 3), (0, 1), "int64", "cpu", 0),
        TensorMeta((4,), (1,), "bool", "cpu", 0),
        TensorMeta((0, 2), (2, 1), "float32", "cuda", 0),
    ]
    tensors = example_inputs_from_metas(metas, device="cpu")
    for meta, t in zip(metas, tensors):
        assert TensorMeta.from_tensor(t) == TensorMeta(
            meta.shape, meta.stride, meta.dtype, "cpu", meta.storage_offset
        )
    assert int(tensors[1].min()) >= 0 and int(tensors[1].max()) < 2


def test_request_round_trip_is_canonical() -> None:
    (gm,) = capture_make_fx(pointwise_sum, [torch.randn(4, 6)] * 3)
    inputs = [torch.randn(4, 6)] * 3
    target = {"kind": "cpu", "isa": "x86-64-v3"}
    a = make_request(
        gm,
        inputs,
        options={"b": (1, 2), "a": True, "logs": "output_code"},
        target=target,
        versions={"torch": "x"},
    )
    b = make_request(
        gm, inputs, options={"a": True, "b": [1, 2]}, target=target, versions={"torch": "x"}
    )
    assert a.options == {"a": True, "b": [1, 2]}
    assert list(a.options) == ["a", "b"]
    assert a.to_bytes() == b.to_bytes()
    assert CompileRequest.from_bytes(a.to_bytes()) == a
    with pytest.raises(SerializationError, match="not a tensor"):
        make_request(gm, [1, 2, 3], options={}, target=target, versions={})  # type: ignore[list-item]
    with pytest.raises(SerializationError, match="options.bad"):
        make_request(gm, inputs, options={"bad": object()}, target=target, versions={})


def test_with_effects_round_trips_with_its_op() -> None:
    """linalg.inv's error check runs under the with_effects higher-order op, whose second
    argument is an op: both encode by name and resolve back to the same objects."""
    graphs = capture_aot(torch.linalg.inv, [torch.randn(4, 4) + 4 * torch.eye(4)])
    (gm,) = graphs
    effects = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.with_effects]
    assert effects and effects[0].args[1] is torch.ops.aten._linalg_check_errors.default
    rebuilt = check_round_trip(gm)  # same bytes again, same values
    (node,) = [n for n in rebuilt.graph.nodes
               if n.target is torch.ops.higher_order.with_effects]
    assert node.args[1] is torch.ops.aten._linalg_check_errors.default


def test_other_higher_order_ops_are_refused() -> None:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.higher_order.cond, (x, x, x, (x,))))
    with pytest.raises(SerializationError, match="higher-order operator cond"):
        serialize_graph(torch.fx.GraphModule(torch.nn.Module(), graph))
    wire = msgpack.packb(["kiln-graph", GRAPH_FORMAT_VERSION, [
        ["placeholder", None, [], [], []],
        ["call_function", ["hop", "cond"], [["node", 0]], [], []]]], use_bin_type=True)
    with pytest.raises(SerializationError, match="cond"):
        deserialize_graph(wire)


def test_node_metadata_of_static_tensors_is_the_metas_own_wire() -> None:
    """``tensor_wire``'s shortcut for plain-int sizes (every node of a static graph, on
    every lookup) writes exactly what ``TensorMeta.to_wire`` does: keys do not move."""
    from kiln.compiler.tensor_meta import tensor_wire

    base = torch.randn(6, 10)
    with FakeTensorMode():
        fake = torch.empty_strided((3, 5), (1, 7), dtype=torch.bfloat16, device="cuda")
    cases = [base, base.t(), base[2:, 3:7], torch.tensor(3, dtype=torch.int64),
             torch.zeros(0, 4, dtype=torch.bool), base.unsqueeze(1).expand(6, 4, 10), fake]
    for t in cases:
        assert tensor_wire(t) == TensorMeta.from_tensor(t).to_wire(), t.shape
    assert tensor_wire(base[2:, 3:7])[4] == 23 and tensor_wire(fake)[2:4] == ["bfloat16",
                                                                               "cuda"]
