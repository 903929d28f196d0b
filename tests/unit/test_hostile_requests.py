"""Requests and manifests as an attacker writes them: each test is the attack of the
2026-12-01 review (issue 14), refused with a message naming what was refused."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from kiln.artifact_store import ConfigError, open_store, parse_keyring
from kiln.compiler.codegen.kernel_spec import KernelSpec
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.kernel_compile import KernelBinary
from kiln.compiler.request import (
    MAX_CONSTANT_PADDING,
    CompileRequest,
    SerializationError,
    compile_options,
    deserialize_graph,
)
from kiln.frontend.core.serialize import make_request
from kiln.workers.artifact import from_artifact


def _graph_wire(fn: Any, *args: torch.Tensor) -> list[Any]:
    request = make_request(trace_aten(fn, list(args)), list(args), options={},
                           target={"kind": "cpu"})
    return msgpack.unpackb(request.graph, raw=False)  # type: ignore[no-any-return]


def _with_target(wire: list[Any], target: list[str]) -> bytes:
    nodes = wire[2]
    call = next(node for node in nodes if node[0] == "call_function")
    call[1] = target
    return msgpack.packb(wire, use_bin_type=True)


@pytest.mark.parametrize("target", [
    ["packet", "load_library.__call__"],      # torch.ops.load_library: dlopen any path
    ["op", "aten.__class__.__init__"],       # dunders on an allowed namespace
    ["packet", "_ops.ops"],                  # a private module attribute
    ["packet", "import_module.__call__"],    # torch.ops.import_module: import anything
    ["op", "mylib.evil_op.default"],         # a namespace outside the allowlist
    ["op", "_c10d_functional.send.default"],  # a collective no graph of Kiln's names
    ["op", "torchvision._cuda_version.default"],  # torchvision: detection ops only
])
def test_op_outside_the_allowlist_is_refused(target: list[str]) -> None:
    x = torch.randn(4, 4)
    data = _with_target(_graph_wire(lambda a: a.relu(), x), target)
    with pytest.raises(SerializationError, match="not allowed in a request"):
        deserialize_graph(data)


def test_ops_torch_defines_with_torch_library_resolve() -> None:
    """torch.nn's chunked linear cross entropy is a ``torch_nn`` custom op: a graph holding
    it compiles (the op a per-op fallback) instead of running eagerly. Dunders stay out."""
    from kiln.compiler.request import _resolve_target

    try:  # torch registers these ops when the module is first imported
        target = _resolve_target(["op", "torch_nn._linear_cross_entropy_batch_chunked.default"])
    except SerializationError as e:
        assert "unknown op" in str(e)
        pytest.skip("this torch has no chunked linear cross entropy")
    assert target is torch.ops.torch_nn._linear_cross_entropy_batch_chunked.default
    with pytest.raises(SerializationError, match="not allowed in a request"):
        _resolve_target(["op", "torch_nn.__class__.__init__"])


def test_the_functional_collectives_of_tensor_parallel_graphs_resolve() -> None:
    from kiln.compiler.request import _resolve_target

    ops = torch.ops._c10d_functional
    assert _resolve_target(["op", "_c10d_functional.all_reduce.default"]) is \
        ops.all_reduce.default
    assert _resolve_target(["op", "_c10d_functional.wait_tensor.default"]) is \
        ops.wait_tensor.default


def test_torchvision_detection_ops_pass_the_allowlist() -> None:
    """Faster and Mask R-CNN graphs hold ``torchvision.roi_align``: allowed by name (a
    per-op fallback), resolved where torchvision loads; where it does not (this CPU
    machine's torchvision was built for another torch) the error names the op."""
    from kiln.compiler.request import _resolve_target

    try:
        target = _resolve_target(["op", "torchvision.roi_align.default"])
    except SerializationError as e:
        assert "unknown op 'torchvision.roi_align.default'" in str(e)
    else:
        assert target is torch.ops.torchvision.roi_align.default


def test_symbolic_max_of_sizes_round_trips() -> None:
    """``torch.sym_max`` of two sizes (a detection model's image batching) is a listed
    call target: a request holding it serializes and names the same function back."""
    from kiln.compiler.request import _encode_target, _resolve_target

    for fn in (torch.sym_max, torch.sym_min):
        assert _resolve_target(_encode_target(fn)) is fn
    with pytest.raises(SerializationError, match="bad call target"):
        _resolve_target(["py", "torch.load"])


def test_aten_ops_with_private_names_still_resolve() -> None:
    from kiln.compiler.request import _resolve_target

    assert _resolve_target(["op", "aten._softmax.default"]) is torch.ops.aten._softmax.default
    assert _resolve_target(["packet", "aten._to_copy"]) is torch.ops.aten._to_copy
    assert _resolve_target(["op", "prims.convert_element_type.default"]) is \
        torch.ops.prims.convert_element_type.default
    with pytest.raises(SerializationError, match="not an operator overload"):
        _resolve_target(["op", "aten.add.overloads"])


def test_request_options_are_filtered_to_compile_options() -> None:
    hostile = {"debug": "1", "debug_dir": "/etc/kiln-owned", "logs": "output_code",
               "store": "s3://elsewhere", "cpu_backend": "cpp", "autotune": False,
               "max_autotune": True, "gemm_choices": {"choice-x": {}}}
    assert compile_options(hostile) == {"cpu_backend": "cpp", "autotune": False,
                                        "max_autotune": True}


def _constant_wire(offset: int) -> bytes:
    from kiln.compiler.request import serialize_graph

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (x, graph.get_attr("c"))))
    root = torch.nn.Module()
    root.c = torch.randn(3)  # type: ignore[assignment]
    wire = msgpack.unpackb(serialize_graph(torch.fx.GraphModule(root, graph)), raw=False)
    node = next(n for n in wire[2] if n[0] == "get_attr")
    node[1][1][4] = offset  # the constant's storage offset
    return msgpack.packb(wire, use_bin_type=True)


def test_constant_storage_offset_is_bounded() -> None:
    with pytest.raises(SerializationError, match="asks for a storage of"):
        deserialize_graph(_constant_wire(MAX_CONSTANT_PADDING + 1))
    with pytest.raises(SerializationError, match="out of bounds"):
        deserialize_graph(_constant_wire(2**62))
    assert deserialize_graph(_constant_wire(5)) is not None  # a small offset is fine


def test_input_metadata_is_bounded() -> None:
    request = make_request(trace_aten(lambda a: a * 2, [torch.randn(4)]), [torch.randn(4)],
                           options={}, target={"kind": "cpu"})
    wire = msgpack.unpackb(request.to_bytes(), raw=False)
    wire[3][0] = [[4] * 40, [1] * 40, "float32", "cpu", 0]
    with pytest.raises(SerializationError, match="out of bounds"):
        CompileRequest.from_bytes(msgpack.packb(wire, use_bin_type=True))
    wire[3][0] = [[4], [1], "float32", "cpu", -3]
    with pytest.raises(SerializationError, match="out of bounds"):
        CompileRequest.from_bytes(msgpack.packb(wire, use_bin_type=True))


def _spec(name: str) -> dict[str, Any]:
    return {"name": name, "backend": "triton", "kind": "pointwise",
            "source": "def k(): pass\n", "arg_buffers": ["buf0"],
            "signature": {"in_ptr0": "*fp32", "XBLOCK": "constexpr"}, "xnumel": 8,
            "rnumel": 1, "configs": [{"XBLOCK": 8, "num_warps": 1, "num_stages": 1}]}


@pytest.mark.parametrize("name", ["/tmp/kiln-owned", "../../escape", "__import__",
                                  "a.b", "x" * 300, ""])
def test_manifest_kernel_name_must_be_an_identifier(name: str) -> None:
    with pytest.raises(ValueError, match="invalid kernel name"):
        KernelSpec.from_dict(_spec(name))
    assert KernelSpec.from_dict(_spec("triton_poi_fused_add_0")).name == "triton_poi_fused_add_0"


def test_absolute_kernel_name_in_binary_metadata_writes_nothing(tmp_path: Path) -> None:
    """The Triton launcher wrote `tmpdir / name.cubin`: an absolute name escaped it."""
    pytest.importorskip("triton")
    from kiln.compiler.runtime.triton_launcher import load_binary

    target = tmp_path / "planted"
    spec = KernelSpec.from_dict(_spec("triton_poi_fused_add_0"))
    binary = KernelBinary("triton_poi_fused_add_0", {"kind": "cuda", "arch": 90},
                          {"XBLOCK": 8}, b"\x7fELF not a cubin",
                          {"name": str(target), "binary_ext": "cubin"})
    with pytest.raises(ValueError, match="invalid kernel name"):
        load_binary(spec, binary)
    assert not list(tmp_path.iterdir())
    evil_ext = dataclasses.replace(binary, metadata={"name": "k", "binary_ext": "/x/../y"})
    with pytest.raises(ValueError, match="unknown binary kind"):
        load_binary(spec, evil_ext)


def test_launcher_temp_folder_is_removed_even_when_the_kernel_fails_to_load(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher's temporary folders were never removed: one per kernel load."""
    pytest.importorskip("triton")
    import tempfile

    import triton.compiler.compiler as triton_compiler

    from kiln.compiler.runtime.triton_launcher import load_binary

    written: list[list[str]] = []

    def refused(src: Any, group: dict[str, str], fn_hash: str) -> None:
        written.append(sorted(Path(p).name for p in group.values() if Path(p).exists()))
        raise RuntimeError("the driver refused the cubin")

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(triton_compiler, "CompiledKernel", refused)
    spec = KernelSpec.from_dict(_spec("triton_poi_fused_add_0"))
    binary = KernelBinary("triton_poi_fused_add_0", {"kind": "cuda", "arch": 90},
                          {"XBLOCK": 8}, b"\x7fELF not a cubin",
                          {"name": "triton_poi_fused_add_0", "binary_ext": "cubin"})
    with pytest.raises(RuntimeError, match="refused the cubin"):
        load_binary(spec, binary)
    assert written == [["triton_poi_fused_add_0.cubin", "triton_poi_fused_add_0.json"]]
    assert not list(tmp_path.iterdir())


def test_artifact_with_a_path_for_a_kernel_name_is_refused() -> None:
    from kiln.artifact_store import Artifact

    entry = {k: v for k, v in _spec("/tmp/kiln-owned").items() if k != "source"}
    entry.update(source_blob="kernels/k.py", config={}, autotune=None, launch={})
    manifest = {"layout": 1, "kernels": [entry],
                "graph": {"name": "g", "device_type": "cpu", "constant_names": [],
                          "autotuned": False, "timings": {}, "stats": {}, "lifetimes": "",
                          "configs": {}}}
    artifact = Artifact("a" * 64, manifest, {"wrapper.py": b"", "kernels/k.py": b""})
    with pytest.raises(ValueError, match="invalid kernel name"):
        from_artifact(artifact)


@pytest.mark.parametrize("spec", ["ed25519_pub:" + "A" * 43 + "=", "hmac-secret:abc",
                                  "ed25519pub:abc", "a-bare-secret"])
def test_mistyped_key_prefix_is_an_error_not_an_hmac_secret(spec: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="malformed signing key") as raised:
        parse_keyring(spec)
    assert "A" * 43 not in str(raised.value)  # the key is not echoed
    store = open_store(tmp_path / "store", signing_key=spec, stats_file=False)
    assert not store.can_publish and store.get("a" * 64) is None  # fails closed
    with pytest.raises(ConfigError):
        open_store(tmp_path / "store", signing_key=spec, strict=True)


def _finishes(fn: Any, within_s: float = 5.0) -> BaseException | None:
    """What ``fn()`` raised, asserting it finished within ``within_s`` (a decoder that
    hangs on hostile bytes fails here instead of holding the suite)."""
    import threading

    raised: list[BaseException | None] = [None]

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # the caller checks which
            raised[0] = e

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(within_s)
    assert not thread.is_alive(), f"decoding hung for more than {within_s}s"
    return raised[0]


@pytest.mark.parametrize("size", [
    ["^", [3, 10**9]],                               # issue 33 row 8: sympy folds it
    ["^", [["^", [["^", [7, 64]], 64]], 64]],         # a tower of legal-looking powers
    ["^", [["s", 0], 10**6]],                         # (undeclared, and a huge exponent)
    ["*", [2**61] * 600],                              # more nodes than an expression has
    ["+", [["*", [2**40, 2**40]]]],                    # folds out of range
])
def test_hostile_size_expression_is_refused_quickly(size: Any) -> None:
    """Issue 33 row 8: a token holder's tensor size ``3 ** 10**9`` held the
    coordinator in sympy; every other client waited for the farm's timeout."""
    request = make_request(trace_aten(lambda a: a * 2, [torch.randn(4)]), [torch.randn(4)],
                           options={}, target={"kind": "cpu"})
    wire = msgpack.unpackb(request.to_bytes(), raw=False)
    wire[3][0] = [[size], [1], "float32", "cpu", 0]
    data = msgpack.packb(wire, use_bin_type=True)
    error = _finishes(lambda: CompileRequest.from_bytes(data))
    assert isinstance(error, (SerializationError, ValueError)), error


def test_honest_size_expressions_still_decode() -> None:
    from kiln.compiler.symwire import decode_expr

    s0 = ["s", 0]
    assert str(decode_expr(["^", [s0, 2]], 1)) == "s0**2"
    assert int(decode_expr(["^", [2, 40]], 0)) == 2**40
    assert str(decode_expr(["*", [["+", [s0, 1]], 4]], 1)) == "4*s0 + 4"
