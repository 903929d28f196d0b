"""Requests and keys of graphs with dynamic shapes: symbols named canonically by first
appearance, no size value in the key, hostile expression bytes refused."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
import sympy
import torch

from kiln.compiler.request import CompileRequest, SerializationError, SymIntMeta, TensorMeta
from kiln.compiler.sizevars import SizeVars, SymbolRange, size_symbol
from kiln.compiler.symwire import decode_expr
from kiln.frontend.core.keys import compute_key
from kiln.frontend.core.serialize import make_request

TARGET = {"kind": "cpu", "isa": "x86-64-v2"}


def _nested(depth: int) -> Any:
    wire: Any = 1
    for _ in range(depth):
        wire = ["+", [wire]]
    return wire


def _requests(fn: Any, shapes: list[tuple[int, ...]], dims: list[int]) -> list[CompileRequest]:
    """The request Kiln's backend builds for ``fn`` at each shape, ``dims`` dynamic."""
    from torch._dynamo.backends.common import aot_autograd

    out: list[CompileRequest] = []

    def capture(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        out.append(make_request(gm, inputs, options={}, target=TARGET, versions={"v": 1}))
        return gm.forward

    for shape in shapes:
        torch._dynamo.reset()
        x = torch.randn(*shape)
        for d in dims:
            torch._dynamo.mark_dynamic(x, d)
        torch.compile(fn, backend=aot_autograd(fw_compiler=capture))(x)
    return out


def test_one_key_for_every_size_and_canonical_names() -> None:
    fn = lambda x: (x * 2).sum(-1) + x.shape[0]  # noqa: E731
    a, b = _requests(fn, [(8, 5), (31, 5)], [0])
    assert compute_key(a).key == compute_key(b).key
    assert a.to_bytes() == b.to_bytes()
    assert a.symbols == (SymbolRange(2, None),)
    s0 = size_symbol(0)
    tensors = [m for m in a.inputs if isinstance(m, TensorMeta)]
    assert tensors[0].shape == (s0, 5) and tensors[0].stride == (5, 1)
    # no value of the dynamic size anywhere in the request's bytes
    wire = msgpack.unpackb(a.to_bytes(), raw=False)
    assert 8 not in _ints(wire[3]) and 31 not in _ints(wire[3])


def test_two_dynamic_dims_named_in_order_of_appearance() -> None:
    (req,) = _requests(lambda x: x.relu(), [(6, 7)], [1, 0])
    tensor = next(m for m in req.inputs if isinstance(m, TensorMeta))
    assert tensor.shape == (size_symbol(0), size_symbol(1))
    assert tensor.stride == (size_symbol(1), 1)
    assert len(req.symbols) == 2


def test_request_roundtrip_and_static_unchanged() -> None:
    (req,) = _requests(lambda x: x.cos(), [(4, 3)], [0])
    again = CompileRequest.from_bytes(req.to_bytes())
    assert again == req and compute_key(again).key == compute_key(req).key
    (static,) = _requests(lambda x: x.cos(), [(4, 3)], [])
    assert static.symbols == () and len(msgpack.unpackb(static.to_bytes())) == 7


def test_ranges_from_mark_dynamic_are_in_the_key() -> None:
    from torch._dynamo.backends.common import aot_autograd

    keys = []

    def capture(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        req = make_request(gm, inputs, options={}, target=TARGET, versions={"v": 1})
        keys.append((req.symbols, compute_key(req).key))
        return gm.forward

    for hi in (64, 128):
        torch._dynamo.reset()
        x = torch.randn(8, 3)
        torch._dynamo.mark_dynamic(x, 0, min=2, max=hi)
        torch.compile(lambda t: t + 1, backend=aot_autograd(fw_compiler=capture))(x)
    assert keys[0][0] == (SymbolRange(2, 64),) and keys[1][0] == (SymbolRange(2, 128),)
    assert keys[0][1] != keys[1][1]


@pytest.mark.parametrize("wire", [
    ["s", 3],                      # undeclared symbol
    ["eval", ["__import__('os')"]],  # unknown op
    ["//", [1]],                   # wrong arity
    2**63 - 1,                     # out of range
    _nested(40),                   # too deep
])
def test_hostile_expressions_are_refused(wire: Any) -> None:
    with pytest.raises(ValueError):
        decode_expr(wire, 1)
    bad = [["symint", wire]]
    data = msgpack.packb(["kiln-request", 1, b"", bad, {}, {}, {}, [[2, None]]])
    with pytest.raises(SerializationError):
        CompileRequest.from_bytes(data)


def test_sizevars_prove_only_what_holds() -> None:
    s0, s1 = size_symbol(0), size_symbol(1)
    sv = SizeVars({s0: SymbolRange(2, 64), s1: SymbolRange(2, None)})
    assert sv.statically_known_equals(s0 * s1 * 2, 2 * s1 * s0)
    assert not sv.statically_known_equals(s0, s1)
    assert sv.statically_known_leq(s0 * 32, 2048)
    assert not sv.statically_known_leq(s1, 2**31)
    assert sv.statically_known_geq(s0 - 1, 0) and not sv.statically_known_geq(s0 - 3, 0)
    assert sv.size_hint(s0 + s1) == 64 + 8192
    assert SymIntMeta(s0).to_wire() == ["symint", ["s", 0]]
    assert decode_expr(["//", [["*", [32, ["s", 0]]], ["s", 0]]], 1) == sympy.Integer(32)


def _ints(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [i for v in value for i in _ints(v)]
    return []
