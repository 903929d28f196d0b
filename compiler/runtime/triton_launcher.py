"""Launch a generated Triton kernel: from its compiled binary on a GPU (no JIT on the
hit path), through Triton's JIT where no binary fits, or under Triton's interpreter."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..codegen.kernel_spec import KernelSpec, check_kernel_name
from ..kernel_compile import CONSTEXPR_KEYS, KernelBinary
from .kernel_files import import_source

log = logging.getLogger("kiln.runtime")

_BINARY_EXTS = frozenset({"cubin", "hsaco", "spv"})


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def launch_grid(spec: KernelSpec, config: dict[str, Any]) -> tuple[int, int, int]:
    """The grid of a generated kernel: one program per tile (templates) or per XBLOCK
    elements of x."""
    return spec.grid(config)


class TritonLauncher:
    """``run(*tensors)`` launches the kernel over its grid with its chosen config."""

    def __init__(self, spec: KernelSpec, config: dict[str, Any], mode: str,
                 binary: KernelBinary | None = None) -> None:
        self.spec = spec
        self.config = dict(config)
        self.mode = mode  # "interpret", "binary" or "jit"
        self.grid = launch_grid(spec, config)
        # Dynamic shapes: the grid follows the xnumel argument of each launch (templates
        # are generated for static shapes only).
        self.xnumel_at = list(spec.signature).index("xnumel") if spec.size_args else None
        self.xblock = int(config.get("XBLOCK", 1))
        self.constexprs = [config[k] for k in CONSTEXPR_KEYS if k in spec.signature]
        self.blocks = {k: config[k] for k in CONSTEXPR_KEYS if k in spec.signature}
        self._fn: Any = None
        if mode == "binary":
            assert binary is not None
            self.run = self._binary_runner(load_binary(spec, binary))  # type: ignore[method-assign]
        else:
            module = import_source(spec.source, interpret=(mode == "interpret"))
            self._fn = getattr(module, spec.name)

    def _binary_runner(self, compiled: Any) -> Any:
        """A launch closure with everything but the arguments looked up once."""
        import torch

        launch, function = compiled.run, compiled.function
        packed, constexprs = compiled.packed_metadata, tuple(self.constexprs)
        gx, gy, gz = self.grid
        # The device the binary was loaded into (its stream, read on every launch).
        raw_stream, device = torch._C._cuda_getCurrentRawStream, torch.cuda.current_device()
        if getattr(compiled.metadata, "global_scratch_size", 0):
            def scratch_run(*args: Any) -> None:
                ensure_scratch_allocator()
                launch(gx, gy, gz, raw_stream(device), function, packed, None, None,
                       None, *args, *constexprs)

            return scratch_run
        at, xblock = self.xnumel_at, self.xblock

        def run(*args: Any) -> None:
            launch(gx, gy, gz, raw_stream(device), function, packed, None, None, None,
                   *args, *constexprs)

        def run_dynamic(*args: Any) -> None:
            grid_x = max(1, -(-args[at] // xblock))  # type: ignore[index]
            launch(grid_x, 1, 1, raw_stream(device), function, packed, None, None,
                   None, *args, *constexprs)

        return run if at is None else run_dynamic

    def run(self, *args: Any) -> None:
        if self.mode == "jit" and self.spec.kind == "template":
            ensure_scratch_allocator()
        grid = self.grid if self.xnumel_at is None else (
            max(1, _cdiv(args[self.xnumel_at], self.xblock)), 1, 1)
        self._fn[grid](*args, **self.blocks, num_warps=int(self.config["num_warps"]),
                       num_stages=int(self.config["num_stages"]))


def _torch_scratch(size: int, alignment: int, stream: Any) -> Any:
    import torch

    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_scratch_allocator() -> None:
    """Kernels that build TMA descriptors on the device need global scratch memory from
    the allocator of ``triton.set_allocator``: where none is set (in this thread's
    context: the backward pass runs in autograd's threads), torch's allocator serves."""
    from triton.runtime import _allocation

    holder: Any = getattr(_allocation, "_allocator", None)
    current = holder.get() if hasattr(holder, "get") else holder
    if type(current).__name__ == "NullAllocator":
        import triton

        triton.set_allocator(_torch_scratch)


def load_binary(spec: KernelSpec, binary: KernelBinary) -> Any:
    """A Triton ``CompiledKernel`` from a stored cubin, without importing the source.

    Triton reads a kernel from files: they go to a private temporary folder (mode 0700)
    under names checked to be identifiers (the metadata comes from a store), and the
    folder is removed once the module is loaded onto the GPU."""
    from triton.compiler.compiler import CompiledKernel

    meta = dict(binary.metadata)
    ext = str(meta.get("binary_ext", "cubin"))
    name = check_kernel_name(meta.get("name", spec.name))
    if ext not in _BINARY_EXTS:
        raise ValueError(f"kernel {spec.name}: unknown binary kind {ext!r}")
    names = list(spec.signature)
    constants = {(names.index(k),): binary.config[k] for k in CONSTEXPR_KEYS
                 if k in spec.signature}
    src = SimpleNamespace(constants=constants, signature=dict(spec.signature), fn=None,
                          attrs={})
    with tempfile.TemporaryDirectory(prefix="kiln_bin_") as tmp:
        folder = Path(tmp)
        (folder / f"{name}.{ext}").write_bytes(binary.binary)
        (folder / f"{name}.json").write_text(json.dumps(meta))
        group = {f"{name}.{ext}": str(folder / f"{name}.{ext}"),
                 f"{name}.json": str(folder / f"{name}.json")}
        kernel = CompiledKernel(src, group, meta.get("hash", name))
        kernel._init_handles()
    return kernel


def interpret_requested() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"
