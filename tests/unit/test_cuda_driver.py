"""Cubins loaded from memory through the CUDA driver on helper threads
(``compiler/runtime/cuda_driver.py``), checked on CPU: libcuda is replaced by a recorder
taking the same ctypes arguments, and torch's static launcher by the launch recorder of
tests/unit/test_static_launcher.py. The kernels are real sm_90 cubins cross-compiled
here. A real load and launch, compared with eager: tests/gpu/test_cubin_loader_gpu.py."""

from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.compiler import compiled_graph
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.runtime import cuda_driver, static_launcher
from kiln.compiler.runtime.cuda_driver import (
    CubinLoader,
    CudaDriver,
    CudaDriverError,
    LoadDeferred,
)
from kiln.compiler.runtime.kernel_files import interpreter_active
from kiln.compiler.runtime.static_launcher import StaticCudaKernel
from kiln.compiler.runtime.triton_launcher import launch_grid
from tests.unit.test_cubin import SM90, fake_cuda
from tests.unit.test_static_launcher import RecordingLauncher

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")

OPTIN = 232448  # an H100/H200's opt-in shared memory per block


@pytest.fixture
def softmax_graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Two kernels (a softmax, a column sum) cross-compiled for sm_90."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kcache"))
    args = fake_cuda([torch.randn(64, 300)])
    gm = trace_aten(lambda a: (torch.softmax(a * 2, -1), a.sum(0) * 3), args)
    return compile_graph(gm, args, {}, name="g", target=SM90)


class RecordingLibcuda:
    """libcuda's entry points as ctypes calls them: outputs through ``byref``; each call
    recorded with its thread. ``fail`` maps an entry point to the CUresult it returns."""

    def __init__(self, fail: dict[str, int] | None = None, static_shared: int = 1024
                 ) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], str]] = []
        self.fail = fail or {}
        self.static_shared = static_shared
        self.handles = iter(range(1000, 100000))
        self.current: int | None = None  # cuCtxGetCurrent's answer (None: a new handle)
        self.lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("cu"):
            raise AttributeError(name)

        def call(*args: Any) -> int:
            with self.lock:
                self.calls.append((name, args, threading.current_thread().name))
                if name in self.fail:
                    return self.fail[name]
                out: Any = getattr(args[0], "_obj", None) if args else None
                if name == "cuGetErrorName":
                    args[1]._obj.value = b"CUDA_ERROR_INVALID_IMAGE"
                elif name == "cuDeviceGetAttribute":
                    out.value = OPTIN
                elif name == "cuFuncGetAttribute":
                    out.value = self.static_shared
                elif name == "cuDeviceGet":
                    out.value = args[1]
                elif name == "cuCtxGetCurrent" and self.current is not None:
                    out.value = self.current
                elif out is not None and hasattr(out, "value"):
                    out.value = next(self.handles)
            return 0
        return call

    def named(self, name: str) -> list[tuple[Any, ...]]:
        return [args for call, args, _ in self.calls if call == name]


def _kernel(graph: Any, lib: RecordingLibcuda, impl: RecordingLauncher, **meta: Any
            ) -> StaticCudaKernel:
    spec = graph.kernels[0]
    binary = graph.binaries[spec.name]
    if meta:
        binary = type(binary)(binary.name, binary.target, binary.config, binary.binary,
                              {**binary.metadata, **meta})
    return StaticCudaKernel(spec, binary, launch_grid(spec, binary.config), impl=impl,
                            stream=lambda: 5, device=0,
                            loader=CubinLoader(CudaDriver(lib), threads=2))


def test_a_prefetched_cubin_loads_from_memory_on_a_helper_thread(
        softmax_graph: Any, tmp_path: Path) -> None:
    lib, impl = RecordingLibcuda(), RecordingLauncher()
    kernel = _kernel(softmax_graph, lib, impl)
    binary = softmax_graph.binaries[softmax_graph.kernels[0].name]
    kernel.prefetch()
    kernel.prefetch()  # once only
    tensors = [object() for t in kernel_spec_pointers(softmax_graph)]
    kernel.run(*tensors)
    kernel.run(*tensors)
    (image,) = [args[1] for args in lib.named("cuModuleLoadData")]
    assert image == binary.binary and image[:4] == b"\x7fELF"  # the verified bytes
    (get,) = lib.named("cuModuleGetFunction")
    assert get[2] == binary.metadata["name"].encode()
    threads = {thread for call, _, thread in lib.calls if call.startswith("cuModule")}
    assert threads and all(t.startswith("kiln-cubin") for t in threads)
    # the helper thread made the device's primary context current before loading
    order = [call for call, _, _ in lib.calls]
    assert order.index("cuCtxSetCurrent") < order.index("cuModuleLoadData")
    assert lib.named("cuDevicePrimaryCtxRetain") and lib.named("cuDeviceGet")[0][1] == 0
    # torch's launcher launches the driver's function handle; its own loader never ran
    assert impl.loads == [] and len(impl.launches) == 2
    function = get[0]._obj.value
    assert isinstance(function, int) and impl.launches[0][0] == function == kernel.function
    assert not (tmp_path / "kcache" / "cubins").exists()  # nothing written to disk
    assert lib.named("cuFuncSetAttribute") == []  # under 48 KiB: no opt-in


def kernel_spec_pointers(graph: Any) -> list[str]:
    return [t for t in graph.kernels[0].signature.values() if t.startswith("*")]


def test_more_than_48k_of_shared_memory_opts_in_as_tritons_loader(softmax_graph: Any
                                                                 ) -> None:
    lib, impl = RecordingLibcuda(static_shared=2048), RecordingLauncher()
    kernel = _kernel(softmax_graph, lib, impl, shared=100_000)
    kernel.load()
    (attribute,) = lib.named("cuFuncSetAttribute")
    assert attribute[1:] == (8, OPTIN - 2048)  # MAX_DYNAMIC_SHARED_SIZE_BYTES
    assert lib.named("cuFuncSetCacheConfig")[0][1] == 1  # PREFER_SHARED
    assert lib.named("cuDeviceGetAttribute")[0][1] == 97  # ..._PER_BLOCK_OPTIN


def test_a_cubin_the_driver_refuses_names_the_kernel_and_loads_through_torch(
        softmax_graph: Any, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(static_launcher, "_driver_failed", False)
    lib, impl = RecordingLibcuda(fail={"cuModuleLoadData": 200}), RecordingLauncher()
    kernel = _kernel(softmax_graph, lib, impl)
    name = kernel.name
    with pytest.raises(CudaDriverError, match=f"cuModuleLoadData for kernel {name} failed: "
                                              "CUDA_ERROR_INVALID_IMAGE"):
        kernel.loader.driver.load(kernel.binary, name, 0, 0)  # type: ignore[union-attr]
    with caplog.at_level(logging.WARNING, "kiln.runtime"):
        kernel.run(*[object() for _ in kernel_spec_pointers(softmax_graph)])
    assert f"kernel {name}: the CUDA driver did not load its cubin" in caplog.text
    assert "CUDA_ERROR_INVALID_IMAGE" in caplog.text
    # torch's loader took over, from a file of the same verified bytes
    assert len(impl.loads) == 1 and impl.loads[0][0] == kernel.binary
    assert impl.launches[0][0] == "function"


def test_shared_memory_beyond_the_device_is_refused_by_name(softmax_graph: Any) -> None:
    lib = RecordingLibcuda()
    kernel = _kernel(softmax_graph, lib, RecordingLauncher(), shared=OPTIN + 1)
    with pytest.raises(CudaDriverError, match=f"kernel {kernel.name} needs {OPTIN + 1} bytes"):
        kernel.loader.driver.load(kernel.binary, kernel.name, OPTIN + 1, 0)  # type: ignore[union-attr]


def test_the_process_loader_is_off_by_setting_or_without_libcuda(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cuda_driver.reset_loader()
    monkeypatch.setenv("KILN_CUBIN_LOADER", "torch")
    assert cuda_driver.cubin_loader(lambda: CudaDriver(RecordingLibcuda())) is None
    monkeypatch.delenv("KILN_CUBIN_LOADER")

    def no_libcuda() -> CudaDriver:
        raise OSError("libcuda.so.1: cannot open shared object file")

    assert cuda_driver.cubin_loader(no_libcuda) is None
    assert "libcuda.so.1" in cuda_driver._loader_reason
    cuda_driver.reset_loader()
    monkeypatch.setenv("KILN_CUBIN_LOAD_THREADS", "3")
    loader = cuda_driver.cubin_loader(lambda: CudaDriver(RecordingLibcuda()))
    assert loader is not None and loader.threads == 3
    cuda_driver.reset_loader()


def test_only_torchs_own_launcher_gets_the_process_loader(
        softmax_graph: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    loader = CubinLoader(CudaDriver(RecordingLibcuda()))
    monkeypatch.setattr(static_launcher, "cubin_loader", lambda: loader)
    spec = softmax_graph.kernels[0]
    binary = softmax_graph.binaries[spec.name]
    stand_in = StaticCudaKernel(spec, binary, (1, 1, 1), impl=RecordingLauncher(), device=0)
    assert stand_in.loader is None
    monkeypatch.setattr(static_launcher, "launcher_impl", RecordingLauncher)
    assert StaticCudaKernel(spec, binary, (1, 1, 1), device=0).loader is loader


def test_loading_a_graph_starts_every_cubin_load_before_its_first_call(
        softmax_graph: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``compiled_graph.load`` hands the graph's static kernels to the loader, in their
    order; the first call then only waits. A second graph with the same kernels shares
    their modules: each cubin is loaded once per device."""
    lib, impl = RecordingLibcuda(), RecordingLauncher()
    loader = CubinLoader(CudaDriver(lib), threads=1)
    monkeypatch.setattr(torch._C, "_StaticCudaLauncher", impl, raising=False)
    monkeypatch.setattr(compiled_graph, "_arch_matches", lambda binary, device: True)
    monkeypatch.setattr(static_launcher, "cubin_loader", lambda: loader)
    device = torch.device("cuda", 0)
    first = compiled_graph.load(softmax_graph, {}, device)
    second = compiled_graph.load(softmax_graph, {}, device)  # another graph, same kernels
    for future in list(loader._futures.values()):
        future.result(10)  # the helpers finish without any call
    images = [args[1] for args in lib.named("cuModuleLoadData")]
    kernels = softmax_graph.kernels
    assert len(kernels) >= 2
    assert images == [softmax_graph.binaries[k.name].binary for k in kernels]
    for spec in kernels:  # both graphs launch the same function handle
        one, two = first.__globals__[spec.name], second.__globals__[spec.name]
        assert one is not two and one._pending is two._pending is not None
    assert impl.loads == []


def test_helpers_share_one_queue_and_each_sets_its_context_once() -> None:
    lib = RecordingLibcuda()
    loader = CubinLoader(CudaDriver(lib), threads=3)
    jobs = [(bytes([i]) * 8, f"k{i}", 0, 0) for i in range(40)]
    futures = loader.submit_all(jobs)
    assert all(f.result(10).function for f in futures)  # every one loaded
    assert loader.submit_all(jobs[:5]) == futures[:5]  # asked again: the same loads
    names = [args[2] for args in lib.named("cuModuleGetFunction")]
    assert sorted(names) == sorted(f"k{i}".encode() for i in range(40))
    # each helper made the context current once, not once per load
    helpers = {thread for call, _, thread in lib.calls if call == "cuModuleLoadData"}
    assert len(lib.named("cuCtxSetCurrent")) == len(helpers) <= 3
    assert not loader._queue and len(loader._helpers) == 3
    assert len(lib.named("cuModuleLoadData")) == 40


def test_a_capture_in_progress_keeps_helpers_off_the_gpu(
        softmax_graph: Any, caplog: pytest.LogCaptureFixture) -> None:
    """While another thread captures a CUDA graph (it holds the GPU work lock), a helper
    loads nothing (a module load would invalidate the capture); the kernel loads its
    cubin on its own thread at its first launch, with no warning."""
    lib, impl = RecordingLibcuda(), RecordingLauncher()
    lock = threading.RLock()
    spec = softmax_graph.kernels[0]
    binary = softmax_graph.binaries[spec.name]
    kernel = StaticCudaKernel(spec, binary, (1, 1, 1), impl=impl, stream=lambda: 5,
                              device=0, loader=CubinLoader(CudaDriver(lib), 1, lock))
    capturing, release = threading.Event(), threading.Event()

    def capture() -> None:
        with lock:
            capturing.set()
            release.wait(10)

    other = threading.Thread(target=capture)
    other.start()
    capturing.wait(10)
    kernel.prefetch()
    assert kernel._pending is not None
    kernel._pending.exception(10)  # the helper gave up at once
    assert lib.named("cuModuleLoadData") == []
    release.set()
    other.join()
    with caplog.at_level(logging.WARNING, "kiln.runtime"):
        kernel.run(*[object() for _ in kernel_spec_pointers(softmax_graph)])
    assert caplog.text == ""
    loads = [thread for call, _, thread in lib.calls if call == "cuModuleLoadData"]
    assert loads == [threading.current_thread().name] and impl.loads == []


def test_with_no_helper_threads_each_kernel_loads_from_memory_at_its_first_launch(
        softmax_graph: Any) -> None:
    lib, impl = RecordingLibcuda(), RecordingLauncher()
    spec = softmax_graph.kernels[0]
    binary = softmax_graph.binaries[spec.name]
    kernel = StaticCudaKernel(spec, binary, (1, 1, 1), impl=impl, stream=lambda: 5,
                              device=0, loader=CubinLoader(CudaDriver(lib), threads=0))
    static_launcher.prefetch_all([kernel])
    kernel.prefetch()
    assert kernel._pending is None and lib.named("cuModuleLoadData") == []
    kernel.run(*[object() for _ in kernel_spec_pointers(softmax_graph)])
    loads = [(args[1], thread) for call, args, thread in lib.calls
             if call == "cuModuleLoadData"]
    assert loads == [(binary.binary, threading.current_thread().name)]
    assert impl.loads == [] and impl.launches[0][0] == kernel.function
    # this thread's context (torch's, its device) is left as it was: the device's primary
    # context is pushed for the load and popped after, never set
    calls = [call for call, _, _ in lib.calls]
    assert "cuCtxSetCurrent" not in calls
    assert calls.index("cuCtxPushCurrent_v2") < calls.index("cuModuleLoadData") \
        < calls.index("cuCtxPopCurrent_v2")
    primary = lib.named("cuDevicePrimaryCtxRetain")[0][0]._obj.value
    assert lib.named("cuCtxPushCurrent_v2") == [(primary,)]


def test_a_thread_already_in_the_devices_context_loads_without_switching() -> None:
    lib = RecordingLibcuda()
    driver = CudaDriver(lib)
    primary = driver.context(0)
    lib.current = primary  # what cuCtxGetCurrent answers from now on
    driver.load(b"\x7fELF", "k", 0, 0)
    calls = [call for call, _, _ in lib.calls]
    assert "cuCtxPushCurrent_v2" not in calls and "cuCtxSetCurrent" not in calls
    assert calls[-3:] == ["cuModuleLoadData", "cuModuleGetFunction", "cuFuncGetAttribute"]
    assert lib.named("cuFuncGetAttribute")[0][1] == 4  # NUM_REGS: the function fully loaded


@pytest.fixture
def stored_graph(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The softmax graph (sm_90 cubins) published to a real store on disk: (store, key,
    compiled graph)."""
    from kiln.artifact_store import open_store
    from kiln.frontend.core.keys import compute_key
    from kiln.frontend.core.serialize import make_request
    from kiln.workers.artifact import to_artifact

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kcache"))
    args = fake_cuda([torch.randn(64, 300)])
    gm = trace_aten(lambda a: (torch.softmax(a * 2, -1), a.sum(0) * 3), args)
    compiled = compile_graph(gm, args, {}, name="g", target=SM90)
    request = make_request(gm, args, options={}, target=SM90, versions={"v": 1})
    key = compute_key(request)
    store = open_store(f"file://{tmp_path}/store", stats_file=False, local_cache=False)
    assert store.publish(to_artifact(key, request, compiled))
    return store, key.key, compiled


def test_a_hits_cubins_start_loading_while_its_blobs_are_read(
        stored_graph: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each verified cubin blob goes to the helpers as the lookup reads it, before the
    graph is decoded; the loaded graph's kernels then find those loads (one module per
    cubin), and outputs come from the same function handles."""
    from kiln.compiler.runtime.static_launcher import CubinPrefetch
    from kiln.workers.artifact import cubin_records, from_artifact

    store, key, compiled = stored_graph
    lib, impl = RecordingLibcuda(), RecordingLauncher()
    loader = CubinLoader(CudaDriver(lib), threads=1)
    seen: list[str] = []
    class Watched(CubinPrefetch):
        def blob(self, name: str, data: bytes) -> None:
            seen.append(name)
            super().blob(name, data)

    observer = Watched(loader, 0, 90, cubin_records)
    artifact = store.get(key, observer=observer)
    assert artifact is not None
    cubins = {f"kernels/{spec.name}.cubin" for spec in compiled.kernels}
    assert cubins <= set(seen) and set(observer.wanted) == cubins
    early = dict(loader._futures)
    assert len(early) == len(compiled.kernels)  # submitted during the lookup
    monkeypatch.setattr(torch._C, "_StaticCudaLauncher", impl, raising=False)
    monkeypatch.setattr(compiled_graph, "_arch_matches", lambda binary, device: True)
    monkeypatch.setattr(static_launcher, "cubin_loader", lambda: loader)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7,
                        raising=False)
    call = compiled_graph.load(from_artifact(artifact), {}, torch.device("cuda", 0))
    for spec in compiled.kernels:
        kernel = call.__globals__[spec.name]
        assert kernel._pending in early.values()
        kernel.run(*[object() for t in spec.signature.values() if t.startswith("*")])
    assert len(lib.named("cuModuleLoadData")) == len(compiled.kernels)  # no second load
    assert impl.loads == [] and len(impl.launches) == len(compiled.kernels)


def test_a_cubin_failing_its_digest_is_never_loaded_and_named(stored_graph: Any,
                                                              tmp_path: Path) -> None:
    """A damaged cubin blob in the store: the observer never hears of it, nothing is
    loaded from it, and the lookup is a miss whose problem names the kernel's blob."""
    from kiln.compiler.runtime.static_launcher import CubinPrefetch
    from kiln.workers.artifact import cubin_records

    store, key, compiled = stored_graph
    spec = compiled.kernels[0]
    digest = hashlib.sha256(compiled.binaries[spec.name].binary).hexdigest()
    (tmp_path / "store" / "cas" / digest[:2] / digest).write_bytes(b"\x7fELF tampered")
    lib = RecordingLibcuda()
    loader = CubinLoader(CudaDriver(lib), threads=1)
    outcome = store.lookup(key, observer=CubinPrefetch(loader, 0, 90, cubin_records))
    assert outcome.artifact is None and outcome.status == "damaged"
    assert any(f"kernels/{spec.name}.cubin" in detail for _, detail in outcome.problems)
    for future in list(loader._futures.values()):
        future.result(10)
    images = [args[1] for args in lib.named("cuModuleLoadData")]
    assert b"\x7fELF tampered" not in images  # the others (verified) may have started
    assert compiled.binaries[spec.name].binary not in images


def test_an_early_load_deferred_during_the_lookup_is_retried_under_the_same_job(
        stored_graph: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """While something holds the GPU work lock during the lookup (a CUDA graph capture,
    or an autotune benchmark of an earlier graph still running in the background), the
    early loads are deferred; the graph's kernels then ask again under the same jobs:
    new futures (not the lookup's), one load each, and no second job."""
    from kiln.compiler.runtime.static_launcher import CubinPrefetch
    from kiln.workers.artifact import cubin_records, from_artifact

    store, key, compiled = stored_graph
    lib, impl = RecordingLibcuda(), RecordingLauncher()
    lock = threading.RLock()
    loader = CubinLoader(CudaDriver(lib), threads=1, gpu_lock=lock)
    held, release = threading.Event(), threading.Event()

    def benchmark() -> None:
        with lock:
            held.set()
            release.wait(10)

    other = threading.Thread(target=benchmark)
    other.start()
    held.wait(10)
    artifact = store.get(key, observer=CubinPrefetch(loader, 0, 90, cubin_records))
    early = list(loader._futures.values())
    assert len(early) == len(compiled.kernels)
    assert all(isinstance(f.exception(10), LoadDeferred) for f in early)
    release.set()
    other.join()
    monkeypatch.setattr(torch._C, "_StaticCudaLauncher", impl, raising=False)
    monkeypatch.setattr(compiled_graph, "_arch_matches", lambda binary, device: True)
    monkeypatch.setattr(static_launcher, "cubin_loader", lambda: loader)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 7,
                        raising=False)
    assert artifact is not None
    call = compiled_graph.load(from_artifact(artifact), {}, torch.device("cuda", 0))
    for spec in compiled.kernels:
        kernel = call.__globals__[spec.name]
        assert kernel._pending not in early  # retried: a new future, same job
        kernel.run(*[object() for t in spec.signature.values() if t.startswith("*")])
        assert kernel.module
    assert len(loader._futures) == len(compiled.kernels)
    assert len(lib.named("cuModuleLoadData")) == len(compiled.kernels)
