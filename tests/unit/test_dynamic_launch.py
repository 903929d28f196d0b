"""Host path of kernels with dynamic sizes, checked on CPU: they launch through torch's
static CUDA launcher (no Triton launcher in Python on every launch), each launch's grid
from its ``xnumel``, and a ``BucketedLauncher`` chooses the bucket and the ``ALIGN`` or
generic variant once per set of sizes, then launches the static kernel's bound closure.

The kernels are the decoder's attention softmax generated from fake CUDA tensors with a
symbolic sequence length and cross-compiled for sm_90; torch's launcher is replaced by a
recorder (tests/unit/test_static_launcher.py), which checks what Kiln passes it. The
numerics of both variants: tests/triton_interp/test_dynamic_alignment.py; a real launch:
tests/gpu/test_gpu_dynamic.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.compiler import compiled_graph
from kiln.compiler.codegen.kernel_spec import KernelSpec
from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.kernel_compile import ALIGN_KEY, KernelBinary, compile_kernel
from kiln.compiler.runtime.buckets import BucketedLauncher, generic_config
from kiln.compiler.runtime.kernel_files import interpreter_active
from kiln.compiler.runtime.static_launcher import StaticCudaKernel
from tests.targets import SM90
from tests.unit.test_dynamic_alignment import _compile
from tests.unit.test_static_launcher import RecordingLauncher

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


@pytest.fixture(scope="module")
def softmax() -> tuple[CompiledGraph, KernelSpec, KernelBinary]:
    """The dynamic graph, its persistent kernel for rows of at most 512, and that
    kernel's ALIGN binary for sm_90."""
    graph = _compile(True)
    (spec,) = [k for k in graph.kernels if k.kind == "persistent_reduction"
               and k.configs[0]["RBLOCK"] == 512]
    return graph, spec, compile_kernel(spec, dict(spec.configs[0]), SM90)


@pytest.fixture
def streams(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[int]:
    """The current stream of each device, as torch's launcher would read it."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    asked: list[int] = []

    def raw_stream(device: int) -> int:
        asked.append(device)
        return 100 + device

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", raw_stream, raising=False)
    return asked


def _sizes(n: int) -> tuple[int, int, int]:
    """The softmax kernel's size arguments at sequence length ``n`` (8 rows of n per
    position: batch 2 x 4 heads)."""
    return 8 * n, n, n


def test_static_launch_grid_follows_each_launch_xnumel(
        softmax: tuple[CompiledGraph, KernelSpec, KernelBinary], streams: list[int]) -> None:
    _, spec, binary = softmax
    impl = RecordingLauncher()
    kernel = StaticCudaKernel(spec, binary, (1, 1, 1), impl=impl, device=2)
    xblock = binary.config["XBLOCK"]
    tensors = ("in", "out")
    for n in (512, 300, 512, 1):
        kernel.run(*tensors, *_sizes(n))
    assert kernel.run.__name__ == "run_dynamic"  # bound once loaded
    assert len(impl.loads) == 1
    grids = [launch[1:4] for launch in impl.launches]
    assert grids == [(-(-8 * n // xblock), 1, 1) for n in (512, 300, 512, 1)], grids
    for launch, n in zip(impl.launches, (512, 300, 512, 1)):
        function, *_, warps, shared, tys, args, stream = launch
        assert function == "function" and stream == 102
        assert warps == binary.metadata["num_warps"] and shared == binary.metadata["shared"]
        scratch = sum(f in binary.metadata for f in ("global_scratch_size",
                                                     "profile_scratch_size"))
        assert tys == "OO" + "lll" + "O" * scratch  # the sizes are i64 arguments
        assert args == (*tensors, *_sizes(n), *(None,) * scratch)
    assert streams == [2, 2, 2, 2]


def test_zero_elements_still_launch_one_program(
        softmax: tuple[CompiledGraph, KernelSpec, KernelBinary], streams: list[int]) -> None:
    _, spec, binary = softmax
    impl = RecordingLauncher()
    kernel = StaticCudaKernel(spec, binary, (1, 1, 1), impl=impl, device=0)
    kernel.run("in", "out", 0, 0, 0)
    kernel.run("in", "out", 0, 0, 0)
    assert [launch[1:4] for launch in impl.launches] == [(1, 1, 1), (1, 1, 1)]


def test_dynamic_kernels_of_a_loaded_graph_use_the_static_launcher(
        softmax: tuple[CompiledGraph, KernelSpec, KernelBinary], streams: list[int],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A loaded graph's dynamic kernel: its ALIGN cubin at sizes that are multiples of 16,
    its generic variant (compiled on first need for the cubin's target) elsewhere, both
    through torch's static launcher; the choice is made once per set of sizes and the
    launch runs the static kernel's bound closure."""
    graph, spec, binary = softmax
    impl = RecordingLauncher()
    monkeypatch.setattr(torch._C, "_StaticCudaLauncher", impl, raising=False)
    monkeypatch.setattr(compiled_graph, "_arch_matches", lambda binary, device: True)
    monkeypatch.setenv("KILN_CUBIN_LOADER", "torch")  # the recorder loads (on a GPU host too)
    compiled = CompiledGraph(graph.name, "cuda", graph.wrapper_source, [spec],
                             binaries={spec.name: binary})
    launcher = compiled_graph._launcher(compiled, spec, torch.device("cuda", 1))
    assert isinstance(launcher, BucketedLauncher)
    assert isinstance(launcher.default, StaticCudaKernel)
    for n in (512, 500, 512, 500, 496):
        launcher.run("in", "out", *_sizes(n))
    # Two cubins loaded: the ALIGN one and the generic one, each once.
    assert len(impl.loads) == 2 and impl.loads[0][0] == binary.binary
    assert impl.loads[1][0] != binary.binary and impl.loads[1][1] == spec.name
    plain = generic_config(binary.config)
    assert plain is not None and ALIGN_KEY not in plain
    assert [args[2:5] for *_, args, _ in impl.launches] == [_sizes(n) for n in
                                                            (512, 500, 512, 500, 496)]
    # Each set of sizes is chosen once; what runs then is a bound static launch.
    assert set(launcher.chosen) == {_sizes(n) for n in (512, 500, 496)}
    assert {run.__name__ for run in launcher.chosen.values()} == {"run_dynamic"}
    assert launcher.chosen[_sizes(512)] is launcher.chosen[_sizes(496)]  # both aligned
    assert launcher.chosen[_sizes(500)] is not launcher.chosen[_sizes(512)]


def test_a_remembered_choice_skips_the_bucket_and_alignment_work() -> None:
    """Launches at sizes seen before run the remembered launcher and nothing else: the
    report of a new bucket and the generic factory are called once."""
    spec = KernelSpec(name="triton_red_fused_sum_0", backend="triton", kind="reduction",
                      source="", arg_buffers=("arg1_1", "buf0"),
                      signature={"in_ptr0": "*fp16", "out_ptr0": "*fp16", "xnumel": "i64",
                                 "rnumel": "i64", "s0": "i64", "XBLOCK": "constexpr",
                                 "RBLOCK": "constexpr"},
                      xnumel=8192, rnumel=8192, size_args=("3*s0", "s0", "s0"),
                      configs=({"XBLOCK": 1, "RBLOCK": 1024, "num_warps": 4,
                                "num_stages": 1, ALIGN_KEY: 16},))
    ran: list[tuple[str, tuple[Any, ...]]] = []
    reports: list[str] = []
    built: list[str | None] = []

    class Launcher:
        def __init__(self, name: str) -> None:
            self.name = name

        def run(self, *args: Any) -> None:
            ran.append((self.name, args))

    def generic(bucket: str | None) -> Any:
        built.append(bucket)
        return Launcher("generic")

    launcher = BucketedLauncher(spec, Launcher("aligned"), {}, lambda k, b, *_: reports.append(b),
                                generic)
    x = torch.empty(3)
    for n in (1024, 1021, 1024, 1021, 1024):
        launcher.run(x, x, 3 * n, n, n)
    assert [name for name, _ in ran] == ["aligned", "generic"] * 2 + ["aligned"]
    assert [args[2:] for _, args in ran] == [(3 * n, n, n) for n in (1024, 1021, 1024, 1021,
                                                                     1024)]
    assert reports == ["4096x1024"] and built == [None]
