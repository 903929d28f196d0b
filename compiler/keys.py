"""Cache keys for compile requests: sha256 over named parts, each hashed and logged.

The key is sha256 over the msgpack list ``[[name, sha256(part)], ...]`` in the fixed
order of :data:`PART_NAMES`. Hashing each part alone first lets a miss be explained
part by part (:func:`explain_miss`) and keeps the key as strong as hashing the parts'
bytes directly.

It lives beside the request format (no Ray, no store): clients hash their requests with
it, and the farm recomputes every key from the request bytes it receives, so a caller
never names the key a result is stored under.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .request import GRAPH_FORMAT_VERSION, REQUEST_FORMAT_VERSION, CompileRequest, canonical
from .versions import SOURCE_SUFFIXES, hash_source_tree, kiln_version, versions

log = logging.getLogger("kiln.keys")

# Bump when the artifact layout (manifest fields, blob roles) changes incompatibly.
ARTIFACT_FORMAT_VERSION = 1
# Bump when the way parts are combined into a key changes.
KEY_FORMAT_VERSION = 1

PART_NAMES = ("schema", "graph", "inputs", "options", "versions", "target")

PART_DESCRIPTIONS = {
    "schema": "request/artifact format versions (a Kiln upgrade changed the format)",
    "graph": "the ATen graph: ops, arguments, node order, output metadata or constant values",
    "inputs": "input shapes, strides, dtypes, device types or storage offsets (or symbolic "
              "sizes and their ranges)",
    "options": "output-affecting compile options",
    "versions": "Kiln version, compiler/ sources, torch or triton version",
    "target": "compile target: GPU backend, arch or warp size; CPU ISA level",
}

# Versions live beside the compiler (workers check them); re-exported for callers here.
__all__ = [
    "PART_NAMES", "SOURCE_SUFFIXES", "KeyInfo", "compute_key", "describe_differences",
    "diff_requests", "explain_miss", "recorded_parts", "hash_source_tree", "key_from_parts",
    "key_parts",
    "kiln_version", "schema", "versions",
]


@dataclass(frozen=True)
class KeyInfo:
    """A request's cache key and the digest of each named part (all hex sha256)."""

    key: str
    parts: dict[str, str] = field(default_factory=dict)


def _pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def schema() -> dict[str, int]:
    return {
        "graph": GRAPH_FORMAT_VERSION,
        "request": REQUEST_FORMAT_VERSION,
        "artifact": ARTIFACT_FORMAT_VERSION,
        "key": KEY_FORMAT_VERSION,
    }


def key_parts(request: CompileRequest) -> list[tuple[str, bytes]]:
    """The named parts of a request's key, in key order, as canonical bytes."""
    return [
        ("schema", _pack(canonical(schema()))),
        ("graph", request.graph),
        ("inputs", _pack(request.inputs_wire())),
        ("options", _pack(canonical(request.options, "options"))),
        ("versions", _pack(canonical(request.versions, "versions"))),
        ("target", _pack(canonical(request.target, "target"))),
    ]


def compute_key(request: CompileRequest) -> KeyInfo:
    """Hash each part alone, then the list of named part digests; log both at DEBUG."""
    return key_from_parts(key_parts(request))


def key_from_parts(named_parts: list[tuple[str, bytes]]) -> KeyInfo:
    """The key of named canonical parts (a request's, or the AOT cache's): each part
    hashed alone, then the list of ``[name, digest]``; both logged at DEBUG."""
    digests = [(name, hashlib.sha256(data).digest()) for name, data in named_parts]
    key = hashlib.sha256(_pack([[name, digest] for name, digest in digests])).hexdigest()
    parts = {name: digest.hex() for name, digest in digests}
    if log.isEnabledFor(logging.DEBUG):
        for name, digest_hex in parts.items():
            log.debug("key %s part %s: %s", key[:16], name, digest_hex)
        log.debug("key %s", key)
    return KeyInfo(key=key, parts=parts)


# ---------------------------------------------------------------------------------------
# Explaining misses.


def explain_miss(parts_a: Mapping[str, str], parts_b: Mapping[str, str]) -> list[str]:
    """One human-readable line per key part that differs between two keys' parts.

    An empty list means every part matches (the keys are equal).
    """
    names = list(PART_NAMES) + sorted((set(parts_a) | set(parts_b)) - set(PART_NAMES))
    lines = []
    for name in names:
        a, b = parts_a.get(name), parts_b.get(name)
        if a == b:
            continue
        what = PART_DESCRIPTIONS.get(name, "unknown part")
        if a is None or b is None:
            side = "first" if b is None else "second"
            lines.append(f"{name}: only in the {side} key ({what})")
        else:
            lines.append(f"{name} differs: {a[:12]} vs {b[:12]} ({what})")
    return lines


INPUT_FIELDS = ("shape", "stride", "dtype", "device", "storage offset")


def recorded_parts(request: CompileRequest) -> dict[str, Any]:
    """What a request's key covers, as plain values: the same fields an artifact's
    manifest records (``workers.artifact``), so either can be explained."""
    return {"graph_bytes": len(request.graph), "inputs": [m.to_wire() for m in request.inputs],
            "symbols": [[r.lower, r.upper] for r in request.symbols],
            "options": dict(request.options), "versions": dict(request.versions),
            "target": dict(request.target)}


def _show(value: Any) -> str:
    if isinstance(value, list):
        return "(" + ", ".join(_show(v) for v in value) + (",)" if len(value) == 1 else ")")
    return repr(value)


def _diff_mapping(label: str, a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    return [f"{label} {k}: {_show(a[k]) if k in a else '<unset>'} vs "
            f"{_show(b[k]) if k in b else '<unset>'}"
            for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k) or (k in a) != (k in b)]


def _diff_inputs(a: list[Any], b: list[Any]) -> list[str]:
    lines = [f"inputs: {len(a)} vs {len(b)} inputs"] if len(a) != len(b) else []
    for i, (wire_a, wire_b) in enumerate(zip(a, b)):
        changes = [f"{name} {_show(x)} vs {_show(y)}"
                   for name, x, y in zip(INPUT_FIELDS, wire_a, wire_b) if x != y]
        if changes:
            lines.append(f"input {i}: " + "; ".join(changes))
    return lines


def describe_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """In words, what differs between two sides' recorded parts (:func:`recorded_parts`,
    or a manifest): which input's shape or dtype, which option with both values, which
    version or target field. Parts a side did not record are skipped."""
    lines = []
    graph_a, graph_b = a.get("graph_bytes"), b.get("graph_bytes")
    if graph_a is not None and graph_b is not None and graph_a != graph_b:
        lines.append(f"graph: the ATen graphs differ ({graph_a} vs {graph_b} bytes)")
    if a.get("inputs") is not None and b.get("inputs") is not None:
        lines += _diff_inputs(list(a["inputs"]), list(b["inputs"]))
    if (a.get("symbols") or []) != (b.get("symbols") or []):
        lines.append(f"symbols: size ranges {_show(a.get('symbols') or [])} vs "
                     f"{_show(b.get('symbols') or [])}")
    for part, label in (("options", "option"), ("versions", "version"), ("target", "target")):
        if a.get(part) is not None and b.get(part) is not None:
            lines += _diff_mapping(label, a[part], b[part])
    return lines


def diff_requests(a: CompileRequest, b: CompileRequest) -> list[str]:
    """Detailed differences between two requests (which input, option, version...)."""
    return describe_differences(recorded_parts(a), recorded_parts(b))
