"""The AOT cache's key: a Dynamo graph, its inputs and the state AOTAutograd traces it
under, as named canonical parts hashed like a request's (``compiler.keys``).

    schema    the AOT key's format, and the request and artifact formats
    graph     Dynamo's FX graph: nodes in order, targets by module and name (torch,
              operator and math functions only, each checked to be the module's own),
              arguments by value, node references by position, partitioner tags
    inputs    every placeholder: shape, stride, dtype, device type, storage offset,
              requires_grad, parameter or not, leaf, inference tensor, conj/neg bits;
              symbolic sizes as a request names them (``s0, s1, ...`` by first
              appearance), with their ranges and the shape environment's guards
    state     grad mode, inference mode, autocast per device, default dtype,
              deterministic algorithms, SDPA backends, functorch's config
    options   the compile options of the ATen graphs' requests
    versions  Kiln, compiler/ sources, torch, triton, and frontend/ sources (which call
              AOTAutograd and build the requests)
    target    the compile target of the inputs' device

Two Dynamo graphs share a key only if AOTAutograd traces them the same way. A graph
whose trace could depend on something these parts do not hold raises
:class:`NotCacheable` with a short reason, and takes the traced path: an unbacked size,
submodules or attributes (``get_attr``, ``call_module``), higher-order operators, a
function from outside torch (its code could change under the same name), an argument
that is not plain data, a tensor subclass input, an active dispatch mode or functorch
transform. A graph with symbolic sizes is keyed (``inputs``); its entry is served only
where AOTAutograd's trace added no guard (``cache.Pending.entry``), and only for
inference.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack
import sympy
import torch
from torch.fx.immutable_collections import immutable_dict, immutable_list

from kiln.compiler.keys import KeyInfo, key_from_parts, schema
from kiln.compiler.request import OP_NAMESPACES, TensorMeta, canonical
from kiln.compiler.symwire import SymbolicSizeError, SymbolTable
from kiln.compiler.versions import hash_source_tree, versions

# Bump when what goes into the AOT key changes.
AOT_KEY_SCHEMA = 1

# Modules whose functions a cached graph may call: their behaviour is fixed by the torch
# (or Python) version, which is in the key.
_FUNCTION_ROOTS = frozenset({"torch", "operator", "_operator", "math", "builtins"})
# Node metadata that steers AOTAutograd's partitioner (activation checkpointing tags).
_PARTITIONER_META = ("recompute", "ac_graph_id", "partitioner_tag", "custom")
_INT_RANGE = (-(2**63), 2**64)
# FX keeps node arguments in immutable lists and dicts.
_SEQUENCES: dict[type, str] = {list: "list", immutable_list: "list", tuple: "tuple",
                               torch.Size: "size"}


class NotCacheable(Exception):
    """A Dynamo graph the AOT cache does not key; ``reason`` is a short counter name."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# ---------------------------------------------------------------------------------------
# The graph.


def graph_wire(gm: torch.fx.GraphModule) -> bytes:
    """Canonical bytes of a Dynamo graph (see the module docstring)."""
    if any(True for _ in gm.children()) or any(True for _ in gm.parameters()) \
            or any(True for _ in gm.buffers()):
        raise NotCacheable("graph", "the graph module holds submodules, parameters or buffers")
    index: dict[torch.fx.Node, int] = {}
    nodes = []
    for i, node in enumerate(gm.graph.nodes):
        nodes.append(_node_wire(node, index))
        index[node] = i
    return _pack(["kiln-dynamo-graph", AOT_KEY_SCHEMA, nodes])


def _node_wire(node: torch.fx.Node, index: Mapping[torch.fx.Node, int]) -> list[Any]:
    if node.op == "placeholder":
        return ["placeholder"]
    if node.op == "output":
        return ["output", _arg_wire(node.args, index)]
    if node.op == "call_function":
        target = _target_wire(node.target)
    elif node.op == "call_method" and isinstance(node.target, str):
        target = ["method", node.target]
    else:
        raise NotCacheable("graph", f"{node.op} node {node.name} ({node.target})")
    kwargs = [[k, _arg_wire(v, index)] for k, v in sorted(node.kwargs.items())]
    tags = [[k, _plain(node.meta[k], k)] for k in _PARTITIONER_META if k in node.meta]
    return [node.op, target, _arg_wire(node.args, index), kwargs, tags]


def _target_wire(target: Any) -> list[Any]:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        op = str(target.name() if isinstance(target, torch._ops.OpOverload)
                 else target._qualified_op_name)
        if op.split("::")[0] not in OP_NAMESPACES:
            raise NotCacheable("graph", f"operator {op} is not in {sorted(OP_NAMESPACES)}")
        return ["op", op]
    if isinstance(target, torch._ops.HigherOrderOperator):
        raise NotCacheable("graph", f"higher-order operator {target.name()}")
    module, name = getattr(target, "__module__", None), getattr(target, "__name__", None)
    if not isinstance(module, str) or not isinstance(name, str) \
            or module.split(".")[0] not in _FUNCTION_ROOTS:
        raise NotCacheable("graph", f"function {target!r} is not from torch, operator or math")
    # The module's own function under that name: not a closure or a copy that could
    # behave differently under the same name.
    if getattr(sys.modules.get(module), name, None) is not target:
        raise NotCacheable("graph", f"function {module}.{name} is not {module}'s own")
    return ["fn", module, name]


def _arg_wire(value: Any, index: Mapping[torch.fx.Node, int]) -> Any:
    if value is None or isinstance(value, (bool, str, float)):
        return value
    if isinstance(value, int):
        if not _INT_RANGE[0] <= value < _INT_RANGE[1]:
            raise NotCacheable("graph", f"integer {value} does not fit in 64 bits")
        return value
    if isinstance(value, torch.fx.Node):
        return ["node", index[value]]
    if type(value) in _SEQUENCES:  # not a named tuple or another subclass
        return [_SEQUENCES[type(value)], [_arg_wire(v, index) for v in value]]
    if type(value) in (dict, immutable_dict) and all(isinstance(k, str) for k in value):
        return ["dict", [[k, _arg_wire(v, index)] for k, v in value.items()]]
    if isinstance(value, slice):
        return ["slice", [_arg_wire(v, index) for v in (value.start, value.stop, value.step)]]
    if value is Ellipsis:
        return ["ellipsis"]
    if isinstance(value, complex):
        return ["complex", [value.real, value.imag]]
    if isinstance(value, (torch.dtype, torch.device, torch.layout, torch.memory_format)):
        return [type(value).__name__, str(value)]  # a device with its ordinal
    raise NotCacheable("graph", f"argument of type {type(value).__name__}")


def _plain(value: Any, where: str) -> Any:
    """Node metadata as plain data (its repr for anything else: never a collision, at
    worst a miss)."""
    try:
        return canonical(value, where)
    except Exception:
        return repr(value)


# ---------------------------------------------------------------------------------------
# The inputs.


def inputs_wire(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> list[Any]:
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(example_inputs):
        raise NotCacheable("inputs", f"{len(placeholders)} placeholders for "
                                     f"{len(example_inputs)} inputs")
    values = [traced_value(node) for node in placeholders]
    env = symbolic_shape_env(values)
    if env is None:
        return [_input_wire(i, node, x) for i, (node, x) in enumerate(zip(placeholders,
                                                                          example_inputs))]
    # Symbolic sizes: as a request names them (``s0, s1, ...`` by first appearance, with
    # their ranges), and the shape environment's guards so far over those names: what
    # AOTAutograd can know about the sizes when it traces.
    symbols = SymbolTable()
    wires = [_symbolic_input_wire(i, x, val, symbols)
             for i, (x, val) in enumerate(zip(example_inputs, values))]
    ranges = [[r.lower, r.upper] for r in symbols.ranges]
    return [*wires, ["symbols", ranges], ["guards", guard_wires(env, symbols)]]


def traced_value(node: torch.fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def symbolic_shape_env(values: Sequence[Any]) -> Any:
    """The shape environment of the first symbolic size among Dynamo's traced input
    values (SymInts, or fake tensors with SymInt sizes); None where every size is static."""
    for val in values:
        if isinstance(val, torch.SymInt):
            return val.node.shape_env
        if isinstance(val, torch.Tensor):
            for s in (*val.shape, *val.stride(), val.storage_offset()):
                if isinstance(s, torch.SymInt):
                    return s.node.shape_env
    return None


def _symbolic_input_wire(i: int, x: Any, val: Any, symbols: SymbolTable) -> list[Any]:
    from kiln.compiler.request import SerializationError, symint_meta

    try:
        if isinstance(val, torch.SymInt):
            if not isinstance(x, (int, torch.SymInt)) or isinstance(x, bool):
                raise NotCacheable("inputs", f"input {i} is a {type(x).__name__}, not a size")
            return ["symint", symint_meta(val, symbols).to_wire()]
        _check_tensor(i, x)
        if not isinstance(val, torch.Tensor):
            raise NotCacheable("dynamic_shapes", f"input {i} has no traced value")
        meta = TensorMeta.from_tensor(val, symbols)
    except (SerializationError, SymbolicSizeError) as e:
        raise NotCacheable("dynamic_shapes", f"input {i}: {e}") from None
    return [meta.to_wire(), _flags(x)]


def guard_wires(env: Any, symbols: SymbolTable) -> list[str]:
    """The shape environment's guards, each over the symbols' canonical names
    (``srepr``: hashed into the key, never read back)."""
    rename = {sym: sympy.Symbol(f"k{k}", integer=True) for sym, k in symbols.index.items()}
    out = []
    for guard in getattr(env, "guards", ()):
        # A size specialized to a constant (``Eq(s27, 16)``) is that constant in the
        # inputs already: the guard, with the environment's replacements, holds trivially.
        expr = env.replace(guard.expr) if hasattr(env, "replace") else guard.expr
        if expr is sympy.true:
            continue
        if not expr.free_symbols <= rename.keys():
            raise NotCacheable("dynamic_shapes", f"a guard on a size no input has ({expr})")
        out.append(sympy.srepr(expr.xreplace(rename)))
    return out


def _check_tensor(i: int, x: Any) -> None:
    if not isinstance(x, torch.Tensor):
        raise NotCacheable("inputs", f"input {i} is a {type(x).__name__}, not a tensor")
    if type(x) not in (torch.Tensor, torch.nn.Parameter):
        raise NotCacheable("inputs", f"input {i} is a tensor subclass {type(x).__name__}")
    if x.layout != torch.strided or x.is_quantized:
        raise NotCacheable("inputs", f"input {i} has layout {x.layout}")


def _flags(x: torch.Tensor) -> list[bool]:
    return [x.requires_grad, isinstance(x, torch.nn.Parameter), x.is_leaf, x.is_inference(),
            x.is_conj(), x.is_neg()]


def _input_wire(i: int, node: torch.fx.Node, x: Any) -> list[Any]:
    val = traced_value(node)
    if isinstance(x, torch.SymInt) or isinstance(val, torch.SymInt):
        raise NotCacheable("dynamic_shapes", f"input {i} is a symbolic size")
    _check_tensor(i, x)
    if not isinstance(val, torch.Tensor) or not all(
            type(s) is int for s in (*val.shape, *val.stride(), val.storage_offset())):
        raise NotCacheable("dynamic_shapes", f"input {i} has symbolic (or unknown) sizes")
    return [TensorMeta.from_tensor(x).to_wire(), _flags(x)]


# ---------------------------------------------------------------------------------------
# The state AOTAutograd traces under.


def trace_state() -> dict[str, Any]:
    """Global state that changes what AOTAutograd traces from the same graph."""
    if _modes_active():
        raise NotCacheable("state", "a dispatch mode or functorch transform is active")
    return {
        "grad_enabled": torch.is_grad_enabled(),
        "inference_mode": torch.is_inference_mode_enabled(),
        "default_dtype": str(torch.get_default_dtype()),
        "deterministic": [torch.are_deterministic_algorithms_enabled(),
                          torch.is_deterministic_algorithms_warn_only_enabled()],
        "autocast": autocast_state(),
        "sdpa": _sdpa_flags(),
        "functorch_config": _functorch_config_digest(),
    }


def _modes_active() -> bool:
    try:
        if torch._C._len_torch_dispatch_stack() > 0:
            return True
        return torch._C._functorch.peek_interpreter_stack() is not None
    except (AttributeError, RuntimeError):  # cannot tell: assume one is
        return True


def autocast_state() -> dict[str, Any]:
    """Whether autocast is on for each device type, and to which dtype."""
    devices = getattr(torch._C, "_autocast_supported_devices", lambda: ["cpu", "cuda"])()
    state: dict[str, Any] = {"cache": torch.is_autocast_cache_enabled()}
    for device in sorted(devices):
        try:
            on = bool(torch.is_autocast_enabled(device))
            state[device] = [on, str(torch.get_autocast_dtype(device)) if on else None]
        except (RuntimeError, TypeError) as e:
            raise NotCacheable("state", f"autocast state of {device}: {e}") from e
    return state


def _sdpa_flags() -> dict[str, Any]:
    """Which fused attention kernels are allowed (they steer SDPA's decomposition)."""
    flags: dict[str, Any] = {}
    for name in ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled",
                 "cudnn_sdp_enabled", "fp16_bf16_reduction_math_sdp_allowed"):
        getter = getattr(torch.backends.cuda, name, None)
        flags[name] = bool(getter()) if callable(getter) else None
    return flags


def _functorch_config_digest() -> str:
    from torch._functorch import config

    try:
        values = config.get_config_copy()
    except Exception as e:
        raise NotCacheable("state", f"functorch config unreadable: {e}") from e
    plain = [[name, _plain(values[name], name)] for name in sorted(values)]
    return hashlib.sha256(_pack(plain)).hexdigest()


@functools.cache
def frontend_digest() -> str:
    """Hash of the frontend's sources: they call AOTAutograd and build the requests."""
    return hash_source_tree(Path(__file__).parent)


# ---------------------------------------------------------------------------------------
# The key.


def aot_key(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
            options: Mapping[str, Any], target: Mapping[str, Any],
            part_ms: dict[str, float] | None = None) -> KeyInfo:
    """The AOT cache key of a Dynamo graph (before any pass rewrites it); raises
    :class:`NotCacheable`. ``part_ms`` receives each part's milliseconds (the trace's
    arguments: a warm start waits on this key)."""
    makers: list[tuple[str, Callable[[], bytes]]] = [
        ("schema", lambda: _pack(canonical({"aot": AOT_KEY_SCHEMA, **schema()}))),
        ("graph", lambda: graph_wire(gm)),
        ("inputs", lambda: _pack(inputs_wire(gm, example_inputs))),
        ("state", lambda: _pack(canonical(trace_state(), "state"))),
        ("options", lambda: _pack(canonical(dict(options), "options"))),
        ("versions", lambda: _pack(canonical({**versions(), "frontend": frontend_digest()},
                                             "versions"))),
        ("target", lambda: _pack(canonical(dict(target), "target"))),
    ]
    parts = []
    for name, make in makers:
        start = time.perf_counter()
        parts.append((name, make()))
        if part_ms is not None:
            part_ms[name] = round(1e3 * (time.perf_counter() - start), 2)
    return key_from_parts(parts)
