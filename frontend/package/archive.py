"""AOT packages: one file that runs a model with no Dynamo, no AOTAutograd, no compile.

    kiln package models:make --shapes 8x128 -o model.kiln [--weights] [--gpu sm_90]
    model = kiln.load_package("model.kiln")            # or weights=model.state_dict()
    out = model(x)

Building: ``torch.export`` gives one functional ATen graph with parameters, buffers and
constants lifted to inputs; Kiln's decompositions run on it (``run_decompositions``) and
the graph goes through the client like any other (store, farm, or this process): no
AOTAutograd. For a GPU target on a host without one, the model and inputs are fake CUDA
tensors (``fake_device``) and kernels are cross-compiled (cubins, heuristic configs).

The file (``.kiln``)::

    MAGIC  u64 manifest length  manifest envelope  blob bytes, in the manifest's order

The manifest is a store manifest (``artifact_store.manifest``): it names every blob by
sha256 and size, and is signed with ``KILN_SIGNING_KEY`` when one is set. Its ``meta``
holds the compiled graph's artifact manifest (``workers.artifact``: wrapper, kernels,
binaries as blobs) and the calling convention: which graph input is which parameter,
buffer, constant or user input, the user inputs' shapes, and the output tree. Weights,
when packaged, are blobs of at most ``WEIGHT_CHUNK`` bytes (hashed in parallel on load).

Loading checks every blob's digest, always, and the signature against the configured key
(``KILN_SIGNING_KEY``). Loading runs the package's code, so: a signature that fails, or
one by a key this client does not hold (with no key configured, any signature: it
cannot be checked), is refused; an unsigned package loads only with
``allow_unsigned=True`` (or ``KILN_TRUST_UNSIGNED=1``), for packages you built.
"""

from __future__ import annotations

import hashlib
import os
import struct
import warnings
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kiln.artifact_store import Artifact, parse_keyring
from kiln.artifact_store.errors import IntegrityError, UnsupportedFormat
from kiln.artifact_store.manifest import BlobRef, decode_manifest, encode_manifest
from kiln.artifact_store.signing import Verdict
from kiln.artifact_store.trust import trust_unsigned
from kiln.compiler.tensor_meta import TensorMeta

MAGIC = b"KILNPKG\x01"
PACKAGE_FORMAT = 1
WEIGHT_CHUNK = 64 << 20
_LEN = struct.Struct("<Q")
_INPUT_KINDS = {"PARAMETER": "parameter", "BUFFER": "buffer",
                "CONSTANT_TENSOR": "constant", "USER_INPUT": "user"}


class PackageError(RuntimeError):
    """A package that cannot be built or loaded; the message says which and why."""


# ---------------------------------------------------------------------------------------
# Building.


def export_aten(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor],
                target: dict[str, Any]) -> torch.export.ExportedProgram:
    """``torch.export`` then Kiln's decompositions: one inference ATen graph."""
    from kiln.compiler.decompositions import kiln_decompositions

    table = kiln_decompositions()
    notes: list[str] = []
    if target.get("kind") == "cuda" and not torch.cuda.is_available():
        from kiln.frontend.cross.sdpa_model import SdpaHost, gpu_sdpa

        # No GPU to pick the fused attention kernel: the target's choice (this torch on
        # that GPU), modelled.
        table[torch.ops.aten.scaled_dot_product_attention.default] = gpu_sdpa(
            SdpaHost.for_target(target), notes, fallback=_sdpa_math)
    with torch.no_grad(), warnings.catch_warnings():
        # torch's own run_decompositions deep-copies its module call graph, whose LeafSpec
        # warns that LeafSpec is deprecated: torch's business, not the user's.
        warnings.filterwarnings("ignore", message=r".*LeafSpec.* is deprecated",
                                category=FutureWarning)
        ep = torch.export.export(model, tuple(example_inputs)).run_decompositions(table)
    for note in dict.fromkeys(notes):
        warnings.warn(f"kiln package: {note}", stacklevel=2)
    return ep


def _sdpa_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any,
               dropout_p: float, is_causal: bool, *, scale: float | None,
               enable_gqa: bool) -> torch.Tensor:
    """SDPA's math form (what the table's SDPA entry falls back to, without re-entering
    the table)."""
    return torch.ops.aten._scaled_dot_product_attention_math.default(
        q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)[0]


@dataclass(frozen=True)
class GraphInput:
    kind: str  # parameter, buffer, constant or user
    name: str  # the FQN of a parameter / buffer / constant; the argument name of an input
    meta: TensorMeta


def graph_inputs(ep: torch.export.ExportedProgram) -> list[GraphInput]:
    placeholders = [n for n in ep.graph_module.graph.nodes if n.op == "placeholder"]
    inputs = []
    for spec, node in zip(ep.graph_signature.input_specs, placeholders):
        kind = _INPUT_KINDS.get(spec.kind.name)
        val = node.meta.get("val")
        if kind is None or not isinstance(val, torch.Tensor):
            raise PackageError(f"graph input {node.name} ({spec.kind.name}) is not a tensor "
                               "parameter, buffer, constant or input: not supported")
        name = spec.target if kind != "user" else node.name
        inputs.append(GraphInput(kind, str(name), TensorMeta.from_tensor(val)))
    return inputs


def _output_spec(ep: torch.export.ExportedProgram) -> str:
    for spec in ep.graph_signature.output_specs:
        if spec.kind.name != "USER_OUTPUT":
            raise PackageError(f"the model mutates {spec.target} ({spec.kind.name}); "
                               "packages run inference graphs without mutations (eval())")
    from torch.utils._pytree import treespec_dumps

    return str(treespec_dumps(ep.call_spec.out_spec))


def build_package(model: torch.nn.Module, example_inputs: Sequence[torch.Tensor], *,
                  target: dict[str, Any], config: Any, weights: Mapping[str, torch.Tensor]
                  | None = None) -> bytes:
    """The bytes of a package for ``model`` at these inputs' shapes, for ``target``.

    ``weights`` (FQN -> tensor) are packaged when given; their values must be real (the
    model itself may be on fake devices)."""
    from kiln.frontend.core.client import client_for
    from kiln.frontend.core.compile import request_options
    from kiln.frontend.core.keys import compute_key
    from kiln.frontend.core.serialize import make_request
    from kiln.workers.artifact import to_artifact

    ep = export_aten(model, example_inputs, target)
    inputs, out_spec = graph_inputs(ep), _output_spec(ep)
    gm = ep.graph_module
    vals = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    request = make_request(gm, vals, options=request_options(config), target=target)
    key = compute_key(request)
    result = client_for(config).compile(request, "package")
    artifact = to_artifact(key, request, result.compiled, {"mode": result.source})
    blobs = {f"graph/{name}": data for name, data in artifact.blobs.items()}
    meta: dict[str, Any] = {
        "package": PACKAGE_FORMAT, "artifact": artifact.manifest, "out_spec": out_spec,
        "inputs": [[i.kind, i.name, i.meta.to_wire()] for i in inputs],
        "constants": _pack_tensors(blobs, "constants", _graph_constants(gm)),
        "weights": None,
    }
    if weights is not None:
        wanted = [i.name for i in inputs if i.kind in ("parameter", "buffer", "constant")]
        missing = [name for name in wanted if name not in weights]
        if missing:
            raise PackageError(f"no values for {', '.join(missing[:5])} to package")
        meta["weights"] = _pack_tensors(blobs, "weights", {n: weights[n] for n in wanted})
    refs = {name: BlobRef(hashlib.sha256(data).hexdigest(), len(data))
            for name, data in blobs.items()}
    keyring = parse_keyring(config.signing_key)
    record = encode_manifest(key.key, meta, refs, keyring)
    order = sorted(blobs)
    return b"".join([MAGIC, _LEN.pack(len(record.raw)), record.raw,
                     *(blobs[name] for name in order)])


def module_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` by FQN, tied ones under each name (export
    may name a tied weight by either)."""
    return {**dict(model.named_parameters(remove_duplicate=False)),
            **dict(model.named_buffers(remove_duplicate=False))}


def _graph_constants(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    from kiln.frontend.core.graphs import graph_constants

    return graph_constants(gm)


def _pack_tensors(blobs: dict[str, bytes], prefix: str, tensors: Mapping[str, torch.Tensor]
                  ) -> list[list[Any]]:
    """Tensors as raw bytes in chunks of at most WEIGHT_CHUNK; the index of each."""
    from torch._subclasses.fake_tensor import is_fake

    index: list[list[Any]] = []
    chunk, chunk_id = bytearray(), 0

    def flush() -> None:
        nonlocal chunk, chunk_id
        if chunk:
            blobs[f"{prefix}/{chunk_id:04d}"] = bytes(chunk)
            chunk, chunk_id = bytearray(), chunk_id + 1

    for name, t in tensors.items():
        if is_fake(t) or t.device.type == "meta":
            raise PackageError(f"{prefix[:-1]} {name} has no value (a fake or meta tensor)")
        data = _tensor_bytes(t)
        if chunk and len(chunk) + len(data) > WEIGHT_CHUNK:
            flush()
        index.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), chunk_id,
                      len(chunk), len(data)])
        chunk += data
    flush()
    return index


def _tensor_bytes(t: torch.Tensor) -> bytes:
    import ctypes

    values = t.detach().to("cpu").contiguous()
    nbytes = values.numel() * values.element_size()
    return ctypes.string_at(values.data_ptr(), nbytes) if nbytes else b""


# ---------------------------------------------------------------------------------------
# Reading and verifying (the trust boundary: bytes from a file become code here).


def read_package(path: str | os.PathLike[str], signing_key: str | None = None, *,
                 allow_unsigned: bool = False
                 ) -> tuple[dict[str, Any], dict[str, memoryview]]:
    """The verified manifest meta and blobs of a package file; PackageError otherwise
    (signatures: the module docstring)."""
    data = memoryview(bytearray(Path(path).read_bytes()))
    if bytes(data[:len(MAGIC)]) != MAGIC:
        raise PackageError(f"{path} is not a Kiln package (bad magic)")
    start = len(MAGIC) + _LEN.size
    (length,) = _LEN.unpack(data[len(MAGIC):start])
    try:
        record = decode_manifest(bytes(data[start:start + length]))
    except (IntegrityError, UnsupportedFormat) as e:
        raise PackageError(f"{path}: damaged package manifest ({e})") from None
    _check_signature(path, record, signing_key, allow_unsigned)
    blobs, offset = {}, start + length
    for name in sorted(record.blobs):
        size = record.blobs[name].size
        blobs[name] = data[offset:offset + size]
        offset += size
    if offset != len(data):
        raise PackageError(f"{path}: {len(data) - offset} bytes more or less than its "
                           "manifest names (truncated or tampered)")
    _check_digests(path, record.blobs, blobs)
    meta = record.meta
    if meta.get("package") != PACKAGE_FORMAT:
        raise PackageError(f"{path}: package format {meta.get('package')!r}, this Kiln reads "
                           f"{PACKAGE_FORMAT}")
    return meta, blobs


def _check_signature(path: Any, record: Any, signing_key: str | None,
                     allow_unsigned: bool) -> None:
    spec = signing_key if signing_key is not None else os.environ.get("KILN_SIGNING_KEY")
    keyring = parse_keyring(spec)
    if record.signature is None:
        if allow_unsigned or trust_unsigned():  # asked for (the latter warns at start)
            return
        raise PackageError(f"{path}: refused, the package is unsigned and loading it runs "
                           "its code; pass allow_unsigned=True for a package you built, or "
                           "sign packages (KILN_SIGNING_KEY on the builder)")
    if not keyring:
        raise PackageError(f"{path}: refused, signed by {record.signature.kid} but no "
                           "KILN_SIGNING_KEY is set to check it; set the builder's public "
                           "key (ed25519-pub:...)")
    verdict = keyring.verify(record.body, record.signature)
    if verdict is not Verdict.VALID:
        raise PackageError(f"{path}: refused, signature {verdict.value} for the configured "
                           f"key ({keyring.describe()}); the package was not signed by a "
                           "trusted builder or was modified after signing")


def _check_digests(path: Any, refs: Mapping[str, BlobRef], blobs: Mapping[str, memoryview]
                   ) -> None:
    names = sorted(blobs)

    def ok(name: str) -> bool:
        return hashlib.sha256(blobs[name]).hexdigest() == refs[name].digest

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        results = list(pool.map(ok, names))
    bad = [name for name, good in zip(names, results) if not good]
    if bad:
        raise PackageError(f"{path}: refused, blob {bad[0]} does not match its digest "
                           f"({len(bad)} damaged blob(s): corrupted or tampered)")


# ---------------------------------------------------------------------------------------
# Loading.


class PackagedModel:
    """A loaded package: ``model(*inputs)`` runs the compiled wrapper directly."""

    def __init__(self, call: Callable[[list[Any]], Any], inputs: list[GraphInput],
                 bound: list[torch.Tensor | None], out_spec: Any, device: torch.device,
                 key: str) -> None:
        self._call, self.inputs, self._bound = call, inputs, bound
        self._out_spec, self.device, self.key = out_spec, device, key
        self.user_inputs = [i for i in inputs if i.kind == "user"]

    def __call__(self, *args: torch.Tensor) -> Any:
        if len(args) != len(self.user_inputs):
            raise TypeError(f"package {self.key[:16]} takes {len(self.user_inputs)} "
                            f"inputs, got {len(args)}")
        flat: list[Any] = []
        it = iter(args)
        for spec, value in zip(self.inputs, self._bound):
            if value is None:
                value = next(it)
                self._check(spec, value)
            flat.append(value)
        outs = self._call(flat)
        if self._out_spec is None:
            return tuple(outs)
        from torch.utils._pytree import tree_unflatten

        return tree_unflatten(list(outs), self._out_spec)

    def _check(self, spec: GraphInput, value: Any) -> None:
        meta = spec.meta
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != meta.shape or \
                value.dtype != meta.torch_dtype or value.device.type != self.device.type:
            got = (f"{tuple(value.shape)} {value.dtype} on {value.device}"
                   if isinstance(value, torch.Tensor) else type(value).__name__)
            raise ValueError(f"input {spec.name} of package {self.key[:16]}: expected "
                             f"{meta.shape} {meta.dtype} on {self.device.type}, got {got} "
                             "(a package runs the shapes it was built for)")


def load_package(path: str | os.PathLike[str], *, weights: Any = None,
                 device: str | torch.device | None = None, signing_key: str | None = None,
                 allow_unsigned: bool = False) -> PackagedModel:
    """A callable that runs the package at ``path``: no Dynamo, AOTAutograd or compile.

    ``weights``: a state dict or module giving the parameters and buffers, for a package
    built without ``--weights`` (else the packaged ones are used). Digests are always
    checked; the signature against ``KILN_SIGNING_KEY`` (or ``signing_key``); an
    unsigned package loads only with ``allow_unsigned=True`` (module docstring)."""
    from kiln.compiler.compiled_graph import load
    from kiln.workers.artifact import ArtifactFormatError, from_artifact

    meta, blobs = read_package(path, signing_key, allow_unsigned=allow_unsigned)
    manifest = meta["artifact"]
    graph_blobs = {name[len("graph/"):]: bytes(data) for name, data in blobs.items()
                   if name.startswith("graph/")}
    try:
        compiled = from_artifact(Artifact(manifest["key"], manifest, graph_blobs))
    except (ArtifactFormatError, KeyError, TypeError, ValueError) as e:
        raise PackageError(f"{path}: the compiled graph cannot be read ({e})") from None
    _check_runs_here(path, compiled, manifest.get("target") or {})
    dev = torch.device(device) if device is not None else _default_device(compiled)
    constants = _unpack_tensors(meta["constants"], blobs, "constants", dev)
    inputs = [GraphInput(kind, name, TensorMeta.from_wire(wire))
              for kind, name, wire in meta["inputs"]]
    values = _weights(path, meta, blobs, weights, inputs, dev)
    bound = [None if i.kind == "user" else values[i.name] for i in inputs]
    call = load(compiled, constants, dev)
    return PackagedModel(call, inputs, bound, _out_spec(meta), dev, manifest["key"])


def _check_runs_here(path: Any, compiled: Any, target: dict[str, Any]) -> None:
    """PackageError for a GPU package where this torch has no GPU to run it."""
    if compiled.device_type == "cuda" and not torch.cuda.is_available():
        arch = f" sm_{target['arch']}" if target.get("arch") else ""
        raise PackageError(f"{path} was built for a CUDA GPU{arch}, and this torch has no "
                           "CUDA device (load it on a machine with that GPU)")


def _default_device(compiled: Any) -> torch.device:
    if compiled.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(compiled.device_type)


def _out_spec(meta: dict[str, Any]) -> Any:
    from torch.utils._pytree import treespec_loads

    try:
        return treespec_loads(meta["out_spec"])
    except Exception:  # an output type this process has not registered: flat outputs
        return None


def _weights(path: Any, meta: dict[str, Any], blobs: Mapping[str, memoryview], given: Any,
             inputs: list[GraphInput], device: torch.device) -> dict[str, torch.Tensor]:
    if meta["weights"] is not None and given is None:
        return _unpack_tensors(meta["weights"], blobs, "weights", device)
    if given is None:
        raise PackageError(f"{path} was built without weights: pass weights= (a state dict "
                           "or the model)")
    if isinstance(given, torch.nn.Module):
        given = module_tensors(given)
    values = {}
    for spec in inputs:
        if spec.kind == "user":
            continue
        value = given.get(spec.name)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != spec.meta.shape or \
                value.dtype != spec.meta.torch_dtype:
            raise PackageError(f"weights: {spec.name} must be a {spec.meta.shape} "
                               f"{spec.meta.dtype} tensor for {path}")
        values[spec.name] = value.detach().to(device)
    return values


def _unpack_tensors(index: list[list[Any]], blobs: Mapping[str, memoryview], prefix: str,
                    device: torch.device) -> dict[str, torch.Tensor]:
    from kiln.compiler.tensor_meta import dtype_from_name

    out = {}
    for name, dtype_name, shape, chunk, offset, nbytes in index:
        dtype = dtype_from_name(dtype_name)
        if nbytes == 0:
            out[name] = torch.empty(shape, dtype=dtype, device=device)
            continue
        flat = torch.frombuffer(blobs[f"{prefix}/{chunk:04d}"], dtype=torch.uint8,
                                count=nbytes, offset=offset)
        out[name] = flat.view(dtype).reshape(shape).to(device)
    return out
