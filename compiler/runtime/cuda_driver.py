"""Cubins loaded from memory through the CUDA driver (``libcuda.so.1`` by ctypes: no C
compiler, nothing written to disk), on helper threads.

torch's static launcher loads a cubin from a file and holds the GIL while the driver
uploads it (about 0.2 ms a kernel on the H200 host); a graph of 50 kernels waited ~11 ms
on its first call. Here each load is ``cuModuleLoadData`` on the bytes already checked
against their digest by the store, called through ctypes, which releases the GIL: a
graph's cubins load on helper threads while the client builds its launchers and runs
its first kernels, and torch's launcher launches the function handles as before
(``StaticCudaKernel``). What Triton's own loader and torch's do to a function with more
than 48 KiB of shared memory (the opt-in maximum) is done here too.

``KILN_CUBIN_LOADER=torch`` turns it off (torch's file-based load, on the caller's
thread); so does a machine where ``libcuda.so.1`` does not open.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("kiln.runtime")

# cuda.h enumerators used here.
_MAX_SHARED_PER_BLOCK_OPTIN = 97  # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
_FUNC_SHARED_SIZE_BYTES = 1  # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
_FUNC_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_CACHE_PREFER_SHARED = 1  # CU_FUNC_CACHE_PREFER_SHARED
_STATIC_SHARED_MAX = 48 * 1024  # above it a kernel opts in to more shared memory
_HANDLE = ctypes.c_void_p
_P = ctypes.POINTER


class CudaDriverError(RuntimeError):
    """A driver call failed; the message names the call, the kernel and the CUDA error."""


# name: (argument types); every entry point returns a CUresult (an int).
_SIGNATURES: dict[str, tuple[Any, ...]] = {
    "cuInit": (ctypes.c_uint,),
    "cuDeviceGet": (_P(ctypes.c_int), ctypes.c_int),
    "cuDeviceGetAttribute": (_P(ctypes.c_int), ctypes.c_int, ctypes.c_int),
    "cuDevicePrimaryCtxRetain": (_P(_HANDLE), ctypes.c_int),
    "cuCtxGetCurrent": (_P(_HANDLE),),
    "cuCtxSetCurrent": (_HANDLE,),
    "cuCtxPushCurrent_v2": (_HANDLE,),
    "cuCtxPopCurrent_v2": (_P(_HANDLE),),
    "cuModuleLoadData": (_P(_HANDLE), ctypes.c_void_p),
    "cuModuleGetFunction": (_P(_HANDLE), _HANDLE, ctypes.c_char_p),
    "cuFuncGetAttribute": (_P(ctypes.c_int), ctypes.c_int, _HANDLE),
    "cuFuncSetAttribute": (_HANDLE, ctypes.c_int, ctypes.c_int),
    "cuFuncSetCacheConfig": (_HANDLE, ctypes.c_int),
    "cuGetErrorName": (ctypes.c_int, _P(ctypes.c_char_p)),
}


@dataclass(frozen=True)
class LoadedCubin:
    """A loaded module and its kernel's function handle (what torch's launcher takes)."""

    module: int
    function: int
    seconds: float  # the load's own time on its helper thread


class CudaDriver:
    """The few driver entry points a cubin's load needs. ``lib``: libcuda (a stand-in in
    tests, with the same functions taking ctypes arguments)."""

    def __init__(self, lib: Any = None) -> None:
        if lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            for name, argtypes in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
        self.lib = lib
        self._contexts: dict[int, int] = {}
        self._lock = threading.Lock()
        # The context each thread made current (each driver call needs the GIL back
        # after it: one call fewer per load on helper threads).
        self._current = threading.local()
        self._check(lib.cuInit(0), "cuInit")

    def _check(self, result: int, call: str, kernel: str = "") -> None:
        if result == 0:
            return
        name = ctypes.c_char_p()
        self.lib.cuGetErrorName(result, ctypes.byref(name))
        error = (name.value or b"").decode() or f"CUresult {result}"
        where = f" for kernel {kernel}" if kernel else ""
        raise CudaDriverError(f"{call}{where} failed: {error}")

    def context(self, device: int) -> int:
        """The primary context of device ordinal ``device`` (torch's), retained once."""
        with self._lock:
            if device not in self._contexts:
                handle, ctx = ctypes.c_int(), _HANDLE()
                self._check(self.lib.cuDeviceGet(ctypes.byref(handle), device), "cuDeviceGet")
                self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), handle.value),
                            "cuDevicePrimaryCtxRetain")
                self._contexts[device] = int(ctx.value or 0)
            return self._contexts[device]

    def load(self, image: bytes, name: str, shared: int, device: int, helper: bool = False
             ) -> tuple[int, int]:
        """Load ``image`` (a cubin) into ``device``'s primary context and return (module,
        function) handles for kernel ``name``. A ``helper`` thread (the loader's own)
        keeps that context current; any other thread gets its own context back."""
        lib, context = self.lib, self.context(device)
        if helper:
            if getattr(self._current, "context", None) != context:  # once per thread
                self._check(lib.cuCtxSetCurrent(context), "cuCtxSetCurrent", name)
                self._current.context = context
            return self._load(image, name, shared, device)
        current = _HANDLE()
        self._check(lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent", name)
        if int(current.value or 0) == context:
            return self._load(image, name, shared, device)
        self._check(lib.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent", name)
        try:
            return self._load(image, name, shared, device)
        finally:
            lib.cuCtxPopCurrent_v2(ctypes.byref(_HANDLE()))

    def _load(self, image: bytes, name: str, shared: int, device: int) -> tuple[int, int]:
        lib = self.lib
        module, function = _HANDLE(), _HANDLE()
        self._check(lib.cuModuleLoadData(ctypes.byref(module), image), "cuModuleLoadData",
                    name)
        self._check(lib.cuModuleGetFunction(ctypes.byref(function), module,
                                            name.encode()), "cuModuleGetFunction", name)
        if shared > _STATIC_SHARED_MAX:
            self._opt_in_shared(function, name, shared, device)
        return int(module.value or 0), int(function.value or 0)

    def _opt_in_shared(self, function: Any, name: str, shared: int, device: int) -> None:
        """Let the kernel use more than 48 KiB: its dynamic maximum raised to the device's
        opt-in limit less its static shared memory (as Triton's and torch's loaders)."""
        lib, optin, static = self.lib, ctypes.c_int(), ctypes.c_int()
        cu_device = ctypes.c_int()
        self._check(lib.cuDeviceGet(ctypes.byref(cu_device), device), "cuDeviceGet", name)
        self._check(lib.cuDeviceGetAttribute(ctypes.byref(optin), _MAX_SHARED_PER_BLOCK_OPTIN,
                                             cu_device.value), "cuDeviceGetAttribute", name)
        if shared >= optin.value:
            raise CudaDriverError(f"kernel {name} needs {shared} bytes of shared memory; "
                                  f"the device allows {optin.value} (smaller blocks or "
                                  "fewer num_stages may fit)")
        self._check(lib.cuFuncSetCacheConfig(function, _CACHE_PREFER_SHARED),
                    "cuFuncSetCacheConfig", name)
        self._check(lib.cuFuncGetAttribute(ctypes.byref(static), _FUNC_SHARED_SIZE_BYTES,
                                           function), "cuFuncGetAttribute", name)
        self._check(lib.cuFuncSetAttribute(function, _FUNC_MAX_DYNAMIC_SHARED,
                                           optin.value - static.value),
                    "cuFuncSetAttribute", name)


class LoadDeferred(RuntimeError):
    """A helper did not load the cubin (a CUDA graph was being captured): the kernel
    loads it itself at its first launch."""


Job = tuple[bytes, str, int, int]  # cubin, kernel name, shared memory, device ordinal


class CubinLoader:
    """Loads cubins on ``threads`` helper threads through a ``CudaDriver``; ``submit_all``
    returns futures at once, and each kernel waits on its own at its first launch. A job
    asked again (the same cubin, name, shared memory and device: a kernel shared by two
    graphs, or one whose load a hit started while its blobs were read) gets the first
    one's future: one module per cubin per device. With no threads
    (``KILN_CUBIN_LOAD_THREADS=0``) nothing is submitted: each kernel loads its cubin
    from memory on its own thread at its first launch.

    ``gpu_lock`` (``cudagraphs.GPU_WORK_LOCK``) is held while a CUDA graph is captured: a
    module load from another thread then would invalidate the capture, so a helper that
    finds it taken leaves the load to the kernel's own thread (``LoadDeferred``)."""

    def __init__(self, driver: CudaDriver, threads: int = 4,
                 gpu_lock: Any = None) -> None:
        self.driver = driver
        self.gpu_lock = gpu_lock
        self.threads = max(0, threads)  # 0: each kernel loads on its first launch
        self._queue: deque[tuple[Job, Future[LoadedCubin]]] = deque()
        self._ready = threading.Condition()
        self._futures: dict[Job, Future[LoadedCubin]] = {}
        self._helpers: list[threading.Thread] = []

    def submit(self, image: bytes, name: str, shared: int, device: int
               ) -> Future[LoadedCubin]:
        return self.submit_all([(image, name, shared, device)])[0]

    def submit_all(self, jobs: Sequence[Job]) -> list[Future[LoadedCubin]]:
        """Futures of ``jobs``, loaded in order by the helpers (one queue: a graph's
        first kernels are ready first); a job already asked keeps its future unless
        that load failed."""
        out, fresh = [], 0
        with self._ready:
            for job in jobs:
                future = self._futures.get(job)
                if future is None or _failed(future):
                    future = self._futures[job] = Future()
                    self._queue.append((job, future))
                    fresh += 1
                out.append(future)
            if fresh:
                self._start_helpers()
                self._ready.notify(fresh)
        return out

    def _start_helpers(self) -> None:
        while len(self._helpers) < self.threads:
            helper = threading.Thread(target=self._serve, daemon=True,
                                      name=f"kiln-cubin-{len(self._helpers)}")
            helper.start()
            self._helpers.append(helper)

    def _serve(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                job, future = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(self._load(*job))
            except BaseException as e:  # noqa: BLE001 - the kernel's thread raises it
                future.set_exception(e)

    def load_here(self, image: bytes, name: str, shared: int, device: int,
                  helper: bool = False) -> LoadedCubin:
        """The load on the calling thread (its current context left as it was, unless
        it is a ``helper``)."""
        start = time.perf_counter()
        module, function = self.driver.load(image, name, shared, device, helper)
        return LoadedCubin(module, function, time.perf_counter() - start)

    def _load(self, image: bytes, name: str, shared: int, device: int) -> LoadedCubin:
        if self.gpu_lock is None:
            return self.load_here(image, name, shared, device, helper=True)
        if not self.gpu_lock.acquire(blocking=False):
            raise LoadDeferred(f"kernel {name}: a CUDA graph capture holds the GPU")
        try:
            return self.load_here(image, name, shared, device, helper=True)
        finally:
            self.gpu_lock.release()


def _failed(future: Future[LoadedCubin]) -> bool:
    return future.done() and (future.cancelled() or future.exception() is not None)


_loader: CubinLoader | None = None
_loader_reason = ""
_loader_lock = threading.Lock()


def cubin_loader(make: Callable[[], CudaDriver] = CudaDriver) -> CubinLoader | None:
    """The process's loader, or None where the driver cannot be used here (no libcuda,
    ``KILN_CUBIN_LOADER=torch``): kernels then load through torch's launcher."""
    global _loader, _loader_reason
    if os.environ.get("KILN_CUBIN_LOADER", "driver") == "torch":
        return None
    with _loader_lock:
        if _loader is None and not _loader_reason:
            try:
                from .cudagraphs import GPU_WORK_LOCK

                threads = int(os.environ.get("KILN_CUBIN_LOAD_THREADS", "4"))
                _loader = CubinLoader(make(), threads, GPU_WORK_LOCK)
            except (OSError, AttributeError, CudaDriverError, ValueError) as e:
                _loader_reason = f"{type(e).__name__}: {e}"
                log.debug("kiln: cubins load through torch's launcher: %s", _loader_reason)
        return _loader


def reset_loader() -> None:
    """Forget the process's loader (tests)."""
    global _loader, _loader_reason
    with _loader_lock:
        _loader, _loader_reason = None, ""
