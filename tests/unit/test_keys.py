"""Cache keys: stable across processes, names, paths and ordinals; sensitive to the rest."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
import torch._dynamo
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.node import map_aggregate

import kiln.compiler.keys as keys
from kiln.frontend.core.keys import (
    KeyInfo,
    compute_key,
    diff_requests,
    explain_miss,
    hash_source_tree,
)
from kiln.frontend.core.serialize import (
    CompileRequest,
    TensorMeta,
    deserialize_graph,
    make_request,
    serialize_graph,
)

REPO = Path(__file__).resolve().parents[2]
CUDA_TARGET = {"kind": "cuda", "arch": 90, "warp_size": 32}
CPU_TARGET = {"kind": "cpu", "isa": "x86-64-v3"}
VERSIONS = {"kiln": "0.1.0", "compiler": "c0ffee", "torch": "2.13", "triton": None}

# Run as a script in fresh interpreters, and exec'd here: prints the keys of a make_fx
# graph and of a Dynamo + AOTAutograd forward graph of the same model.
KEY_SCRIPT = """
import torch
import torch._dynamo
from functorch.compile import make_boxed_func
from torch._dynamo.backends.common import aot_autograd
from torch.fx.experimental.proxy_tensor import make_fx
from kiln.frontend.core.keys import compute_key
from kiln.frontend.core.serialize import make_request

def model(x, w):
    scale = torch.tensor([0.5, 2.0, float("inf")])
    return (torch.nn.functional.linear(x, w).relu() * scale).softmax(-1).sum(dim=0)

def script_keys():
    inputs = [torch.ones(4, 8), torch.ones(3, 8)]
    target = {"kind": "cuda", "arch": 90, "warp_size": 32}
    graphs = [make_fx(model)(*inputs)]
    def capture(gm, _):
        graphs.append(gm)
        return make_boxed_func(gm.forward)
    torch._dynamo.reset()
    torch.compile(model, backend=aot_autograd(fw_compiler=capture))(*inputs)
    torch._dynamo.reset()
    requests = [make_request(g, inputs, options={"opt": 1}, target=target) for g in graphs]
    return [compute_key(r).key for r in requests]

if __name__ == "__main__":
    print(" ".join(script_keys()))
"""


def pointwise(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return ((a + b) * c.relu()).sum(dim=-1)


def request_for(
    gm: torch.fx.GraphModule,
    inputs: Sequence[torch.Tensor | TensorMeta],
    *,
    options: dict[str, Any] | None = None,
    target: dict[str, Any] | None = None,
    versions: dict[str, Any] | None = None,
) -> CompileRequest:
    return make_request(
        gm,
        inputs,
        options=options if options is not None else {"max_autotune": False},
        target=target if target is not None else CUDA_TARGET,
        versions=versions if versions is not None else VERSIONS,
    )


def traced_key(fn: Callable[..., Any], inputs: Sequence[torch.Tensor], **kw: Any) -> KeyInfo:
    return compute_key(request_for(make_fx(fn)(*inputs), inputs, **kw))


def changed_parts(a: KeyInfo, b: KeyInfo) -> list[str]:
    assert a.key != b.key
    lines = explain_miss(a.parts, b.parts)
    return [line.split()[0].rstrip(":") for line in lines]


# ---------------------------------------------------------------------------------------
# Stability.


def test_key_shape() -> None:
    info = traced_key(pointwise, [torch.randn(4, 6)] * 3)
    assert len(info.key) == 64 and int(info.key, 16) >= 0
    assert list(info.parts) == list(keys.PART_NAMES)


def test_same_key_in_separate_processes(tmp_path: Path) -> None:
    script = tmp_path / "key_script.py"
    script.write_text(KEY_SCRIPT)
    procs = []
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                cwd=tmp_path,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.append(out.split())
    namespace: dict[str, Any] = {"__name__": "kiln_key_script"}
    exec(compile(KEY_SCRIPT, "<somewhere else>", "exec"), namespace)
    here = namespace["script_keys"]()
    assert outputs[0] == outputs[1] == here
    assert len(here) == 2 and here[0] != here[1]


def test_node_names_and_stack_traces_do_not_matter() -> None:
    inputs = [torch.randn(4, 6)] * 3
    gm = make_fx(pointwise)(*inputs)
    before = compute_key(request_for(gm, inputs))
    for i, node in enumerate(gm.graph.nodes):
        node.name = f"renamed_{i}"
        if node.op == "placeholder":
            node.target = node.name
        node.meta["stack_trace"] = f'File "/elsewhere/file_{i}.py", line {i}, in f'
        node.meta["nn_module_stack"] = {"x": ("mod", object)}
    gm.recompile()
    assert compute_key(request_for(gm, inputs)) == before


def _capture_from_file(path: Path, inputs: Sequence[torch.Tensor]) -> torch.fx.GraphModule:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, _: Any) -> Any:
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    torch.compile(module.model, backend=aot_autograd(fw_compiler=capture))(*inputs)
    torch._dynamo.reset()
    (gm,) = graphs
    return gm


def test_file_path_does_not_matter(tmp_path: Path) -> None:
    source = "import torch\n\ndef model(x):\n    return torch.sigmoid(x) * x + 1\n"
    first = tmp_path / "one" / "model_a.py"
    second = tmp_path / "two" / "deeper" / "model_b.py"
    for path, prefix in ((first, ""), (second, "# shifted\n\n\n")):
        path.parent.mkdir(parents=True)
        path.write_text(prefix + source)
    inputs = [torch.randn(4, 6)]
    gm_a, gm_b = (_capture_from_file(p, inputs) for p in (first, second))
    traces = " ".join(str(n.meta.get("stack_trace")) for n in gm_a.graph.nodes)
    assert "model_a.py" in traces  # the paths really are in the graphs' metadata
    assert compute_key(request_for(gm_a, inputs)) == compute_key(request_for(gm_b, inputs))


def with_full_on_input_device() -> Callable[[torch.Tensor], torch.Tensor]:
    def model(x: torch.Tensor) -> torch.Tensor:
        return torch.full((4, 6), 2.0, device=x.device) * x.relu()

    return model


def on_device(gm: torch.fx.GraphModule, device: str) -> torch.fx.GraphModule:
    """A copy of a CPU graph whose device args and meta vals are on ``device``."""
    copy = deserialize_graph(serialize_graph(gm))
    mode = FakeTensorMode()

    def move_val(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        with mode:
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device)

    def move_arg(a: Any) -> Any:
        return torch.device(device) if isinstance(a, torch.device) else a

    for old, new in zip(gm.graph.nodes, copy.graph.nodes):
        if "val" in old.meta:
            new.meta["val"] = map_aggregate(old.meta["val"], move_val)
        new.args = map_aggregate(new.args, move_arg)
        new.kwargs = map_aggregate(new.kwargs, move_arg)
    return copy


def test_device_ordinal_does_not_matter() -> None:
    x = torch.randn(4, 6)
    gm = make_fx(with_full_on_input_device())(x)
    assert any(isinstance(v, torch.device) for n in gm.graph.nodes for v in n.kwargs.values())
    infos = {}
    for device in ("cuda:0", "cuda:3", "cpu"):
        moved = on_device(gm, device)
        metas = [
            TensorMeta.from_tensor(n.meta["val"])
            for n in moved.graph.nodes
            if n.op == "placeholder"
        ]
        infos[device] = compute_key(request_for(moved, metas))
    assert infos["cuda:0"] == infos["cuda:3"]
    assert set(changed_parts(infos["cuda:0"], infos["cpu"])) == {"graph", "inputs"}


def test_meta_ignores_ordinal() -> None:
    with FakeTensorMode():
        t0 = torch.empty(2, 3, device="cuda:0")
        t3 = torch.empty(2, 3, device="cuda:3")
    assert TensorMeta.from_tensor(t0) == TensorMeta.from_tensor(t3)
    assert TensorMeta.from_tensor(t0).device_type == "cuda"


def test_logging_options_do_not_matter() -> None:
    inputs = [torch.randn(4, 6)] * 3
    a = traced_key(pointwise, inputs, options={"max_autotune": True})
    b = traced_key(
        pointwise,
        inputs,
        options={
            "max_autotune": True,
            "logs": "output_code",
            "debug": "1",
            "store": "s3://bucket/x",
            "farm": "ray://head:10001",
        },
    )
    assert a == b


# ---------------------------------------------------------------------------------------
# Sensitivity, and explain_miss naming the part.


def scaled_by(values: list[float]) -> Callable[[torch.Tensor], torch.Tensor]:
    def model(x: torch.Tensor) -> torch.Tensor:
        return x * torch.tensor(values)

    return model


def test_constant_value_changes_graph_part() -> None:
    x = torch.randn(4, 3)
    a = traced_key(scaled_by([1.0, 2.0, 3.0]), [x])
    b = traced_key(scaled_by([1.0, 2.0, 3.5]), [x])
    assert changed_parts(a, b) == ["graph"]


def test_retraced_shape_or_dtype_changes_graph_and_inputs() -> None:
    base = traced_key(pointwise, [torch.randn(4, 6)] * 3)
    shape = traced_key(pointwise, [torch.randn(4, 7)] * 3)
    dtype = traced_key(pointwise, [torch.randn(4, 6, dtype=torch.float16)] * 3)
    # Node output metas are part of the graph, so both parts change.
    assert changed_parts(base, shape) == ["graph", "inputs"]
    assert changed_parts(base, dtype) == ["graph", "inputs"]


@pytest.mark.parametrize(
    "change",
    [
        {"shape": (4, 7)},
        {"stride": (1, 4)},
        {"dtype": "bfloat16"},
        {"storage_offset": 8},
        {"device_type": "cpu"},
    ],
)
def test_input_meta_changes_inputs_part(change: dict[str, Any]) -> None:
    gm = make_fx(pointwise)(*[torch.randn(4, 6)] * 3)
    meta = TensorMeta((4, 6), (6, 1), "float32", "cuda", 0)
    a = compute_key(request_for(gm, [meta] * 3))
    b = compute_key(request_for(gm, [meta] * 2 + [dataclasses.replace(meta, **change)]))
    assert changed_parts(a, b) == ["inputs"]


@pytest.mark.parametrize(
    ("field", "other", "part"),
    [
        ("options", {"max_autotune": True}, "options"),
        ("options", {"max_autotune": False, "cpu_backend": "triton-interpret"}, "options"),
        ("target", {"kind": "cuda", "arch": 80, "warp_size": 32}, "target"),
        ("target", CPU_TARGET, "target"),
        ("versions", {**VERSIONS, "compiler": "beef"}, "versions"),
        ("versions", {**VERSIONS, "triton": "3.6.0"}, "versions"),
    ],
)
def test_each_part_is_named(field: str, other: dict[str, Any], part: str) -> None:
    inputs = [torch.randn(4, 6)] * 3
    a = traced_key(pointwise, inputs)
    b = traced_key(pointwise, inputs, **{field: other})
    assert changed_parts(a, b) == [part]
    (line,) = explain_miss(a.parts, b.parts)
    assert a.parts[part][:12] in line and b.parts[part][:12] in line


def test_schema_change_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = [torch.randn(4, 6)] * 3
    a = traced_key(pointwise, inputs)
    monkeypatch.setattr(keys, "ARTIFACT_FORMAT_VERSION", keys.ARTIFACT_FORMAT_VERSION + 1)
    assert changed_parts(a, traced_key(pointwise, inputs)) == ["schema"]


def test_explain_miss_edge_cases() -> None:
    info = traced_key(pointwise, [torch.randn(4, 6)] * 3)
    assert explain_miss(info.parts, dict(info.parts)) == []
    partial = {k: v for k, v in info.parts.items() if k != "target"}
    assert explain_miss(info.parts, partial) == [
        f"target: only in the first key ({keys.PART_DESCRIPTIONS['target']})"
    ]


def test_diff_requests_details() -> None:
    gm = make_fx(pointwise)(*[torch.randn(4, 6)] * 3)
    meta = TensorMeta((4, 6), (6, 1), "float32", "cuda", 0)
    a = request_for(gm, [meta] * 3)
    b = request_for(
        gm,
        [meta, meta, dataclasses.replace(meta, stride=(1, 4))],
        options={"max_autotune": True},
        target={**CUDA_TARGET, "arch": 80},
    )
    lines = diff_requests(a, b)
    assert lines[0] == "input 2: stride (6, 1) vs (1, 4)"
    assert "option max_autotune: False vs True" in lines
    assert "target arch: 90 vs 80" in lines
    c = request_for(gm, [meta, meta, dataclasses.replace(meta, shape=(8, 6), dtype="float16")])
    assert diff_requests(a, c)[0] == "input 2: shape (4, 6) vs (8, 6); dtype 'float32' vs 'float16'"
    assert diff_requests(a, a) == []


def test_parts_logged_at_debug(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="kiln.keys")
    info = traced_key(pointwise, [torch.randn(4, 6)] * 3)
    text = caplog.text
    for name, digest in info.parts.items():
        assert f"part {name}: {digest}" in text
    assert info.key in text


# ---------------------------------------------------------------------------------------
# Versions.


def test_versions_cover_kiln_compiler_torch_triton() -> None:
    found = keys.versions()
    assert set(found) == {"kiln", "compiler", "torch", "triton"}
    assert found["torch"] == str(torch.__version__)
    from kiln import compiler

    assert found["compiler"] == hash_source_tree(Path(compiler.__file__).parent)
    assert found["kiln"] not in (None, "")


def test_source_hash_tracks_sources_only(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    base = hash_source_tree(tmp_path)
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"\0junk")
    (tmp_path / "notes.md").write_text("not a source\n")
    assert hash_source_tree(tmp_path) == base
    (tmp_path / "pkg" / "a.py").write_text("x = 3\n")
    edited = hash_source_tree(tmp_path)
    assert edited != base
    (tmp_path / "pkg" / "a.py").rename(tmp_path / "pkg" / "c.py")
    assert hash_source_tree(tmp_path) not in (base, edited)
