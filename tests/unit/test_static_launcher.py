"""The warm path's launcher: a stored cubin launched through torch's static CUDA launcher
(no Triton JIT, no C compiler). No GPU here: kernels are cross-compiled for sm_90 and the
launcher's C entry points are replaced by a recorder, which checks what Kiln passes them
(cubin file, kernel name, shared memory, argument codes, grid, warps, scratch slots).
tests/gpu/test_static_launcher.py launches for real."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.kernel_compile import KernelBinary
from kiln.compiler.runtime.kernel_files import interpreter_active
from kiln.compiler.runtime.static_launcher import (
    StaticCudaKernel,
    StaticLaunchUnsupported,
    arg_types,
    launcher_impl,
)
from kiln.compiler.runtime.triton_launcher import launch_grid
from tests.unit.test_cubin import SM90, fake_cuda

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


class RecordingLauncher:
    """Stands in for torch._C._StaticCudaLauncher (same entry points and arguments)."""

    def __init__(self, returns: int = 4) -> None:
        self.loads: list[tuple[Any, ...]] = []
        self.launches: list[tuple[Any, ...]] = []
        self.returns = returns

    def _load_kernel(self, path: str, name: str, shared: int, device: int) -> tuple[Any, ...]:
        self.loads.append((Path(path).read_bytes(), name, shared, device))
        return ("module", "function", 32, 0)[4 - self.returns:]

    def _launch_kernel(self, *args: Any) -> None:
        self.launches.append(args)


@pytest.fixture
def softmax_graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kcache"))
    x = torch.randn(64, 300)
    args = fake_cuda([x])
    gm = trace_aten(lambda a: (torch.softmax(a * 2, -1), a.sum(0) * 3), args)
    return compile_graph(gm, args, {}, name="g", target=SM90)


@pytest.mark.parametrize("returns", [4, 3])  # torch 2.13 returns the module too; 2.11 not
def test_cubins_load_once_on_first_launch_with_the_kernels_own_metadata(
        softmax_graph: Any, returns: int) -> None:
    assert len(softmax_graph.kernels) >= 2
    for spec in softmax_graph.kernels:
        binary: KernelBinary = softmax_graph.binaries[spec.name]
        impl = RecordingLauncher(returns)
        grid = launch_grid(spec, binary.config)
        streams = iter([7, 8])
        kernel = StaticCudaKernel(spec, binary, grid, impl=impl,
                                  stream=streams.__next__, device=0)
        assert impl.loads == []  # nothing loads before the first launch
        tensors = [object() for t in spec.signature.values() if t.startswith("*")]
        kernel.run(*tensors)
        assert "run" in vars(kernel)  # later launches: everything but args and stream bound
        kernel.run(*tensors)
        assert len(impl.loads) == 1
        # the bound launch passes what the first did; the stream is read on every launch
        assert impl.launches[1][:-1] == impl.launches[0][:-1] and impl.launches[1][-1] == 8
        cubin, name, shared, device = impl.loads[0]
        assert cubin == binary.binary and cubin[:4] == b"\x7fELF"
        assert name == spec.name == binary.metadata["name"]
        assert shared == binary.metadata["shared"] and device == 0
        function, gx, gy, gz, warps, shared2, tys, args, stream = impl.launches[0]
        assert function == "function" and (gx, gy, gz) == grid and stream == 7
        assert grid[0] == -(-spec.xnumel // binary.config["XBLOCK"])
        assert warps == binary.metadata["num_warps"] == binary.config["num_warps"]
        pointers = sum(t.startswith("*") for t in spec.signature.values())
        scratch = sum(f in binary.metadata for f in ("global_scratch_size",
                                                     "profile_scratch_size"))
        assert tys == "O" * pointers + "O" * scratch and len(args) == len(tys)
        assert list(args[:pointers]) == tensors and args[pointers:] == (None,) * scratch


def test_argument_codes_skip_constexprs_and_map_scalars(softmax_graph: Any) -> None:
    spec = softmax_graph.kernels[0]
    meta = {"global_scratch_size": 0}
    sig = {"in_ptr0": "*bf16", "xnumel": "i32", "big": "i64", "eps": "fp32",
           "XBLOCK": "constexpr"}
    assert arg_types(type(spec)(**{**spec.__dict__, "signature": sig}), meta) == "OilfO"
    with pytest.raises(StaticLaunchUnsupported, match="global_scratch_size"):
        arg_types(spec, {"global_scratch_size": 128})


def test_unlaunchable_kernels_and_torches_are_refused_by_name(softmax_graph: Any,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    spec = softmax_graph.kernels[0]
    binary = softmax_graph.binaries[spec.name]
    for field, value in (("num_ctas", 2), ("launch_cooperative_grid", True)):
        bad = KernelBinary(binary.name, binary.target, binary.config, binary.binary,
                           {**binary.metadata, field: value})
        with pytest.raises(StaticLaunchUnsupported, match=field):
            StaticCudaKernel(spec, bad, (1, 1, 1), impl=RecordingLauncher())
    monkeypatch.setenv("KILN_STATIC_LAUNCHER", "0")
    with pytest.raises(StaticLaunchUnsupported, match="KILN_STATIC_LAUNCHER"):
        launcher_impl()
    monkeypatch.delenv("KILN_STATIC_LAUNCHER")
    if not hasattr(torch._C, "_StaticCudaLauncher"):  # this CPU build of torch
        with pytest.raises(StaticLaunchUnsupported, match="no _StaticCudaLauncher"):
            launcher_impl()


def test_a_cubin_that_will_not_load_falls_back_to_another_launcher(softmax_graph: Any
                                                                  ) -> None:
    spec = softmax_graph.kernels[0]

    class Broken(RecordingLauncher):
        def _load_kernel(self, *args: Any) -> tuple[Any, ...]:
            raise RuntimeError("CUDA_ERROR_INVALID_IMAGE")

    ran: list[tuple[Any, ...]] = []

    class Other:
        def run(self, *args: Any) -> None:
            ran.append(args)

    kernel = StaticCudaKernel(spec, softmax_graph.binaries[spec.name], (1, 1, 1),
                              impl=Broken(), stream=lambda: 0, fallback=Other, device=0)
    kernel.run(1, 2)
    kernel.run(3, 4)
    assert ran == [(1, 2), (3, 4)]


def test_an_argument_torchs_launcher_cannot_read_goes_to_another_launcher(
        softmax_graph: Any, caplog: pytest.LogCaptureFixture) -> None:
    """torch's launcher calls each pointer argument's ``data_ptr()`` and does not check
    that it returned: one that raises crashes the process; a CPU tensor fails in the
    driver naming no argument. Kiln checks the first launch's arguments and sends such
    a kernel to Triton's launcher, with one warning that names the argument."""
    spec = softmax_graph.kernels[0]
    pointers = sum(t.startswith("*") for t in spec.signature.values())

    class NoStorage:
        def data_ptr(self) -> int:
            raise RuntimeError("Cannot access data pointer of Tensor")

    cases = [(torch.randn(4), "argument 0 is on cpu, not cuda:0"),
             (NoStorage(), "argument 0 has no data pointer (RuntimeError")]
    ran: list[tuple[Any, ...]] = []

    class Other:
        def run(self, *args: Any) -> None:
            ran.append(args)

    for bad, why in cases:
        ran.clear()
        impl = RecordingLauncher()
        kernel = StaticCudaKernel(spec, softmax_graph.binaries[spec.name], (1, 1, 1),
                                  impl=impl, stream=lambda: 0, fallback=Other, device=0)
        args = (bad, *[object() for _ in range(pointers - 1)])
        caplog.clear()
        kernel.run(*args)
        kernel.run(*args)
        assert impl.launches == [] and ran == [args, args]
        (record,) = [r for r in caplog.records if r.levelname == "WARNING"]
        assert why in record.getMessage() and spec.name in record.getMessage()
    kernel = StaticCudaKernel(spec, softmax_graph.binaries[spec.name], (1, 1, 1),
                              impl=RecordingLauncher(), stream=lambda: 0, device=0)
    with pytest.raises(StaticLaunchUnsupported, match="arguments for"):
        kernel.run(*[object() for _ in range(pointers + 1)])  # and no launcher to go to


def test_cubin_files_are_named_by_their_digest(softmax_graph: Any, tmp_path: Path) -> None:
    from kiln.compiler.runtime.static_launcher import cubin_path

    binary = next(iter(softmax_graph.binaries.values())).binary
    path = cubin_path(binary)
    assert path.name == hashlib.sha256(binary).hexdigest() + ".cubin"
    path.write_bytes(b"tampered")  # a damaged cache file is rewritten, never loaded
    assert cubin_path(binary).read_bytes() == binary
