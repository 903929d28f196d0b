"""Host work of a GPU graph's wrapper per call, checked on CPU: the wrapper generated for
fake CUDA tensors runs over CPU tensors with stand-in kernels. Library calls go through
torch's bindings (``torch.mm``) and give eager's results; the input alignment test is one
expression that copies only a misaligned input; buffers come from torch's C++ allocator
when the graph's device is the current one; a static launch reads the current stream
with no Python call between."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.runtime.kernel_files import interpreter_active
from kiln.compiler.runtime.wrapper_runtime import cuda_allocator

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


def _compile(fn: Callable[..., Any], *shapes: tuple[int, ...]) -> CompiledGraph:
    with FakeTensorMode():
        args = [torch.empty(s, device="cuda") for s in shapes]
    return compile_graph(trace_aten(fn, args), args, {}, compile_kernels=False)


class _Kernel:
    """A stand-in kernel: records what each launch got, runs ``body`` on it."""

    def __init__(self, body: Callable[..., Any]) -> None:
        self.body, self.launches = body, []  # type: ignore[var-annotated]

    def run(self, *args: Any) -> None:
        self.launches.append(args)
        self.body(*args)


def _call(compiled: CompiledGraph, kernels: dict[str, _Kernel]) -> Callable[[list[Any]], Any]:
    """The wrapper over CPU tensors (what ``compiled_graph.load`` binds, minus the GPU)."""
    namespace: dict[str, Any] = {"DEVICE": torch.device("cpu"), **kernels}
    exec(compile(compiled.wrapper_source, "<wrapper>", "exec"), namespace)
    return namespace["call"]  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", ["mm", "addmm", "bmm"])
def test_library_calls_through_bindings_match_eager(case: str) -> None:
    fns: dict[str, tuple[Callable[..., Any], tuple[tuple[int, ...], ...]]] = {
        "mm": (lambda a, b: a @ b, ((32, 16), (16, 24))),
        "addmm": (lambda a, w, b: torch.nn.functional.linear(a, w, b), ((32, 16), (24, 16),
                                                                          (24,))),
        "bmm": (lambda a, b: torch.bmm(a, b), ((4, 8, 16), (4, 16, 8))),
    }
    fn, shapes = fns[case]
    compiled = _compile(fn, *shapes)
    assert f"torch.{case}(" in compiled.wrapper_source and "torch.ops.aten" not in \
        compiled.wrapper_source, compiled.wrapper_source
    assert not compiled.kernels
    args = [torch.randn(s) for s in shapes]
    (out,) = _call(compiled, {})(list(args))
    torch.testing.assert_close(out, fn(*args), rtol=1e-5, atol=1e-5)


def test_one_alignment_test_copies_only_the_misaligned_input() -> None:
    compiled = _compile(lambda x, y: (x + y).relu(), (64,), (64,))
    (spec,) = compiled.kernels
    assert "if (arg0_1.data_ptr() | arg1_1.data_ptr()) % 16:" in compiled.wrapper_source
    kernel = _Kernel(lambda x, y, out: torch.add(x, y, out=out).relu_())
    call = _call(compiled, {spec.name: kernel})
    x, y = torch.randn(64), torch.randn(65)[1:]  # y starts 4 bytes into its storage
    assert y.data_ptr() % 16 and x.data_ptr() % 16 == 0
    (out,) = call([x, y])
    torch.testing.assert_close(out, (x + y).relu())
    got_x, got_y, _ = kernel.launches[0]
    assert got_x is x and got_y is not y and got_y.data_ptr() % 16 == 0
    torch.testing.assert_close(got_y, y)
    aligned = y.clone()
    (out,) = call([x, aligned])
    assert kernel.launches[1][0] is x and kernel.launches[1][1] is aligned  # no copy
    torch.testing.assert_close(out, (x + y).relu())


def test_cuda_allocator_is_the_fast_one_on_the_current_device_only() -> None:
    made: list[tuple[Any, ...]] = []
    device = [0]

    def fast(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
        made.append((size, stride, dtype))
        return torch.empty_strided(size, stride, dtype=dtype)

    cuda1 = torch.device("cuda", 1)
    # Another device is current: torch.empty_strided on the graph's own device.
    slow = cuda_allocator(cuda1, fast=fast, current=lambda: device[0])
    assert slow is not fast
    with FakeTensorMode():
        out = slow((2, 3), (1, 2), torch.float16)
    assert made == [] and out.stride() == (1, 2) and out.dtype == torch.float16
    assert out.device == cuda1
    device[0] = 1  # the graph's device is current: torch's C helper itself, no Python frame
    assert cuda_allocator(cuda1, fast=fast, current=lambda: device[0]) is fast
    # A CPU device (the harness here): torch.empty_strided there.
    out = cuda_allocator(torch.device("cpu"), fast=fast)((2, 3), (1, 2), torch.float16)
    assert made == [] and out.stride() == (1, 2) and out.device.type == "cpu"


def test_gpu_wrapper_asks_for_its_allocator_once_per_call() -> None:
    """Every buffer of a GPU graph (kernel outputs and extern ``out=`` buffers) comes from
    one allocator the call asks for once, called with positional arguments (torch's C++
    helper takes no keywords); the wrapper gives eager's result over CPU tensors."""
    fn = lambda x, w: ((x @ w).relu() @ w.t()).sigmoid()  # noqa: E731
    compiled = _compile(fn, (32, 16), (16, 24))
    source = compiled.wrapper_source
    assert source.count("cuda_allocator(DEVICE)") == 1, source
    assert "device=DEVICE" not in source and source.count("empty_strided_cuda((") == 2, source
    relu, sigmoid = compiled.kernels
    assert "relu" in relu.name and "sigmoid" in sigmoid.name
    kernels = {relu.name: _Kernel(lambda a, out: torch.clamp(a, min=0, out=out)),
               sigmoid.name: _Kernel(lambda a, out: torch.sigmoid(a, out=out))}
    x, w = torch.randn(32, 16), torch.randn(16, 24)
    asked: list[torch.device] = []
    call = _call(compiled, kernels)
    real = call.__globals__["cuda_allocator"]
    call.__globals__["cuda_allocator"] = lambda d: asked.append(d) or real(d)
    (out,) = call([x, w])
    assert asked == [torch.device("cpu")]
    torch.testing.assert_close(out, fn(x, w), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scratch", [False, True])
def test_static_launch_reads_the_current_stream_directly(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any, scratch: bool) -> None:
    """Also for kernels with scratch slots (every kernel of Triton 3.4 and later: the
    H200 host's encoder step launched 146 of them per step through an extra lambda)."""
    from kiln.compiler.kernel_compile import KernelBinary
    from kiln.compiler.runtime.static_launcher import StaticCudaKernel
    from tests.unit.test_static_launcher import RecordingLauncher

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    streams = iter([70, 71, 72])
    asked: list[int] = []

    def raw_stream(device: int) -> int:
        asked.append(device)
        return next(streams)

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", raw_stream, raising=False)
    compiled = _compile(lambda x: x.relu(), (64,))
    (spec,) = compiled.kernels
    binary = KernelBinary(name=spec.name, config={}, target={"arch": 90},
                          binary=b"\x7fELF-not-a-real-cubin",
                          metadata={"name": spec.name, "num_warps": 4, "shared": 0,
                                    **({"global_scratch_size": 0, "profile_scratch_size": 0}
                                       if scratch else {})})
    impl = RecordingLauncher()
    kernel = StaticCudaKernel(spec, binary, (1, 1, 1), impl=impl, device=3)
    kernel.run("in", "out")
    kernel.run("in", "out")
    assert kernel.run.__name__ == "run_on_current" + ("_with_scratch" if scratch else "")
    assert [launch[-1] for launch in impl.launches] == [70, 71] and asked == [3, 3]
    tail = (None, None) if scratch else ()
    assert all(launch[-2] == ("in", "out", *tail) for launch in impl.launches)
