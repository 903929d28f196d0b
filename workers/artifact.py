"""A ``CompiledGraph`` as a store ``Artifact``, and back.

Blobs (content-addressed by the store, so identical kernels are stored once):

    wrapper.py                     the wrapper's source
    kernels/<name>.py | .cpp       each kernel's source
    kernels/<name>.cubin | .so     each kernel's binary for the artifact's target

Manifest (msgpack-able): ``layout``; the key and its named part digests (what
``kiln explain-miss`` compares); the request's target, versions, options and input
metadata; the graph's name, device type, constants, stats, stage timings and buffer
lifetimes; per kernel its launch metadata (grid sizes, candidate and chosen config,
warps, stages, shared memory), its blobs and whether it was autotuned; for kernels with
dynamic sizes, the config tuned for each size bucket (``graph.buckets``: checked on
load like every field) and its binary (``kernels/<name>.<bucket>.cubin``); and how it was
compiled (farm or in process, wall time), from which ``kiln stats`` counts time saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiln.artifact_store import Artifact
from kiln.compiler.codegen.kernel_spec import KernelSpec, check_kernel_name
from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.kernel_compile import KernelBinary
from kiln.compiler.runtime.buckets import check_buckets

if TYPE_CHECKING:  # loading a package imports neither (nor, through them, sympy)
    from kiln.compiler.keys import KeyInfo
    from kiln.compiler.request import CompileRequest

LAYOUT_VERSION = 1
WRAPPER_BLOB = "wrapper.py"
_GRAPH_FIELDS = ("name", "device_type", "constant_names", "autotuned", "timings", "stats",
                 "lifetimes", "configs", "buckets")
_ENTRY_FIELDS = ("source_blob", "config", "autotune", "launch", "binary", "bucket_binaries")


class ArtifactFormatError(ValueError):
    """A stored artifact this Kiln cannot read (another layout, a missing blob)."""


def _source_blob(spec: KernelSpec) -> str:
    return f"kernels/{spec.name}.{'cpp' if spec.backend == 'cpp' else 'py'}"


def _binary_blob(spec: KernelSpec, binary: KernelBinary) -> str:
    ext = str(binary.metadata.get("binary_ext") or ("so" if spec.backend == "cpp" else "bin"))
    return f"kernels/{spec.name}.{ext}"


def _launch(binary: KernelBinary | None) -> dict[str, Any]:
    if binary is None:
        return {}
    meta = binary.metadata
    return {key: meta[key] for key in ("num_warps", "num_stages", "shared", "num_ctas")
            if key in meta}


def _kernel_entry(compiled: CompiledGraph, spec: KernelSpec, blobs: dict[str, bytes]
                  ) -> dict[str, Any]:
    entry = spec.to_dict()
    source_name = _source_blob(spec)
    blobs[source_name] = entry.pop("source").encode()
    entry["source_blob"] = source_name
    entry["config"] = compiled.config_for(spec)
    entry["autotune"] = compiled.stats.get("autotune", {}).get(spec.name)
    binary = compiled.binaries.get(spec.name)
    entry["launch"] = _launch(binary)
    if binary is not None:
        entry["binary"] = _binary_record(binary, _binary_blob(spec, binary), blobs)
    tuned = compiled.bucket_binaries.get(spec.name, {})
    if tuned:  # a kernel with dynamic sizes: the binary of each size bucket's config
        entry["bucket_binaries"] = {
            bucket: _binary_record(b, _binary_blob(spec, b).replace(".", f".{bucket}.", 1),
                                   blobs) for bucket, b in tuned.items()}
    return entry


def _binary_record(binary: KernelBinary, name: str, blobs: dict[str, bytes]
                   ) -> dict[str, Any]:
    record = binary.to_dict()
    blobs[name] = record.pop("binary")
    record["blob"] = name
    return record


def _read_binary(artifact: Artifact, record: dict[str, Any]) -> KernelBinary:
    record = dict(record)
    record["binary"] = _blob(artifact, record.pop("blob"))
    return KernelBinary.from_dict(record)


def _read_buckets(artifact: Artifact, graph: dict[str, Any], kernels: list[KernelSpec]
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The per-bucket configs and binaries of an artifact's dynamic kernels, checked:
    bucket names and configs well formed, every kernel named there in the artifact,
    each bucket binary compiled for its bucket's config."""
    names = {spec.name for spec in kernels}
    raw = graph.get("buckets") or {}
    if not isinstance(raw, dict):
        raise ArtifactFormatError(f"artifact {artifact.key}: size buckets are not a map")
    try:
        buckets = {check_kernel_name(k): check_buckets(k, v) for k, v in raw.items()}
    except ValueError as e:
        raise ArtifactFormatError(f"artifact {artifact.key}: {e}") from None
    if set(buckets) - names:
        raise ArtifactFormatError(f"artifact {artifact.key}: size buckets of unknown "
                                  f"kernels {sorted(set(buckets) - names)}")
    binaries: dict[str, dict[str, Any]] = {}
    for entry in artifact.manifest["kernels"]:
        for bucket, record in (entry.get("bucket_binaries") or {}).items():
            binary = _read_binary(artifact, record)
            if buckets.get(entry["name"], {}).get(bucket) != binary.config:
                raise ArtifactFormatError(
                    f"artifact {artifact.key}: kernel {entry['name']} bucket {bucket!r} "
                    "has a binary for another config")
            binaries.setdefault(entry["name"], {})[bucket] = binary.to_dict()
    return buckets, binaries


@dataclass(frozen=True)
class StoredRequest:
    """The parts of a graph's request that its artifact's manifest keeps: enough to tune
    the size buckets of a graph served by its key alone (the AOT cache's warm path, which
    has no request) and to publish them under the same key, not to compile it."""

    target: dict[str, Any]
    versions: dict[str, Any]
    options: dict[str, Any]
    inputs: list[Any]  # as the manifest holds them (each input's wire form)

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> StoredRequest | None:
        """None where a field is missing or not of its type (then nothing is tuned)."""
        target, versions = manifest.get("target"), manifest.get("versions")
        options, inputs = manifest.get("options"), manifest.get("inputs")
        if not (isinstance(target, dict) and isinstance(versions, dict)
                and isinstance(options, dict) and isinstance(inputs, list)):
            return None
        return cls(target, versions, options, inputs)


def to_artifact(key: KeyInfo, request: CompileRequest | StoredRequest,
                compiled: CompiledGraph, compile_info: dict[str, Any] | None = None
                ) -> Artifact:
    """The store's view of a compiled graph (see the module docstring for the layout)."""
    inputs = (list(request.inputs) if isinstance(request, StoredRequest)
              else [meta.to_wire() for meta in request.inputs])
    manifest: dict[str, Any] = {
        "layout": LAYOUT_VERSION,
        "key": key.key,
        "key_parts": dict(key.parts),
        "target": request.target,
        "versions": request.versions,
        "options": request.options,
        "inputs": inputs,
    }
    return _with_graph(key.key, manifest, compiled, compile_info)


def superseding(artifact: Artifact, compiled: CompiledGraph,
                compile_info: dict[str, Any] | None = None) -> Artifact:
    """An artifact of the same key and request as ``artifact`` (a verified one) holding
    another compile of its graph: a GPU worker's tuned configs for a precompiled graph."""
    kept = ("layout", "key", "key_parts", "target", "versions", "options", "inputs")
    manifest = {name: artifact.manifest[name] for name in kept}
    return _with_graph(artifact.key, manifest, compiled, compile_info)


def _with_graph(key: str, manifest: dict[str, Any], compiled: CompiledGraph,
                compile_info: dict[str, Any] | None) -> Artifact:
    blobs: dict[str, bytes] = {WRAPPER_BLOB: compiled.wrapper_source.encode()}
    graph = compiled.to_dict()
    manifest = {**manifest, "graph": {name: graph[name] for name in _GRAPH_FIELDS},
                "kernels": [_kernel_entry(compiled, spec, blobs) for spec in compiled.kernels],
                "compile": dict(compile_info or {})}
    return Artifact(key=key, manifest=manifest, blobs=blobs)


def _blob(artifact: Artifact, name: str) -> bytes:
    try:
        return artifact.blobs[name]
    except KeyError:
        raise ArtifactFormatError(f"artifact {artifact.key} has no blob {name!r}") from None


def from_artifact(artifact: Artifact) -> CompiledGraph:
    """The ``CompiledGraph`` an artifact holds; ``ArtifactFormatError`` if unreadable."""
    manifest = artifact.manifest
    if manifest.get("layout") != LAYOUT_VERSION:
        raise ArtifactFormatError(
            f"artifact {artifact.key} has layout {manifest.get('layout')!r}, "
            f"not {LAYOUT_VERSION}")
    kernels, binaries = [], {}
    for entry in manifest["kernels"]:
        spec_fields = {k: v for k, v in entry.items() if k not in _ENTRY_FIELDS}
        spec_fields["source"] = _blob(artifact, entry["source_blob"]).decode()
        spec = KernelSpec.from_dict(spec_fields)
        kernels.append(spec)
        if entry.get("binary") is not None:
            binaries[spec.name] = _read_binary(artifact, entry["binary"])
    graph = dict(manifest["graph"])
    buckets, bucket_binaries = _read_buckets(artifact, graph, kernels)
    compiled = CompiledGraph.from_dict({
        **graph, "buckets": buckets, "bucket_binaries": bucket_binaries,
        "wrapper_source": _blob(artifact, WRAPPER_BLOB).decode(), "kernels": [],
        "binaries": {},
    })
    # The kernels and binaries checked above, as they are (a warm hit's decode: no
    # second round trip through dicts for 50 kernels).
    compiled.kernels, compiled.binaries = kernels, binaries
    return compiled


def cubin_records(manifest: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """Each kernel's binary in a (verified) manifest: {blob name: (kernel name, binary
    record)}: what a hit's launchers load (bucket binaries aside). Malformed entries are
    left out (``from_artifact`` refuses them)."""
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    kernels = manifest.get("kernels")
    for entry in kernels if isinstance(kernels, list) else []:
        record = entry.get("binary") if isinstance(entry, dict) else None
        if isinstance(record, dict) and isinstance(record.get("blob"), str):
            out[record["blob"]] = (str(entry.get("name")), record)
    return out


def compile_seconds(manifest: dict[str, Any]) -> float:
    """How long the artifact took to compile when it was made (0 if not recorded)."""
    return float((manifest.get("compile") or {}).get("wall_s", 0.0))
