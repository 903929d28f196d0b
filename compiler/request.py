"""Canonical serialization of ATen FX graphs and compile requests.

This module is the wire format between a client and a compile worker; it lives in
``compiler`` so that workers decode requests without importing the frontend
(``frontend.core.serialize`` re-exports it and adds ``make_request``).

A graph is encoded as msgpack bytes that depend only on what the graph computes:

- nodes in graph order, each ``[opcode, target, args, kwargs, meta]``;
- ops by qualified name (``["op", "aten.add.Tensor"]``, ``["py", "operator.getitem"]``);
- node references by position index, placeholders by position;
- constants (``get_attr`` tensors) by value: their bytes plus shape, stride and dtype;
- every node's output metadata (shape, stride, dtype, device type, storage offset) taken
  from ``node.meta["val"]``, so a worker can rebuild fake tensors without re-tracing.

Node names, stack traces, file paths, device ordinals and object ids are never encoded.
Every value that is not a msgpack scalar is a tagged list (``["dtype", "float32"]``,
``["node", 3]``, ``["tuple", [...]]``), so decoding is unambiguous.
"""

from __future__ import annotations

import ctypes
import importlib
import math
import operator
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import sympy
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx._lazy_graph_module import _LazyGraphModule

from .sizevars import SymbolicTensor, SymbolRange
from .symwire import (
    SymbolicSizeError,
    SymbolTable,
    decode_expr,
    decode_ranges,
    encode_canonical,
    encode_range,
)
from .tensor_meta import (
    SerializationError,
    TensorMeta,
    _dtype_name,
    _torch_attr,
    dtype_from_name,
    tensor_wire,
)

# Bump when the graph or request encoding changes: it is the key's "schema" part.
GRAPH_FORMAT_VERSION = 1
REQUEST_FORMAT_VERSION = 1
# A request with symbolic sizes carries one more field: the symbols' ranges.
_STATIC_REQUEST_FIELDS, _DYNAMIC_REQUEST_FIELDS = 7, 8

# Option names that never change a compiled artifact (where it is stored, how it is
# logged, who signs it); everything else is assumed to change the output.
NON_OUTPUT_OPTIONS = frozenset(
    {
        "store",
        "store_options",
        "store_timeout",
        "store_read_only",
        "local_cache",
        "local_cache_size",
        "farm",
        "farm_timeout",
        "signing_key",
        "require_signed",
        "stats_file",
        "logs",
        "debug",
        "debug_dir",
    }
)

# Options a request may carry to a worker: the ones that change the compiled output.
# Anything else in a request (debug folders, log settings, a store) is dropped there:
# a caller never picks a path on a worker.
COMPILE_OPTIONS = frozenset({"cpu_backend", "autotune", "deterministic", "max_autotune",
                             "allow_tf32", "padded_outputs"})

# Op namespaces a request may name (``torch.ops.<namespace>``); never private or dunder
# attributes: resolving ``torch.ops`` attributes by name reaches loaders and modules.
# ``torch_nn`` holds ops torch itself defines with ``torch.library`` (the chunked
# ``F.linear_cross_entropy``): pure computations, per-op fallbacks in the graph.
OP_NAMESPACES = frozenset({"aten", "prims", "torch_nn", "_c10d_functional", "torchvision"})
# Namespaces of which only some ops may be named. The functional collectives of tensor-
# parallel graphs (DTensor): a worker only computes their outputs' metadata (fake tensors,
# never a process group); the client runs them, each as ATen's kernel.
_NAMESPACE_OPS = {"_c10d_functional": frozenset({
    "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
    "broadcast", "wait_tensor"}),
    # torchvision's detection ops (Faster and Mask R-CNN): C++ kernels with meta kernels,
    # each a per-op fallback in the graph; a worker without torchvision cannot resolve
    # them and says so.
    "torchvision": frozenset({
        "roi_align", "_roi_align_backward", "roi_pool", "_roi_pool_backward", "nms",
        "ps_roi_align", "_ps_roi_align_backward", "ps_roi_pool", "_ps_roi_pool_backward",
        "deform_conv2d", "_deform_conv2d_backward"})}
# torch modules that register a namespace's ops when imported (torch imports them lazily,
# so a worker that never called the function has not registered them yet).
_NAMESPACE_MODULES = {"torch_nn": ("torch.nn.modules.linear_cross_entropy",),
                      "torchvision": ("torchvision",)}
_OP_PART_RE = re.compile(r"[A-Za-z][A-Za-z0-9_]*|_[A-Za-z0-9][A-Za-z0-9_]*")

# Bounds on tensor metadata from a request: a constant's storage is allocated for real.
MAX_CONSTANT_PADDING = 2**20  # storage elements a constant may hold beyond its values

# msgpack integers: int64 and uint64.
_INT_MIN = -(2**63)

# Plain Python callables allowed as call_function targets. An explicit list, not whole
# modules: operator.attrgetter / methodcaller / call would let a request that a worker
# decodes reach arbitrary Python objects.
_PY_FUNCTIONS: dict[str, Callable[..., Any]] = {
    f"{module.__name__}.{name}": getattr(module, name)
    for module, names in (
        (
            operator,
            "getitem add sub mul truediv floordiv mod pow neg pos abs eq ne lt le gt ge "
            "and_ or_ xor not_ invert lshift rshift",
        ),
        (math, "floor ceil trunc sqrt"),
        # size arithmetic Dynamo records as plain calls (a detection model's
        # ``max(h, w)`` of symbolic sizes)
        (torch, "sym_max sym_min"),
    )
    for name in names.split()
}
_PY_NAMES = {id(f): name for name, f in _PY_FUNCTIONS.items()}

# Higher-order operators a graph may call, by name: an explicit list too. with_effects
# orders side-effectful ops (``_linalg_check_errors`` after ``linalg_inv_ex``); the op it
# runs is an argument, encoded and resolved like any call target.
_HIGHER_ORDER_OPS: dict[str, Any] = {
    "with_effects": torch.ops.higher_order.with_effects,
}


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=True, use_list=True)
    except (ValueError, msgpack.UnpackException) as exc:
        raise SerializationError(f"not valid msgpack: {exc}") from exc


def _size_expr(value: Any) -> Any:
    """A torch size (int or SymInt) as an int or Dynamo's sympy expression."""
    if isinstance(value, torch.SymInt):
        expr = value.node.expr
        return int(expr) if expr.is_Integer else expr
    return int(value)


def _canonical_sizes(values: Sequence[Any], symbols: SymbolTable, shape_env: Any
                     ) -> tuple[Any, ...]:
    """Declare the symbols of ``values`` in order and return them in canonical names."""
    out = []
    for v in values:
        if isinstance(v, int):
            out.append(v)
            continue
        symbols.declare(v, shape_env)
        out.append(decode_expr(symbols.encode(v), len(symbols.ranges)))
    return tuple(out)


def _shape_env(values: Sequence[Any]) -> Any:
    for v in values:
        if isinstance(v, torch.SymInt):
            return v.node.shape_env
    return None


@dataclass(frozen=True)
class SymIntMeta:
    """A SymInt graph input (a dynamic size passed as a value): its expression."""

    expr: Any

    def to_wire(self) -> list[Any]:
        return ["symint", encode_canonical(self.expr)]

    @classmethod
    def from_wire(cls, wire: Any, nsymbols: int) -> SymIntMeta:
        try:
            return cls(decode_expr(wire[1], nsymbols))
        except (TypeError, ValueError, IndexError) as exc:
            raise SerializationError(f"bad SymInt input {wire!r:.200}") from exc


InputMeta = TensorMeta | SymIntMeta


def input_meta_from_wire(wire: Any, nsymbols: int) -> InputMeta:
    if isinstance(wire, list) and wire and wire[0] == "symint":
        return SymIntMeta.from_wire(wire, nsymbols)
    return TensorMeta.from_wire(wire, nsymbols)


def symint_meta(x: torch.SymInt, symbols: SymbolTable) -> SymIntMeta:
    """The meta of a SymInt graph input, declaring its symbols in ``symbols``."""
    try:
        sizes = _canonical_sizes([_size_expr(x)], symbols, _shape_env([x]))
    except SymbolicSizeError as exc:
        raise SerializationError(str(exc)) from exc
    return SymIntMeta(sympy.sympify(sizes[0]))


def symbolic_tensor(meta: TensorMeta) -> SymbolicTensor:
    return SymbolicTensor(meta.shape, meta.stride, meta.torch_dtype,
                          torch.device(meta.device_type), meta.storage_offset)


def compiler_input(meta: InputMeta, fake_mode: FakeTensorMode) -> Any:
    """The example input the compiler lowers with: a FakeTensor (static sizes), a
    SymbolicTensor, or the sympy expression of a SymInt input."""
    if isinstance(meta, SymIntMeta):
        return meta.expr
    if meta.is_symbolic:
        return symbolic_tensor(meta)
    return fake_tensor_from_meta(meta, fake_mode)


def _strided_from_flat(flat: torch.Tensor, meta: TensorMeta) -> torch.Tensor:
    return flat.as_strided(meta.shape, meta.stride, meta.storage_offset)


def fake_tensor_from_meta(meta: TensorMeta, fake_mode: FakeTensorMode) -> torch.Tensor:
    """A FakeTensor (under ``fake_mode``) with exactly this shape, stride and offset.

    Built on the meta device and wrapped, as the mode does for a constructor, rather than
    dispatched through the mode: two fake dispatches per tensor (empty, as_strided) made
    decoding every node's value of GPT-2's graph take 0.7 s on the H200 host."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        flat = torch.empty(meta.storage_numel, dtype=meta.torch_dtype, device="meta")
        strided = _strided_from_flat(flat, meta)
    converter = fake_mode.fake_tensor_converter
    return converter.from_meta_and_device(fake_mode, strided, torch.device(meta.device_type))


def example_inputs_from_metas(
    metas: Iterable[TensorMeta],
    device: str | torch.device | None = None,
    *,
    generator: torch.Generator | None = None,
    int_high: int = 2,
) -> list[torch.Tensor]:
    """Random real tensors with the metas' shapes, strides, offsets and dtypes.

    ``device`` overrides each meta's device type. Integers are drawn from
    ``[0, int_high)`` so that index inputs (targets, gather indices) stay in range.
    """
    tensors = []
    for meta in metas:
        dev = torch.device(device if device is not None else meta.device_type)
        dtype = meta.torch_dtype
        n = meta.storage_numel
        if dtype == torch.bool:
            flat = torch.rand(n, generator=generator) < 0.5
        elif dtype.is_floating_point or dtype.is_complex:
            flat = torch.randn(n, generator=generator, dtype=dtype)
        else:
            flat = torch.randint(0, int_high, (n,), generator=generator, dtype=dtype)
        tensors.append(_strided_from_flat(flat.to(dev), meta))
    return tensors


# ---------------------------------------------------------------------------------------
# Constants: tensors by value.


def encode_constant(t: torch.Tensor, where: str) -> list[Any]:
    """A tensor constant by value: its metadata and its values in row-major order."""
    if isinstance(t, FakeTensor) or t.device.type == "meta":
        raise SerializationError(f"{where}: constant is a fake/meta tensor and has no value")
    if t.layout != torch.strided or t.is_quantized:
        raise SerializationError(f"{where}: constant with layout {t.layout} is not supported")
    meta = TensorMeta.from_tensor(t)
    # Canonical bytes: logical (row-major) order, independent of the memory layout. The
    # backend runs inside Dynamo's fake mode: read the real constant outside of it.
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        values = t.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
    nbytes = values.numel() * values.element_size()
    data = ctypes.string_at(values.data_ptr(), nbytes) if nbytes else b""
    return ["tensor", meta.to_wire(), data]


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def decode_constant(wire: Sequence[Any], device: str | None) -> torch.Tensor:
    """The tensor of :func:`encode_constant`'s wire form, checked against its bounds."""
    # A constant is a real tensor even where the caller runs under a fake mode (the
    # in-process farm decodes inside Dynamo's tracing).
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return _decode_real_constant(wire, device)


def _decode_real_constant(wire: Sequence[Any], device: str | None) -> torch.Tensor:
    meta = TensorMeta.from_wire(wire[1])
    data, dtype = wire[2], meta.torch_dtype
    values = torch.empty(0, dtype=dtype)
    if data:
        values = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype)
    if values.numel() != math.prod(meta.shape):
        raise SerializationError(f"constant has {values.numel()} values for shape {meta.shape}")
    if meta.storage_numel > values.numel() + MAX_CONSTANT_PADDING:
        raise SerializationError(
            f"constant of {values.numel()} values asks for a storage of {meta.storage_numel} "
            f"elements (offset {meta.storage_offset}, strides {meta.stride}); at most "
            f"{MAX_CONSTANT_PADDING} beyond its values")
    if meta.stride == _contiguous_stride(meta.shape) and meta.storage_offset == 0:
        return values.reshape(meta.shape).to(device or "cpu")
    # Scatter the values into a storage laid out like the original: each element's
    # storage index is read off an arange viewed with the same strides.
    numel = meta.storage_numel
    positions = _strided_from_flat(torch.arange(numel), meta).reshape(-1)
    storage = torch.zeros(numel, dtype=dtype)
    storage[positions] = values.reshape(-1)
    return _strided_from_flat(storage.to(device or "cpu"), meta)


# ---------------------------------------------------------------------------------------
# Arguments.


def _encode_arg(value: Any, index: Mapping[torch.fx.Node, int]) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and not _INT_MIN <= value < 2**64:
        raise SerializationError(f"integer {value} does not fit in 64 bits")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.fx.Node):
        return ["node", index[value]]
    if isinstance(value, (list, tuple)):
        tag = "list" if isinstance(value, list) else "tuple"
        return [tag, [_encode_arg(v, index) for v in value]]
    if isinstance(value, torch.dtype):
        return ["dtype", _dtype_name(value)]
    if isinstance(value, torch.device):
        return ["device", value.type]
    if isinstance(value, torch.layout):
        return ["layout", str(value).removeprefix("torch.")]
    if isinstance(value, torch.memory_format):
        return ["memory_format", str(value).removeprefix("torch.")]
    if isinstance(value, slice):
        return ["slice", [_encode_arg(v, index) for v in (value.start, value.stop, value.step)]]
    if isinstance(value, complex):
        return ["complex", [value.real, value.imag]]
    if isinstance(value, torch._ops.OpOverload):  # the op that with_effects runs
        return _encode_target(value)
    raise SerializationError(f"unsupported argument {value!r} of type {type(value).__name__}")


_ARG_DECODERS: dict[str, Callable[[Any, Sequence[torch.fx.Node]], Any]] = {}


def _decode_arg(wire: Any, nodes: Sequence[torch.fx.Node]) -> Any:
    if not isinstance(wire, list):
        return wire
    if len(wire) != 2 or wire[0] not in _ARG_DECODERS:
        raise SerializationError(f"bad argument encoding {wire!r}")
    return _ARG_DECODERS[wire[0]](wire[1], nodes)


def _decode_items(items: list[Any], nodes: Sequence[torch.fx.Node]) -> list[Any]:
    return [_decode_arg(v, nodes) for v in items]


_ARG_DECODERS.update(
    {
        "node": lambda i, nodes: nodes[i],
        "list": _decode_items,
        "tuple": lambda items, nodes: tuple(_decode_items(items, nodes)),
        "dtype": lambda name, _: dtype_from_name(name),
        "device": lambda name, _: torch.device(name),
        "layout": lambda name, _: _torch_attr(name, torch.layout, "layout"),
        "memory_format": lambda name, _: _torch_attr(name, torch.memory_format, "memory format"),
        "slice": lambda items, nodes: slice(*_decode_items(items, nodes)),
        "complex": lambda parts, _: complex(parts[0], parts[1]),
        "op": lambda name, _: _resolve_target(["op", name]),
    }
)


# ---------------------------------------------------------------------------------------
# Node metadata: node.meta["val"] as shapes, strides and dtypes.


def _encode_val(val: Any, symbols: SymbolTable | None = None) -> Any:
    if val is None or isinstance(val, (bool, int, float)):
        return val
    if isinstance(val, torch.Tensor):
        return ["tensor", tensor_wire(val, symbols)]
    if isinstance(val, (list, tuple)):
        tag = "list" if isinstance(val, list) else "tuple"
        return [tag, [_encode_val(v, symbols) for v in val]]
    if isinstance(val, torch.SymInt) and symbols:
        expr = _size_expr(val)
        try:
            return ["symint", symbols.encode(expr)]
        except SymbolicSizeError as exc:
            raise SerializationError(str(exc)) from exc
    if isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise SerializationError(f"symbolic value {val} ({type(val).__name__}) is not "
                                 "supported here")
    raise SerializationError(f"unsupported meta['val'] of type {type(val).__name__}")


def _decode_val(wire: Any, fake_mode: FakeTensorMode, nsymbols: int = 0) -> Any:
    if not isinstance(wire, list):
        return wire
    tag, body = wire
    if tag == "tensor":
        meta = TensorMeta.from_wire(body, nsymbols)
        return symbolic_tensor(meta) if meta.is_symbolic else fake_tensor_from_meta(meta,
                                                                                   fake_mode)
    if tag == "symint":
        return decode_expr(body, nsymbols)
    if tag not in ("list", "tuple"):
        raise SerializationError(f"bad meta encoding {wire!r}")
    items = [_decode_val(v, fake_mode, nsymbols) for v in body]
    return items if tag == "list" else tuple(items)


# ---------------------------------------------------------------------------------------
# Targets.


def _encode_target(target: Any) -> list[str]:
    if isinstance(target, torch._ops.OpOverload):
        return ["op", f"{target.namespace}.{target._opname}.{target._overloadname}"]
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace, name = target._qualified_op_name.split("::")
        return ["packet", f"{namespace}.{name}"]
    if isinstance(target, torch._ops.HigherOrderOperator):
        hop_name = str(target.name())
        if _HIGHER_ORDER_OPS.get(hop_name) is target:
            return ["hop", hop_name]
        raise SerializationError(f"higher-order operator {hop_name} is not supported")
    if id(target) in _PY_NAMES:
        return ["py", _PY_NAMES[id(target)]]
    raise SerializationError(f"unsupported call target {target!r}")


def _resolve_target(wire: Any) -> Any:
    """An op from its wire name: a listed Python function or higher-order op, or an
    ATen/prims overload (packet) named by identifier parts; nothing else on ``torch.ops``
    is reachable."""
    try:
        kind, qualname = wire
        parts = qualname.split(".")
    except (TypeError, ValueError, AttributeError) as exc:
        raise SerializationError(f"bad call target {wire!r:.200}") from exc
    if kind == "py" and qualname in _PY_FUNCTIONS:
        return _PY_FUNCTIONS[qualname]
    if kind == "hop" and qualname in _HIGHER_ORDER_OPS:
        return _HIGHER_ORDER_OPS[qualname]
    if kind not in ("op", "packet") or len(parts) != (3 if kind == "op" else 2):
        raise SerializationError(f"bad call target {wire!r:.200}")
    only = _NAMESPACE_OPS.get(parts[0])
    if parts[0] not in OP_NAMESPACES or not all(
            _OP_PART_RE.fullmatch(part) and not part.startswith("__") for part in parts[1:]
    ) or (only is not None and parts[1] not in only):
        raise SerializationError(
            f"op {qualname!r:.200} is not allowed in a request: ops come from the "
            f"{sorted(OP_NAMESPACES)} namespaces, named by identifiers (no dunders)")
    _register_namespace(parts[0])
    try:
        target: Any = getattr(getattr(torch.ops, parts[0]), parts[1])
        if kind == "op":
            target = getattr(target, parts[2])
    except (AttributeError, RuntimeError) as exc:
        raise SerializationError(f"unknown op {qualname!r}") from exc
    wanted = torch._ops.OpOverload if kind == "op" else torch._ops.OpOverloadPacket
    if not isinstance(target, wanted):
        raise SerializationError(f"{qualname!r} is not an operator overload")
    return target


def _register_namespace(namespace: str) -> None:
    for module in _NAMESPACE_MODULES.get(namespace, ()):
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001 - absent or broken (an older torch, a torchvision
            # built for another torch): its ops are unknown, which the caller says
            pass


# ---------------------------------------------------------------------------------------
# Graphs.


def _node_error(node: torch.fx.Node, exc: Exception) -> SerializationError:
    return SerializationError(
        f"cannot serialize node {node.name!r} ({node.op} {node.target}): {exc}"
    )


def _encode_node(
    node: torch.fx.Node, gm: torch.fx.GraphModule, index: Mapping[torch.fx.Node, int],
    symbols: SymbolTable | None = None,
) -> list[Any]:
    meta = [_encode_val(node.meta["val"], symbols)] if "val" in node.meta else []
    if node.op == "placeholder":
        return ["placeholder", None, [], [], meta]
    if node.op == "get_attr":
        value: Any = gm
        for atom in str(node.target).split("."):
            value = getattr(value, atom, None)
        if not isinstance(value, torch.Tensor):
            raise SerializationError(f"get_attr of a {type(value).__name__}, not a tensor")
        return ["get_attr", encode_constant(value, node.name), [], [], meta]
    if node.op in ("call_function", "output"):
        target = _encode_target(node.target) if node.op == "call_function" else None
        args = [_encode_arg(a, index) for a in node.args]
        kwargs = [[k, _encode_arg(node.kwargs[k], index)] for k in sorted(node.kwargs)]
        return [node.op, target, args, kwargs, meta if node.op == "call_function" else []]
    raise SerializationError(f"opcode {node.op!r} is not allowed in an ATen graph")


def serialize_graph(gm: torch.fx.GraphModule, symbols: SymbolTable | None = None) -> bytes:
    """Canonical msgpack bytes of an ATen graph; see the module docstring.

    A graph with dynamic shapes needs the ``symbols`` its inputs declared
    (:func:`input_metas`): node metadata names sizes by them."""
    index: dict[torch.fx.Node, int] = {}
    encoded = []
    for i, node in enumerate(gm.graph.nodes):
        try:
            encoded.append(_encode_node(node, gm, index, symbols))
        except SerializationError as exc:
            raise _node_error(node, exc) from exc
        index[node] = i
    return _pack(["kiln-graph", GRAPH_FORMAT_VERSION, encoded])


def graph_difference(a: bytes, b: bytes, width: int = 160) -> str | None:
    """Where two serialized graphs first differ, in words (``kiln explain-miss``): the
    node's index, its op and target, and which of its fields differ (arguments, keyword
    arguments, output metadata: shape, stride, dtype), each side abbreviated to ``width``
    characters; None if the graphs are equal."""
    if a == b:
        return None
    try:
        nodes_a, nodes_b = _decode_nodes(a), _decode_nodes(b)
    except SerializationError as exc:
        return f"one graph does not decode ({exc})"
    for i, (x, y) in enumerate(zip(nodes_a, nodes_b)):
        if x == y:
            continue
        what = "; ".join(f"{name} {_short(u, width)} vs {_short(v, width)}"
                         for name, u, v in zip(("op", "target", "args", "kwargs", "meta"),
                                               x, y) if u != v)
        target = x[1][-1] if isinstance(x[1], list) and x[1] else x[1]
        return f"node {i} ({x[0]}{f' {target}' if target else ''}) differs: {what}"
    return (f"the graphs have {len(nodes_a)} vs {len(nodes_b)} nodes, equal up to node "
            f"{min(len(nodes_a), len(nodes_b))}")


def _short(value: Any, width: int) -> str:
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _decode_nodes(data: bytes) -> list[Any]:
    wire = _unpack(data)
    if not (isinstance(wire, list) and len(wire) == 3 and wire[0] == "kiln-graph"):
        raise SerializationError("not a serialized Kiln graph")
    if wire[1] != GRAPH_FORMAT_VERSION:
        raise SerializationError(
            f"graph format {wire[1]} is not the supported format {GRAPH_FORMAT_VERSION}"
        )
    return wire[2]


class _GraphBuilder:
    """Appends decoded nodes to a fresh graph, naming placeholders and constants."""

    def __init__(self, constants_device: str | None) -> None:
        self.graph = torch.fx.Graph()
        self.root = torch.nn.Module()
        self.nodes: list[torch.fx.Node] = []
        self.num_placeholders = 0
        self.num_constants = 0
        self.constants_device = constants_device

    def add(self, wire: list[Any]) -> torch.fx.Node:
        op, target, args_wire, kwargs_wire, _ = wire
        if op == "placeholder":
            self.num_placeholders += 1
            return self.graph.placeholder(f"arg{self.num_placeholders - 1}_1")
        if op == "get_attr":
            name = f"_tensor_constant{self.num_constants}"
            self.num_constants += 1
            setattr(self.root, name, decode_constant(target, self.constants_device))
            return self.graph.get_attr(name)
        args = tuple(_decode_arg(a, self.nodes) for a in args_wire)
        kwargs = {k: _decode_arg(v, self.nodes) for k, v in kwargs_wire}
        if op == "output":
            return self.graph.output(args[0])
        if op == "call_function":
            return self.graph.call_function(_resolve_target(target), args, kwargs)
        raise SerializationError(f"bad opcode {op!r}")


def deserialize_graph(
    data: bytes,
    *,
    with_fake_meta: bool = False,
    fake_mode: FakeTensorMode | None = None,
    constants_device: str | None = None,
    nsymbols: int = 0,
) -> torch.fx.GraphModule:
    """Rebuild a GraphModule from :func:`serialize_graph` bytes.

    Placeholders are named ``arg0_1, arg1_1, ...``; constants ``_tensor_constant0, ...``
    and live on ``constants_device`` (CPU by default). With ``with_fake_meta``, every
    node's ``meta["val"]`` is rebuilt as FakeTensors under ``fake_mode`` (a new
    FakeTensorMode unless given); symbolic tensors as :class:`SymbolicTensor` over
    ``nsymbols`` size symbols.
    """
    wires = _decode_nodes(data)
    mode = (fake_mode or FakeTensorMode()) if with_fake_meta else None
    builder = _GraphBuilder(constants_device)
    for wire in wires:
        try:
            node = builder.add(wire)
            if mode is not None and wire[4]:
                node.meta["val"] = _decode_val(wire[4][0], mode, nsymbols)
        except (IndexError, KeyError, TypeError, ValueError, RuntimeError) as exc:
            position = len(builder.nodes)
            raise SerializationError(f"bad node #{position} {wire!r:.200}: {exc}") from exc
        builder.nodes.append(node)
    # Its Python code is generated when first asked for (``gm.code``, a call): the compiler
    # reads the graph only, and generating it took 60 ms of a 700-node backward's decode.
    return _LazyGraphModule(builder.root, builder.graph)


def placeholder_metas(gm: torch.fx.GraphModule) -> tuple[TensorMeta, ...]:
    """Input metadata from the placeholders' ``meta["val"]``."""
    metas = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise SerializationError(
                f"placeholder {node.name!r} has meta['val'] {type(val).__name__}, not a tensor"
            )
        metas.append(TensorMeta.from_tensor(val))
    return tuple(metas)


# ---------------------------------------------------------------------------------------
# Requests.


def canonical(value: Any, where: str = "value") -> Any:
    """A msgpack-ready copy: dicts with sorted string keys, tuples as lists."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, (list, tuple)):
        return [canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise SerializationError(f"{where} has non-string keys")
        return {k: canonical(value[k], f"{where}.{k}") for k in sorted(value)}
    raise SerializationError(f"{where} has unsupported type {type(value).__name__}")


def compile_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """A request's options a worker hands the compiler (``COMPILE_OPTIONS`` only)."""
    return {k: v for k, v in options.items() if k in COMPILE_OPTIONS}


def output_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options that may change a compiled artifact, sorted by name."""
    kept = {k: v for k, v in options.items() if k.lower() not in NON_OUTPUT_OPTIONS}
    return canonical(kept, "options")


@dataclass(frozen=True)
class CompileRequest:
    """Everything a worker needs to compile one graph, and all that the key covers.

    Dict fields are stored in canonical form (sorted keys, tuples as lists). A graph
    with dynamic shapes has ``symbols``: the range of each size symbol ``s<k>``.
    """

    graph: bytes
    inputs: tuple[InputMeta, ...]
    options: dict[str, Any]
    target: dict[str, Any]
    versions: dict[str, Any]
    symbols: tuple[SymbolRange, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "symbols", tuple(self.symbols))
        for name in ("options", "target", "versions"):
            object.__setattr__(self, name, canonical(getattr(self, name), name))

    def inputs_wire(self) -> list[Any]:
        """The inputs as the key's ``inputs`` part sees them (symbol ranges included)."""
        wire = [m.to_wire() for m in self.inputs]
        if self.symbols:
            wire.append(["symbols", [encode_range(r) for r in self.symbols]])
        return wire

    def to_bytes(self) -> bytes:
        fields = [
            "kiln-request",
            REQUEST_FORMAT_VERSION,
            self.graph,
            [m.to_wire() for m in self.inputs],
            self.options,
            self.target,
            self.versions,
        ]
        if self.symbols:
            fields.append([encode_range(r) for r in self.symbols])
        return _pack(fields)

    @classmethod
    def from_bytes(cls, data: bytes) -> CompileRequest:
        wire = _unpack(data)
        if not (isinstance(wire, list) and wire[:1] == ["kiln-request"]
                and len(wire) in (_STATIC_REQUEST_FIELDS, _DYNAMIC_REQUEST_FIELDS)):
            raise SerializationError("not a serialized Kiln compile request")
        if wire[1] != REQUEST_FORMAT_VERSION:
            raise SerializationError(f"request format {wire[1]} is not {REQUEST_FORMAT_VERSION}")
        graph, inputs, options, target, versions = wire[2:7]
        try:
            symbols = decode_ranges(wire[7]) if len(wire) == _DYNAMIC_REQUEST_FIELDS else ()
        except (TypeError, ValueError) as exc:
            raise SerializationError(f"bad symbol ranges: {exc}") from exc
        if not isinstance(inputs, list):
            raise SerializationError("request inputs are not a list")
        metas = tuple(input_meta_from_wire(m, len(symbols)) for m in inputs)
        return cls(graph=graph, inputs=metas, options=options, target=target,
                   versions=versions, symbols=symbols)
