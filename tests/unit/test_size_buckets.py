"""Size buckets of kernels with dynamic shapes, without running a kernel: the bucket of
a launch, the launcher's pick and its report of unseen buckets, and the artifact's
per-bucket configs and binaries, which round-trip and are hostile until checked."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.artifact_store import Artifact
from kiln.compiler.codegen.kernel_spec import KernelSpec
from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.kernel_compile import KernelBinary
from kiln.compiler.keys import KeyInfo
from kiln.compiler.runtime.buckets import (
    BucketedLauncher,
    bucket_index,
    bucket_name,
    check_bucket,
    index_of,
)
from kiln.workers.artifact import ArtifactFormatError, from_artifact, to_artifact

CONFIGS = ({"XBLOCK": 1024, "num_warps": 4, "num_stages": 1},
           {"XBLOCK": 128, "num_warps": 4, "num_stages": 1},
           {"XBLOCK": 4096, "num_warps": 8, "num_stages": 1})
SPEC = KernelSpec(name="triton_poi_fused_add_0", backend="triton", kind="pointwise",
                  source="@triton.jit\ndef KERNEL_NAME(in_ptr0, out_ptr0, xnumel, XBLOCK): pass",
                  arg_buffers=("arg0_1", "buf0"),
                  signature={"in_ptr0": "*fp32", "out_ptr0": "*fp32", "xnumel": "i32",
                             "XBLOCK": "constexpr"},
                  xnumel=4096, configs=CONFIGS, arg_bytes=(16384, 16384),
                  size_args=("64*s0",))


def test_bucket_of_a_launch_is_its_numels_rounded_up_to_powers_of_two() -> None:
    assert bucket_name(1) == "1x1" and bucket_name(2) == "2x1"
    assert bucket_name(832) == "1024x1" and bucket_name(1024, 33) == "1024x64"
    assert check_bucket("65536x1") == "65536x1"
    for x, r in ((1, 1), (2, 1), (3, 7), (832, 1), (1024, 1025), (65984, 33), (2**31, 2)):
        assert index_of(bucket_name(x, r)) == bucket_index(x, r)  # the launcher's key
    assert bucket_index(1024) != bucket_index(1025) and bucket_index(513) == bucket_index(1024)
    for bad in ("3x1", "4096", "0x1", "ax1", 4096, "4096x1 ", "1" * 13 + "x1"):
        with pytest.raises(ValueError, match="size bucket"):
            check_bucket(bad)


class _Launcher:
    def __init__(self, name: str, ran: list[str]) -> None:
        self.name, self.ran = name, ran

    def run(self, *args: Any) -> None:
        self.ran.append(self.name)


def test_launcher_picks_the_bucket_and_reports_each_unseen_bucket_once() -> None:
    ran: list[str] = []
    reported: list[tuple[str, str, list[int], list[int]]] = []
    launcher = BucketedLauncher(SPEC, _Launcher("heuristic", ran),
                                {"128x1": _Launcher("small", ran),
                                 "131072x1": _Launcher("large", ran)},
                                lambda *a: reported.append(a))
    x = torch.empty(2, 64)
    for xnumel in (128, 65984, 100, 832, 900, 4096):
        launcher.run(x, x, xnumel)
    assert ran == ["small", "large", "small", "heuristic", "heuristic", "heuristic"]
    assert reported == [(SPEC.name, "1024x1", [512, 512], [832]),
                        (SPEC.name, "4096x1", [512, 512], [4096])]


def _graph() -> CompiledGraph:
    binary = KernelBinary(SPEC.name, {"kind": "cuda", "arch": 90}, dict(CONFIGS[2]),
                          b"cubin-large", {"binary_ext": "cubin", "num_warps": 8})
    return CompiledGraph("g", "cuda", "def call(args): pass\n", [SPEC],
                         configs={SPEC.name: dict(CONFIGS[0])},
                         buckets={SPEC.name: {"128x1": dict(CONFIGS[1]),
                                              "131072x1": dict(CONFIGS[2])}},
                         bucket_binaries={SPEC.name: {"131072x1": binary}})


def _artifact() -> Artifact:
    from kiln.compiler.request import CompileRequest

    request = CompileRequest(graph=b"", inputs=(), options={}, target={"kind": "cuda"},
                             versions={})
    return to_artifact(KeyInfo("k" * 64, {}), request, _graph())


def test_per_bucket_configs_and_binaries_round_trip_through_the_artifact() -> None:
    artifact = _artifact()
    assert artifact.manifest["graph"]["buckets"][SPEC.name]["128x1"]["XBLOCK"] == 128
    (entry,) = artifact.manifest["kernels"]
    blob = entry["bucket_binaries"]["131072x1"]["blob"]
    assert artifact.blobs[blob] == b"cubin-large"
    loaded = from_artifact(artifact)
    assert loaded.buckets == _graph().buckets
    assert loaded.bucket_binaries[SPEC.name]["131072x1"].binary == b"cubin-large"


@pytest.mark.parametrize("tamper, words", [
    (lambda m: m["graph"]["buckets"][SPEC.name].update({"100x1": dict(CONFIGS[0])}),
     "invalid size bucket"),
    (lambda m: m["graph"]["buckets"][SPEC.name]["128x1"].update(XBLOCK="128"),
     "invalid launch config entry 'XBLOCK'"),
    (lambda m: m["graph"]["buckets"][SPEC.name]["128x1"].update(evil=1),
     "invalid launch config entry 'evil'"),
    (lambda m: m["graph"]["buckets"][SPEC.name]["128x1"].update(XBLOCK=True),
     "invalid launch config entry"),
    (lambda m: m["graph"]["buckets"].update({"other_kernel": {}}),
     "unknown kernels"),
    (lambda m: m["graph"]["buckets"].update({"__import__": {}}), "invalid kernel name"),
    (lambda m: m["graph"].update(buckets=[1]), "not a map"),
    (lambda m: m["graph"]["buckets"][SPEC.name].update(
        {f"{2**i}x1": dict(CONFIGS[0]) for i in range(70)}), "at most"),
    (lambda m: m["kernels"][0]["bucket_binaries"]["131072x1"].update(
        config=dict(CONFIGS[0])), "binary for another config"),
])
def test_hostile_bucket_entries_are_refused(tamper: Any, words: str) -> None:
    artifact = _artifact()
    tamper(artifact.manifest)
    with pytest.raises(ArtifactFormatError, match=words):
        from_artifact(artifact)


def test_bucket_candidates_cross_compile_for_sm90_and_round_trip(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a GPU process does when a bucket is first seen, up to the timing (the tests'
    fake chooser here): every candidate of a dynamic kernel compiled for sm_90, the
    bucket's binary compiled for the bucket's config, stored and read back."""
    from kiln.compiler.runtime.kernel_files import interpreter_active
    from kiln.frontend.config import KilnConfig
    from kiln.frontend.core.client import KilnClient
    from kiln.frontend.transports.inprocess import InProcessFarm
    from kiln.workers.autotune import FAKE_AUTOTUNE_ENV
    from kiln.workers.buckets import tune_buckets

    if interpreter_active():
        pytest.skip("Triton was imported for its interpreter")
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kcache"))
    monkeypatch.setenv(FAKE_AUTOTUNE_ENV, "1")
    config = KilnConfig.resolve({"store": str(tmp_path / "store"), "farm": "inprocess",
                                 "cpu_backend": "triton-interpret"})
    client = KilnClient(config, farm=InProcessFarm())
    request = _dynamic_request(config)
    result = client.compile(request)  # type: ignore[arg-type]
    (spec,) = [s for s in result.compiled.kernels if s.size_args]
    seen = {(spec.name, "128x1"): ([512, 512], [128]),
            (spec.name, "131072x1"): ([2**18] * 2, [65984])}
    sm90 = {"kind": "cuda", "backend": "cuda", "arch": 90, "warp_size": 32}
    tuned = tune_buckets(result.compiled, sm90, seen, client.local.kernels)
    assert {k: c["XBLOCK"] for k, c in tuned.buckets[spec.name].items()} == \
        {"128x1": 128, "131072x1": 4096}
    for bucket, binary in tuned.bucket_binaries[spec.name].items():
        assert binary.config == tuned.buckets[spec.name][bucket] and binary.binary
        assert binary.metadata.get("binary_ext") == "cubin"
    record = tuned.stats["bucket_autotune"][spec.name]["128x1"]
    assert [r["config"] for r in record] == [dict(c) for c in spec.configs]
    assert not result.compiled.buckets  # a copy: the loaded graph is untouched
    back = from_artifact(to_artifact(result.key, request, tuned))  # type: ignore[arg-type]
    assert back.buckets == tuned.buckets and back.bucket_binaries == tuned.bucket_binaries


def _dynamic_request(config: Any) -> object:
    """The request of x * y + 1 over (n, 64) with n dynamic, hinted at 64 (Triton
    kernels: the interpreter backend, compiled here without being run)."""
    from torch._dynamo.backends.common import aot_autograd

    from kiln.frontend.core.compile import build_request

    out: list[object] = []

    def capture(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        out.append(build_request(gm, inputs, config))
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(64, 64)
    torch._dynamo.mark_dynamic(x, 0)
    torch.compile(lambda a: (a * a + 1).relu(), backend=aot_autograd(fw_compiler=capture))(x)
    torch._dynamo.reset()
    return out[0]
