"""Fleet precompilation from this CPU-only host for a GPU (sm_90): fake CUDA tracing on
the kiln backend's own path, keys equal to a GPU client's, cubins in the store, the CI
gate (--check), ranges, and keys for another host's versions (--versions-from)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.artifact_store import open_store
from kiln.compiler.request import deserialize_graph
from kiln.compiler.runtime.kernel_files import interpreter_active
from kiln.frontend.cli.precompile_gpu import expand_shape_range
from kiln.frontend.config import KilnConfig
from kiln.frontend.core import compile as kiln_compile
from kiln.frontend.core.client import reset_clients
from kiln.frontend.core.keys import compute_key, versions
from kiln.frontend.cross.cuda_guard_shim import ensure_fake_cuda_guard
from kiln.frontend.cross.fake_device import (
    FakeDeviceError,
    fake_inputs,
    fake_module,
    parse_gpu,
    trace_requests,
)
from tests import fleet_models

ROOT = Path(__file__).resolve().parents[2]
H200_BLOCK_HALF_KEY = "b78137549768b8748cf69f50d112750b7cd5c6b79f582a9cfaccda7f03848692"
H200 = {"kind": "cuda", "backend": "cuda", "arch": 90, "warp_size": 32, "sm_count": 132}

pytestmark = pytest.mark.skipif(interpreter_active() or torch.cuda.is_available(),
                                reason="a CPU-only host with Triton's compiler (not its "
                                "interpreter)")


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    url = f"file://{tmp_path / 'store'}"
    for name, value in {"KILN_STORE": url, "KILN_LOCAL_CACHE": "off",
                        "KILN_STATS_FILE": "off", "KILN_FARM": "inprocess"}.items():
        monkeypatch.setenv(name, value)
    reset_clients()
    yield url
    reset_clients()


def run_cli(args: Sequence[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``kiln ARGS`` in a fresh process (its keys are computed apart from this one's)."""
    return subprocess.run([sys.executable, "-m", "kiln.frontend.cli.main", *args], cwd=ROOT,
                          env={**os.environ, **env, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)


def client_keys(make: Callable[[], torch.nn.Module], shapes: list[tuple[int, ...]],
                dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, device: str) -> list[str]:
    """The keys a client on an H200 computes: ``torch.compile(backend="kiln")`` as users
    call it, on fake CUDA tensors, the device reporting capability 9.0 and 132 SMs. Only
    compiling and loading are replaced (this host cannot run CUDA kernels): the request
    is the backend's own (``build_request``, ``target_for``)."""
    from torch._functorch.aot_autograd import make_boxed_func

    ensure_fake_cuda_guard()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: SimpleNamespace(multi_processor_count=132))
    keys: list[str] = []
    mode = FakeTensorMode()

    def record(gm: torch.fx.GraphModule, inputs: Sequence[Any], config: KilnConfig,
               name: str) -> Any:
        keys.append(compute_key(kiln_compile.build_request(gm, inputs, config,
                                                           name=name)).key)

        def run(*args: Any) -> Any:
            with mode:
                return gm.forward(*args)

        return make_boxed_func(run)

    monkeypatch.setattr(kiln_compile, "compile_and_load", record)
    model = fake_module(make(), mode, device)
    inputs = fake_inputs(shapes, dtype, mode, device)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend="kiln", dynamic=False)(*inputs)
    return keys


def test_gpu_names_and_ranges() -> None:
    assert parse_gpu("h200") == parse_gpu("sm_90") == parse_gpu("90") == H200
    assert parse_gpu("A100")["arch"] == 80 and parse_gpu("sm_80")["sm_count"] == 108
    assert parse_gpu("sm_90:114") == {**H200, "sm_count": 114} == parse_gpu("h100-pcie")
    with pytest.raises(FakeDeviceError, match="unknown GPU 'b9000'"):
        parse_gpu("b9000")
    assert expand_shape_range("1..8x16") == [[(1, 16)], [(2, 16)], [(4, 16)], [(8, 16)]]
    assert expand_shape_range("8..24:8x4,4") == [[(8, 4), (4,)], [(16, 4), (4,)],
                                                 [(24, 4), (4,)]]


@pytest.mark.parametrize("name, dtype", [("mlp", torch.float32),
                                         ("block_no_attention_half", torch.float16)])
def test_precompile_keys_equal_gpu_client_keys(name: str, dtype: torch.dtype, store: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """`kiln precompile --gpu h200` in another process makes the keys of a client on
    cuda:1 of an sm_90 GPU, for each shape set. (Attention is left out: a CPU-only torch
    cannot play the GPU client's own SDPA choice; the next test checks the modelled one,
    and tests/gpu/test_package_gpu.py compares keys with the real GPU's.)"""
    make = getattr(fleet_models, name)
    dims = (16,) if name == "mlp" else (8, 32)
    result = run_cli(["precompile", f"tests.fleet_models:{name}", "--gpu", "h200",
                      "--shapes", "x".join(map(str, (5, *dims))), "--shape-range",
                      "2..4x" + "x".join(map(str, dims)), "--dtype",
                      str(dtype).removeprefix("torch."), "--json"], {"KILN_STORE": store})
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    assert summary["graphs"] == 3 and summary["compiled"] == 3 and summary["not_keyed"] == 0
    # No farm and no GPU here: whatever has candidate configs waits in the store's queue.
    assert summary["kernels"] > 0 and summary["autotune_pending"] == summary["autotune_queued"]
    precompiled = [r["key"] for r in summary["records"]]
    clients = [key for n in (5, 2, 4)
               for key in client_keys(make, [(n, *dims)], dtype, monkeypatch, "cuda:1")]
    assert clients == precompiled


def traced_ops(make: Callable[[], torch.nn.Module], dtype: torch.dtype,
               versions: dict[str, Any] | None = None) -> set[str]:
    mode = FakeTensorMode()
    traced = trace_requests(fake_module(make(), mode), fake_inputs([(2, 8, 32)], dtype, mode),
                            KilnConfig.resolve(), H200, versions=versions)
    assert len(traced) == 1 and traced[0].request is not None
    gm = deserialize_graph(traced[0].request.graph)
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def test_attention_becomes_the_kernel_an_sm90_gpu_picks() -> None:
    """A CPU-only torch traces SDPA's math form; the precompile traces the fused op an
    sm_90 GPU runs with the target's torch: cuDNN attention for fp16 from torch 2.11
    (flash attention with 2.10), memory-efficient attention for fp32."""
    fp32 = traced_ops(fleet_models.block, torch.float32)
    assert "aten._scaled_dot_product_efficient_attention.default" in fp32
    half = traced_ops(fleet_models.block_half, torch.float16)
    assert "aten._scaled_dot_product_cudnn_attention.default" in half
    assert not any("softmax" in op or "amax" in op for op in half)
    older = traced_ops(fleet_models.sdpa_block_half, torch.float16,
                       {**versions(), "torch": "2.10.0+cu128"})
    assert "aten._scaled_dot_product_flash_attention.default" in older


def test_fp16_keys_equal_the_h200_clients(tmp_path: Path) -> None:
    """The request an H200 client (torch 2.11.0+cu130) made for the fp16 block, recorded
    there (tests/cpu/data; KILN_DEBUG of main at 313ffcc): a precompile here with that
    host's versions makes the same key. Its versions are replaced by the recorded ones
    before comparing, so a later change to compiler/ (its hash) alone does not fail
    this; a change to the graph Kiln traces (FX passes) needs a new recording."""
    from dataclasses import replace

    from kiln.compiler.request import CompileRequest
    from kiln.frontend.core.keys import explain_miss

    recorded = CompileRequest.from_bytes(
        (Path(__file__).parent / "data" / "h200_block_half_request.msgpack").read_bytes())
    theirs = {**versions(), "torch": recorded.versions["torch"],
              "triton": recorded.versions["triton"]}
    mode = FakeTensorMode()
    (traced,) = trace_requests(fake_module(fleet_models.block_half(), mode),
                               fake_inputs([(4, 16, 32)], torch.float16, mode),
                               KilnConfig.resolve(), H200, versions=theirs)
    assert traced.request is not None
    assert compute_key(recorded).key == H200_BLOCK_HALF_KEY  # the recording is intact
    # Recorded before inference graphs asked for ``padded_outputs`` (f6262d5): today's
    # client on that host adds it to the same request.
    recorded = replace(recorded, options={**recorded.options, "padded_outputs": True})
    mine = compute_key(replace(traced.request, versions=recorded.versions))
    expected = compute_key(recorded)
    assert explain_miss(expected.parts, mine.parts) == []
    assert mine.key == expected.key
    # And with this host's torch, the graph part is the same: only versions differ.
    (here,) = trace_requests(fake_module(fleet_models.block_half(), mode),
                             fake_inputs([(4, 16, 32)], torch.float16, mode),
                             KilnConfig.resolve(), H200)
    assert here.request is not None
    assert compute_key(here.request).parts["graph"] == expected.parts["graph"]


def test_precompiled_artifacts_hold_cubins_and_the_check_gate(store: str) -> None:
    env = {"KILN_STORE": store}
    base = ["precompile", "tests.fleet_models:mlp", "--gpu", "sm_90"]
    result = run_cli([*base, "--shapes", "5x16", "--json"], env)
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = json.loads(result.stdout)["records"]
    artifact = open_store(store).get(record["key"])
    assert artifact is not None
    manifest = artifact.manifest
    assert manifest["target"] == H200 and manifest["graph"]["autotuned"] is False
    cubins = [e["binary"]["blob"] for e in manifest["kernels"] if e.get("binary")]
    assert cubins and all(artifact.blobs[b][:4] == b"\x7fELF" for b in cubins)
    assert len(cubins) == len(manifest["kernels"])
    checked = run_cli([*base, "--shapes", "5x16", "--check", "--json"], env)
    assert checked.returncode == 0, checked.stderr[-3000:]
    assert json.loads(checked.stdout)["present"] == 1
    missing = run_cli([*base, "--shapes", "5x16", "9x16", "--check"], env)
    assert missing.returncode == 1
    assert "1 in the store, 1 missing" in missing.stdout


def test_versions_from_another_host(store: str, tmp_path: Path) -> None:
    """Keys carry the target host's torch and triton (`kiln versions --json` there);
    another Kiln compiler is refused."""
    printed = run_cli(["versions", "--json"], {})
    assert printed.returncode == 0
    recorded = json.loads(printed.stdout)
    assert recorded.pop("runtime") == {"cuda": torch.version.cuda, "cudnn": None,
                                       "cudnn_sdpa_deprioritized": False}
    assert recorded == versions()
    theirs = {**versions(), "torch": "2.11.0+cu128", "triton": "3.6.0"}
    path = tmp_path / "h200.json"
    path.write_text(json.dumps(theirs))
    base = ["precompile", "tests.fleet_models:mlp", "--gpu", "h200", "--shapes", "5x16"]
    result = run_cli([*base, "--versions-from", str(path), "--json"], {"KILN_STORE": store})
    assert result.returncode == 0, result.stderr[-3000:]
    (record,) = json.loads(result.stdout)["records"]
    mine = run_cli([*base, "--check", "--json"], {"KILN_STORE": store})
    assert json.loads(mine.stdout)["records"][0]["key"] != record["key"]
    manifest = open_store(store).get_manifest(record["key"])
    assert manifest is not None and manifest["versions"] == theirs
    assert manifest["compile"]["autotune"] == "pending"
    path.write_text(json.dumps({**theirs, "compiler": "0" * 64}))
    refused = run_cli([*base, "--versions-from", str(path)], {"KILN_STORE": store})
    assert refused.returncode == 2 and "compiler is" in refused.stderr


def test_training_graphs_need_a_cuda_build(store: str) -> None:
    if torch.backends.cuda.is_built():
        pytest.skip("this torch is built with CUDA")
    mode = FakeTensorMode()
    with pytest.raises(FakeDeviceError, match="CUDA build of torch"):
        trace_requests(fake_module(fleet_models.mlp(), mode),
                       fake_inputs([(5, 16)], torch.float32, mode), KilnConfig.resolve(),
                       H200, train=True)




def test_autotuning_is_queued_for_a_gpu_worker(store: str) -> None:
    """No GPU here and no farm: the precompile queues each tunable graph in the store;
    `kiln precompile --gpu-worker` on a GPU host compiles and times every candidate
    config, publishes the tuned artifact under the same key and empties the queue.
    (This host has no GPU to time cubins: the worker runs with the tests' deterministic
    timing, KILN_TEST_FAKE_AUTOTUNE; the candidates are really cross-compiled.)"""
    env = {"KILN_STORE": store}
    result = run_cli(["precompile", "tests.fleet_models:mlp", "--gpu", "sm_90",
                      "--shapes", "4096x16", "--json"], env)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads(result.stdout)
    (record,) = summary["records"]
    assert summary["autotune_queued"] == 1 and record["autotune"] == "queued"
    handle = open_store(store)
    assert handle.queued("autotune") == [record["key"]]
    before = handle.get_manifest(record["key"])
    assert before is not None and before["graph"]["autotuned"] is False
    no_gpu = run_cli(["precompile", "--gpu-worker"], env)
    assert no_gpu.returncode == 2 and "no" in no_gpu.stderr and "GPU" in no_gpu.stderr
    worked = run_cli(["precompile", "--gpu-worker", "--json"],
                     {**env, "KILN_TEST_FAKE_AUTOTUNE": "1"})
    assert worked.returncode == 0, worked.stderr[-3000:]
    report = json.loads(worked.stdout)
    assert report["tuned"] == 1 and report["left"] == 0, report
    assert report["records"][0]["kernels_timed"] >= 1
    after = handle.get_manifest(record["key"])
    assert after is not None and after["graph"]["autotuned"] is True
    assert after["compile"]["autotune"] == "done" and after["key"] == record["key"]
    timed = [k for k in after["kernels"] if k.get("autotune")]
    assert timed and all(len(k["autotune"]) > 1 for k in timed)  # candidates timed
    assert handle.queued("autotune") == []
    again = run_cli(["precompile", "--gpu-worker", "--json"],
                    {**env, "KILN_TEST_FAKE_AUTOTUNE": "1"})
    assert json.loads(again.stdout)["queued"] == 0
