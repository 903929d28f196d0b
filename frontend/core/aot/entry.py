"""The AOT cache's entry on the wire (``frontend.core.aot.cache`` serves it): what a manifest
and its blobs say, written by :func:`to_artifact` and read back, every field checked, by
:func:`entry_from_artifact` (the one place an entry's bytes become a plan).

    manifest {"kind": "aot", "schema": 4, "serve": true, "graph": <Kiln key>,
              "regions": <bool>, "inputs": <count>, "constants": [names],
              "aliases": [[output, input, is_input]],
              "symbolic": <bool>, "dynamic": [[output, [dims]]],
              "training": null | {"backward": <Kiln key>, "backward_regions": <bool>,
                                  "backward_constants": [names],
                                  "outputs", "saved", "symints": <counts>,
                                  "grad_inputs": [bool], "detach": [input index],
                                  "nondiff": [output index],
                                  "mutated": [input index],
                                  "dynamic_saved": [[saved index, [dims]]],
                                  "tangents": [{"output", "sizes", "strides"} or
                                               {"output", "memory_format"}]}}
                                                    # or "serve": false, "reason"
    blobs    "constants.msgpack" (the forward's or inference graph's tensor constants
             by value, if any), "backward_constants.msgpack" (the backward's)

``"regions"``: the key names a region plan (``frontend.core.regions``), not one graph.
``"symbolic"``: the graph has symbolic sizes (its inputs are compared as a request names
them); ``"dynamic"``: the outputs whose dimensions are marked dynamic when served, as
AOTAutograd's runtime marks them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeGuard

import msgpack
import torch

from kiln.artifact_store import Artifact
from kiln.compiler.request import SerializationError, decode_constant, encode_constant
from kiln.frontend.core.aot.training import MEMORY_FORMATS, TangentLayout, TrainingPlan

ENTRY_KIND = "aot"
# 3: "regions" and "backward_regions" (graphs compiled as regions); 4: "aliases" (outputs
# that are views of inputs) and a training entry's "mutated" (inputs its forward writes);
# 5: "symbolic" and "dynamic" (graphs with symbolic sizes)
ENTRY_SCHEMA = 5
CONSTANTS_BLOB = "constants.msgpack"
BACKWARD_CONSTANTS_BLOB = "backward_constants.msgpack"
_HEX = frozenset("0123456789abcdef")
_MAX_CONSTANTS = 4096


class EntryError(ValueError):
    """An AOT cache entry that is not one this client can serve; the message says why."""


@dataclass(frozen=True)
class AotEntry:
    """A checked entry: serve ``graph`` with ``num_inputs`` inputs (and, for a training
    graph, its ``backward`` under ``training``'s runtime), or trace (``reason``)."""

    serve: bool
    graph: str = ""
    num_inputs: int = 0
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    reason: str = ""
    training: TrainingPlan | None = None
    backward: str = ""
    backward_constants: dict[str, torch.Tensor] = field(default_factory=dict)
    regions: bool = False  # ``graph`` is a region plan's key (frontend.core.regions)
    backward_regions: bool = False  # and ``backward``
    aliases: tuple[tuple[int, int, bool], ...] = ()  # frontend.core.aot.cache.input_aliases
    symbolic: bool = False  # symbolic sizes: inputs compared as a request names them
    dynamic: tuple[tuple[int, frozenset[int]], ...] = ()  # cache.dynamic_outputs


def to_artifact(key: str, entry: AotEntry) -> Artifact:
    if not entry.serve:
        return Artifact(key, {"kind": ENTRY_KIND, "schema": ENTRY_SCHEMA, "serve": False,
                              "reason": entry.reason}, {})
    manifest = {"kind": ENTRY_KIND, "schema": ENTRY_SCHEMA, "serve": True,
                "graph": entry.graph, "regions": entry.regions, "inputs": entry.num_inputs,
                "constants": sorted(entry.constants), "training": None,
                "aliases": [list(a) for a in entry.aliases], "symbolic": entry.symbolic,
                "dynamic": [[i, sorted(dims)] for i, dims in entry.dynamic]}
    blobs = {}
    if entry.constants:
        blobs[CONSTANTS_BLOB] = _constants_blob(entry.constants)
    if entry.training is not None:
        manifest["training"] = _training_wire(entry)
        if entry.backward_constants:
            blobs[BACKWARD_CONSTANTS_BLOB] = _constants_blob(entry.backward_constants)
    return Artifact(key, manifest, blobs)


def _constants_blob(constants: dict[str, torch.Tensor]) -> bytes:
    wire = [[name, encode_constant(t, name)] for name, t in sorted(constants.items())]
    return msgpack.packb(wire, use_bin_type=True)


def _training_wire(entry: AotEntry) -> dict[str, Any]:
    plan = entry.training
    assert plan is not None
    tangents: list[dict[str, Any]] = []
    for t in plan.tangents:
        if t.memory_format is not None:
            tangents.append({"output": t.output, "memory_format": t.memory_format})
        else:
            tangents.append({"output": t.output, "sizes": list(t.sizes or ()),
                             "strides": list(t.strides or ())})
    return {"backward": entry.backward, "backward_regions": entry.backward_regions,
            "backward_constants": sorted(entry.backward_constants),
            "outputs": plan.num_outputs, "saved": plan.num_saved,
            "symints": plan.num_symints, "grad_inputs": list(plan.grad_inputs),
            "detach": list(plan.detach_inputs), "nondiff": list(plan.nondiff_outputs),
            "mutated": list(plan.mutated_inputs), "tangents": tangents,
            "dynamic_saved": [[i, sorted(dims)] for i, dims in plan.dynamic_saved]}


def entry_from_artifact(artifact: Artifact) -> AotEntry:
    """The plan a verified artifact describes, after checking every field; raises
    :class:`EntryError`. The store checked its signature and digests; this checks that
    what it says is an AOT entry of this format, naming a well-formed key."""
    m = artifact.manifest
    if not isinstance(m, dict) or m.get("kind") != ENTRY_KIND or m.get("schema") != ENTRY_SCHEMA:
        raise EntryError(f"not an AOT cache entry of schema {ENTRY_SCHEMA}")
    if m.get("serve") is False:
        reason = m.get("reason")
        if not isinstance(reason, str) or not reason.isidentifier() or len(reason) > 64:
            raise EntryError("an entry that is not served without a proper reason")
        return AotEntry(False, reason=reason)
    graph, count, names = m.get("graph"), m.get("inputs"), m.get("constants")
    if m.get("serve") is not True or not _is_key(graph):
        raise EntryError("the entry names no graph key (64 hex digits)")
    if not _is_count(count):
        raise EntryError(f"bad input count {count!r:.40}")
    if not _are_names(names) or "training" not in m:
        raise EntryError("bad constant names")
    regions = m.get("regions")
    if type(regions) is not bool:
        raise EntryError("the entry does not say whether its graph is a region plan")
    aliases = _aliases(m.get("aliases"), count)
    symbolic, dynamic = m.get("symbolic"), _dynamic(m.get("dynamic"))
    if type(symbolic) is not bool or (dynamic and not symbolic):
        raise EntryError("the entry does not say whether its sizes are symbolic")
    entry = AotEntry(True, graph, count, _constants(artifact, names, CONSTANTS_BLOB),
                     regions=regions, aliases=aliases, symbolic=symbolic, dynamic=dynamic)
    training = m["training"]
    if training is None:
        return entry
    if aliases:
        raise EntryError("a training entry with aliasing outputs")
    plan, backward, backward_names = _training_plan(training, count)
    return AotEntry(True, graph, count, entry.constants, training=plan, backward=backward,
                    backward_constants=_constants(artifact, backward_names,
                                                  BACKWARD_CONSTANTS_BLOB),
                    regions=regions, backward_regions=training["backward_regions"],
                    symbolic=symbolic, dynamic=dynamic)


_TRAINING_FIELDS = frozenset({"backward", "backward_regions", "backward_constants",
                              "outputs", "saved",
                              "symints", "grad_inputs", "detach", "nondiff", "tangents",
                              "mutated", "dynamic_saved"})


def _training_plan(w: Any, num_inputs: int) -> tuple[TrainingPlan, str, list[str]]:
    """A training entry's plan, every field checked against the others."""
    if not isinstance(w, dict) or set(w) != _TRAINING_FIELDS:
        raise EntryError("a training entry without exactly its fields")
    if not _is_key(w["backward"]) or not _are_names(w["backward_constants"]) \
            or type(w["backward_regions"]) is not bool:
        raise EntryError("a training entry naming no backward graph key")
    outputs, saved, symints = w["outputs"], w["saved"], w["symints"]
    if not all(_is_count(v) for v in (outputs, saved, symints)):
        raise EntryError("bad output, saved tensor or symint counts")
    grad_inputs, detach, nondiff = w["grad_inputs"], w["detach"], w["nondiff"]
    if not isinstance(grad_inputs, list) or len(grad_inputs) != num_inputs \
            or not all(type(g) is bool for g in grad_inputs):
        raise EntryError("bad grad_inputs")
    if not _are_indices(detach, num_inputs) or not _are_indices(nondiff, outputs):
        raise EntryError("bad detached inputs or non-differentiable outputs")
    mutated = w["mutated"]
    if not _are_indices(mutated, num_inputs) or any(grad_inputs[i] for i in mutated):
        raise EntryError("bad mutated inputs (out of range, or requiring grad)")
    tangents = w["tangents"]
    if not isinstance(tangents, list) or len(tangents) > outputs:
        raise EntryError("bad tangents")
    layouts = tuple(_tangent(t, outputs) for t in tangents)
    if len({t.output for t in layouts}) != len(layouts) \
            or {t.output for t in layouts} & set(nondiff):
        raise EntryError("tangents repeat an output or name a non-differentiable one")
    dynamic_saved = _dynamic(w["dynamic_saved"])
    if any(i >= saved for i, _ in dynamic_saved):
        raise EntryError("a dynamic saved tensor naming no saved tensor")
    plan = TrainingPlan(outputs, saved, symints, tuple(grad_inputs), tuple(detach),
                        tuple(nondiff), layouts, tuple(mutated), dynamic_saved)
    return plan, w["backward"], w["backward_constants"]


def _aliases(w: Any, num_inputs: int) -> tuple[tuple[int, int, bool], ...]:
    """Outputs that alias inputs: each [output, input index in range, is_input], no
    output named twice."""
    if not isinstance(w, list) or len(w) > 1 << 16:
        raise EntryError("no list of aliasing outputs")
    aliases = []
    for a in w:
        if not isinstance(a, list) or len(a) != 3 or not _is_count(a[0]) \
                or type(a[1]) is not int or not 0 <= a[1] < num_inputs or type(a[2]) is not bool:
            raise EntryError("an aliasing output naming no output or no input")
        aliases.append((a[0], a[1], a[2]))
    if len({a[0] for a in aliases}) != len(aliases):
        raise EntryError("an output aliasing two inputs")
    return tuple(aliases)


def _dynamic(w: Any) -> tuple[tuple[int, frozenset[int]], ...]:
    """Outputs and their dynamic dimensions: each [output, [dims]], no output twice."""
    if not isinstance(w, list) or len(w) > 1 << 16:
        raise EntryError("no list of outputs with dynamic dimensions")
    out = []
    for d in w:
        if not isinstance(d, list) or len(d) != 2 or not _is_count(d[0]) \
                or not _are_indices(d[1], 64) or not d[1]:
            raise EntryError("a dynamic output naming no output or no dimensions")
        out.append((d[0], frozenset(d[1])))
    if len({d[0] for d in out}) != len(out):
        raise EntryError("an output named twice among the dynamic ones")
    return tuple(out)


def _tangent(t: Any, outputs: int) -> TangentLayout:
    if not isinstance(t, dict) or type(t.get("output")) is not int \
            or not 0 <= t["output"] < outputs:
        raise EntryError("a tangent naming no output")
    if set(t) == {"output", "memory_format"} and t["memory_format"] in MEMORY_FORMATS:
        return TangentLayout(t["output"], memory_format=t["memory_format"])
    sizes, strides = t.get("sizes"), t.get("strides")
    if set(t) != {"output", "sizes", "strides"} or not isinstance(sizes, list) \
            or not isinstance(strides, list) or len(sizes) != len(strides) or len(sizes) > 64 \
            or not all(type(v) is int and 0 <= v < 1 << 62 for v in sizes + strides):
        raise EntryError("a tangent with neither a layout nor a memory format")
    return TangentLayout(t["output"], tuple(sizes), tuple(strides))


def _is_key(v: Any) -> TypeGuard[str]:
    return isinstance(v, str) and len(v) == 64 and set(v) <= _HEX


def _is_count(v: Any) -> TypeGuard[int]:
    return type(v) is int and 0 <= v <= 1 << 20


def _are_names(v: Any) -> TypeGuard[list[str]]:
    return isinstance(v, list) and len(v) <= _MAX_CONSTANTS \
        and all(isinstance(n, str) and n.isidentifier() for n in v)


def _are_indices(v: Any, bound: int) -> bool:
    return isinstance(v, list) and all(type(i) is int and 0 <= i < bound for i in v) \
        and len(set(v)) == len(v)


def _constants(artifact: Artifact, names: list[str], blob: str) -> dict[str, torch.Tensor]:
    if not names:
        return {}
    try:
        wire = msgpack.unpackb(artifact.blobs[blob], raw=False, use_list=True)
        decoded = {str(name): decode_constant(value, None) for name, value in wire}
    except (KeyError, TypeError, ValueError, IndexError, SerializationError,
            msgpack.UnpackException) as e:
        raise EntryError(f"bad constants blob: {type(e).__name__}: {e}") from e
    if sorted(decoded) != sorted(names):
        raise EntryError("the constants blob does not hold the constants the entry names")
    return decoded
