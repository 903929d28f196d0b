"""Kernel compilation: (kernel source, config, target) -> binary plus launch metadata.

This is the unit the farm fans out. A GPU target is given explicitly (backend, arch,
warp size), so a machine with no GPU produces cubins for sm_90.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from . import trace
from .codegen.kernel_spec import KernelSpec
from .errors import KilnCompileError

# CPython before 3.13 keeps the AST constructor's recursion depth in state shared by all
# threads: two threads parsing at once can fail with "SystemError: AST constructor
# recursion depth mismatch" (cpython gh-106905). Triton's front end (hashing a kernel's
# source, its AST to TTIR: Python, bound by the GIL anyway) runs under this lock; LLVM
# and ptxas, the slow steps, run in parallel.
_FRONTEND_LOCK = threading.Lock()

# Block sizes a kernel takes as constexpr arguments, in signature order (the last four:
# GEMM templates' tiles).
CONSTEXPR_KEYS = ("XBLOCK", "YBLOCK", "RBLOCK", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")
# A config key of kernels with dynamic sizes: ``ALIGN: 16`` compiles the variant that assumes
# every symbolic size argument divisible by 16 (Triton can then vectorize loads and stores
# like a static kernel's); the launcher runs it only on launches where that holds
# (``runtime.buckets.BucketedLauncher``), and the generic variant on the others.
ALIGN_KEY = "ALIGN"


@dataclass(frozen=True)
class KernelBinary:
    """A compiled kernel for one config and target."""

    name: str
    target: dict[str, Any]
    config: dict[str, Any]
    binary: bytes = b""
    metadata: dict[str, Any] = field(default_factory=dict)
    compile_seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "target": self.target, "config": self.config,
                "binary": self.binary, "metadata": self.metadata,
                "compile_seconds": self.compile_seconds}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> KernelBinary:
        return KernelBinary(d["name"], dict(d["target"]), dict(d["config"]), bytes(d["binary"]),
                            dict(d["metadata"]), float(d.get("compile_seconds", 0.0)))


def triton_target(target: dict[str, Any]) -> Any:
    from triton.backends.compiler import GPUTarget

    return GPUTarget(target.get("backend", "cuda"), int(target["arch"]),
                     int(target.get("warp_size", 32)))


def compile_kernel(spec: KernelSpec, config: dict[str, Any], target: dict[str, Any]
                   ) -> KernelBinary:
    """Compile one kernel for one config; ``target`` like {"kind": "cuda", "arch": 90}."""
    start = time.perf_counter()
    try:
        with trace.span("kernel compile", cat="kernel", kernel=spec.name,
                        config=json.dumps(config, sort_keys=True)):
            binary, meta = _compile_for(spec, config, target)
    except Exception as e:  # name the kernel and where its source is, whatever failed
        from .runtime.kernel_files import write_source

        reason = str(e) if isinstance(e, KilnCompileError) else f"{type(e).__name__}: {e}"
        if "kernel source:" not in reason:
            reason += f"; kernel source: {write_source(spec.source)}"
        raise KilnCompileError(reason, stage="kernel compile", kernel=spec.name) from e
    return KernelBinary(spec.name, dict(target), dict(config), binary, meta,
                        time.perf_counter() - start)


def _compile_for(spec: KernelSpec, config: dict[str, Any], target: dict[str, Any]
                 ) -> tuple[bytes, dict[str, Any]]:
    kind = target.get("kind")
    if kind == "cuda":
        return _compile_triton(spec, config, target)
    if kind == "cpu" and spec.backend == "cpp":
        from .codegen.cpp.build import compile_cpp

        return compile_cpp(spec, target)
    return b"", {"interpret": True}  # Triton's interpreter runs the source: nothing to build


def _compile_triton(spec: KernelSpec, config: dict[str, Any], target: dict[str, Any]
                    ) -> tuple[bytes, dict[str, Any]]:
    compiled = triton_compiled(spec, config, target)
    binary_ext = "cubin" if "cubin" in compiled.asm else "hsaco"
    meta = json.loads(json.dumps(compiled.metadata._asdict(), default=_jsonable))
    meta["binary_ext"] = binary_ext
    return bytes(compiled.asm[binary_ext]), meta


def triton_compiled(spec: KernelSpec, config: dict[str, Any], target: dict[str, Any]
                    ) -> Any:
    """Triton's compiled kernel (its ``asm`` holds every stage: ttgir, ptx, cubin)."""
    import triton

    from .runtime.kernel_files import import_source

    with _FRONTEND_LOCK:
        module = import_source(spec.source)
    fn = getattr(module, spec.name)
    constexprs = {k: config[k] for k in CONSTEXPR_KEYS if k in spec.signature}
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible_args(spec, config)}
    src = _locked_source_class()(fn, dict(spec.signature), constexprs=constexprs, attrs=attrs)
    options = {"num_warps": int(config["num_warps"]), "num_stages": int(config["num_stages"]),
               "enable_fp_fusion": True}
    try:
        return triton.compile(src, target=triton_target(target), options=options)
    except Exception as e:
        raise KilnCompileError(f"Triton failed to compile: {type(e).__name__}: {e}",
                               stage="kernel compile", kernel=spec.name) from e


def size_arg_positions(spec: KernelSpec) -> list[tuple[int, str]]:
    """Each integer size argument of a kernel with dynamic sizes: its position among the
    kernel's arguments and the wrapper's expression for it (``spec.size_args``)."""
    ints = [i for i, t in enumerate(spec.signature.values()) if t in ("i32", "i64")]
    return list(zip(ints, spec.size_args))


def symbolic_positions(spec: KernelSpec) -> tuple[int, ...]:
    """Positions of the size arguments whose value changes with the graph's sizes."""
    return tuple(i for i, expr in size_arg_positions(spec) if not expr.isdigit())


def divisible_args(spec: KernelSpec, config: dict[str, Any]) -> list[int]:
    """Arguments compiled as divisible by 16: every pointer (Kiln allocates and aligns
    them); a constant size argument that is; and, in the ``ALIGN`` variant, every
    symbolic size argument (true of the launches that variant serves)."""
    out = [i for i, t in enumerate(spec.signature.values()) if t.startswith("*")]
    aligned = bool(config.get(ALIGN_KEY))
    out += [i for i, expr in size_arg_positions(spec)
            if (int(expr) % 16 == 0 if expr.isdigit() else aligned)]
    return sorted(out)


@functools.cache
def _locked_source_class() -> Any:
    """Triton's ``ASTSource`` with its AST steps under ``_FRONTEND_LOCK``."""
    from triton.compiler import ASTSource

    class LockedSource(ASTSource):  # type: ignore[misc]
        def hash(self) -> Any:
            with _FRONTEND_LOCK:
                return super().hash()

        def make_ir(self, *args: Any, **kwargs: Any) -> Any:
            with _FRONTEND_LOCK:
                return super().make_ir(*args, **kwargs)

    return LockedSource


def _jsonable(value: Any) -> Any:
    import dataclasses

    if hasattr(value, "_asdict"):
        return value._asdict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "__dict__"):
        return vars(value)
    if isinstance(value, (set, frozenset)):
        return sorted(value)
    return str(value)
