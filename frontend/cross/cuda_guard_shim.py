"""A stand-in CUDA device guard for torch builds without CUDA (fake tracing only).

A torch built without CUDA registers no device guard for CUDA, so a few C++ paths abort
on a CUDA tensor even when it is fake: Python indexing (``x[0]``, ``x[:, 1:]``) opens a
device guard, and autograd records each input's device through one. FakeTensorMode
itself needs neither. This module builds (once, cached under ``KILN_CACHE_DIR``) and
loads a tiny library that registers a guard which only remembers a device index: no
memory, no streams, no kernels. ``torch.cuda.is_available()`` stays False; the guard is
loaded only by ``kiln precompile --gpu`` and ``kiln package`` on CPU-only hosts, never by
a client, and never on a torch built with CUDA.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import threading
from pathlib import Path

import torch

_SOURCE = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
using namespace c10;

// Remembers the current device index; everything else is a no-op (fake tensors only).
struct KilnFakeCudaGuard final : public impl::DeviceGuardImplInterface {
  static thread_local DeviceIndex current;
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device d) const override {
    Device old(DeviceType::CUDA, current);
    current = d.index() < 0 ? 0 : d.index();
    return old;
  }
  Device getDevice() const override { return Device(DeviceType::CUDA, current); }
  void setDevice(Device d) const override { current = d.index() < 0 ? 0 : d.index(); }
  void uncheckedSetDevice(Device d) const noexcept override {
    current = d.index() < 0 ? 0 : d.index();
  }
  Stream getStream(Device d) const override {
    return Stream(Stream::DEFAULT, Device(DeviceType::CUDA, d.index() < 0 ? 0 : d.index()));
  }
  Stream getDefaultStream(Device d) const override { return getStream(d); }
  Stream exchangeStream(Stream s) const override { return s; }
  DeviceIndex deviceCount() const noexcept override { return 8; }
};
thread_local DeviceIndex KilnFakeCudaGuard::current = 0;

C10_REGISTER_GUARD_IMPL(CUDA, KilnFakeCudaGuard);
}  // namespace
"""

_lock = threading.Lock()
_loaded: list[ctypes.CDLL] = []


class ShimError(RuntimeError):
    """The stand-in guard could not be built or loaded."""


def needed() -> bool:
    """Whether this torch lacks a CUDA device guard of its own."""
    return not torch.backends.cuda.is_built()


def ensure_fake_cuda_guard() -> None:
    """Register the stand-in guard in this process, if this torch has none (idempotent)."""
    if not needed():
        return
    with _lock:
        if _loaded:
            return
        _loaded.append(ctypes.CDLL(str(_build()), mode=ctypes.RTLD_GLOBAL))


def _build() -> Path:
    from kiln.compiler.codegen.cpp.build import compiler_path
    from kiln.compiler.runtime.local_cache import private_dir, seal, sealed_bytes

    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cxx = compiler_path()
    flags = ["-shared", "-fPIC", "-O1", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             f"-I{torch_dir / 'include'}", f"-L{torch_dir / 'lib'}", "-lc10",
             f"-Wl,-rpath,{torch_dir / 'lib'}"]
    tag = hashlib.sha256("\0".join([_SOURCE, cxx, str(torch_dir), torch.__version__,
                                    *flags]).encode()).hexdigest()[:16]
    folder = private_dir("cuda_guard_shim")
    out = folder / f"kiln_fake_cuda_guard_{tag}.so"
    if sealed_bytes(out) is not None:  # built by this user, not planted or restored
        return out
    src = folder / f"kiln_fake_cuda_guard_{tag}.cpp"
    src.write_text(_SOURCE)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    result = subprocess.run([cxx, str(src), "-o", str(tmp), *flags], capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise ShimError(f"building the stand-in CUDA device guard with {cxx} failed:\n"
                        f"{result.stderr[-2000:]}")
    seal(out, tmp.read_bytes())
    tmp.replace(out)
    return out
