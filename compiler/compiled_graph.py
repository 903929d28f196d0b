"""A compiled graph: wrapper source, kernels and their binaries; and loading it into a
callable. Everything here is plain data, so it can be stored and shipped."""

from __future__ import annotations

import linecache
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from . import trace
from .codegen.kernel_spec import KernelSpec
from .kernel_compile import KernelBinary
from .runtime.buckets import NewBucket, generic_config

log = logging.getLogger("kiln.compiled")


@dataclass
class CompiledGraph:
    """Output of ``compile_graph``: sources, binaries, and what the wrapper needs."""

    name: str
    device_type: str
    wrapper_source: str
    kernels: list[KernelSpec]
    constant_names: list[str] = field(default_factory=list)
    binaries: dict[str, KernelBinary] = field(default_factory=dict)
    configs: dict[str, dict[str, Any]] = field(default_factory=dict)
    autotuned: bool = False
    timings: dict[str, float] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    lifetimes: str = ""
    # Graphs with dynamic shapes: per kernel, the config tuned for each size bucket
    # (``runtime.buckets``) and its binary (none under Triton's interpreter).
    buckets: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)
    bucket_binaries: dict[str, dict[str, KernelBinary]] = field(default_factory=dict)
    # Where a farm that built this graph published it ("" if nowhere); not stored.
    published_to: str = field(default="", compare=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "device_type": self.device_type,
            "wrapper_source": self.wrapper_source,
            "kernels": [k.to_dict() for k in self.kernels],
            "constant_names": list(self.constant_names),
            "binaries": {k: b.to_dict() for k, b in self.binaries.items()},
            "configs": self.configs, "autotuned": self.autotuned, "timings": self.timings,
            "stats": self.stats, "lifetimes": self.lifetimes,
            "buckets": {k: {b: dict(c) for b, c in v.items()} for k, v in self.buckets.items()},
            "bucket_binaries": {k: {b: x.to_dict() for b, x in v.items()}
                                for k, v in self.bucket_binaries.items()},
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> CompiledGraph:
        return CompiledGraph(
            d["name"], d["device_type"], d["wrapper_source"],
            [KernelSpec.from_dict(k) for k in d["kernels"]], list(d["constant_names"]),
            {k: KernelBinary.from_dict(b) for k, b in d["binaries"].items()},
            {k: dict(v) for k, v in d["configs"].items()}, bool(d["autotuned"]),
            dict(d["timings"]), dict(d["stats"]), d.get("lifetimes", ""),
            {k: {b: dict(c) for b, c in v.items()} for k, v in d.get("buckets", {}).items()},
            {k: {b: KernelBinary.from_dict(x) for b, x in v.items()}
             for k, v in d.get("bucket_binaries", {}).items()})

    def config_for(self, spec: KernelSpec) -> dict[str, Any]:
        return self.configs.get(spec.name) or dict(spec.configs[0])


def load(compiled: CompiledGraph, constants: dict[str, torch.Tensor] | None = None,
         device: torch.device | None = None, on_new_bucket: NewBucket | None = None
         ) -> Callable[[list[Any]], tuple[Any, ...]]:
    """Bind kernels, constants and the device into the wrapper; return its ``call``.
    Kernels with dynamic sizes pick their config by size bucket at each launch;
    ``on_new_bucket`` hears of each bucket that has no tuned config yet."""
    device = device or _default_device(compiled.device_type)
    namespace: dict[str, Any] = {"DEVICE": device}
    for spec in compiled.kernels:
        with trace.span("load kernel", cat="client", kernel=spec.name, graph=compiled.name):
            namespace[spec.name] = _launcher(compiled, spec, device, on_new_bucket)
    if device.type == "cuda":  # the cubins load on helper threads from now on
        from .runtime.static_launcher import prefetch_all

        prefetch_all(namespace[spec.name] for spec in compiled.kernels)
    for name in compiled.constant_names:
        if constants is None or name not in constants:
            raise KeyError(f"constant {name} of graph {compiled.name} was not provided")
        namespace[name] = device_constant(constants[name], device)
    filename = f"<kiln wrapper {compiled.name}>"
    code = compile(compiled.wrapper_source, filename, "exec")
    # Tracebacks, and torch.cuda.memory's allocation frames, show the wrapper's lines.
    linecache.cache[filename] = (len(compiled.wrapper_source), None,
                                 compiled.wrapper_source.splitlines(True), filename)
    exec(code, namespace)
    call = namespace["call"]
    call._boxed_call = True
    call.launchers = [namespace[spec.name] for spec in compiled.kernels]  # (hot swaps)
    return call  # type: ignore[no-any-return]


def device_constant(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` on ``device``, a real tensor even where a dispatch mode is active: a
    backend loads its graph while Dynamo's FakeTensorMode is on the mode stack, where
    ``.to(device)`` of a CPU constant for a GPU graph makes a fake tensor, one with no
    data pointer (torch's static launcher crashed on it; Triton's launcher refused it)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return value.to(device)


def _default_device(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _launcher(compiled: CompiledGraph, spec: KernelSpec, device: torch.device,
              on_new_bucket: NewBucket | None = None) -> Any:
    config, binary = compiled.config_for(spec), compiled.binaries.get(spec.name)
    buckets = compiled.buckets.get(spec.name, {})
    aligned = any(generic_config(c) for c in (config, *buckets.values()))
    if spec.backend == "triton" and spec.size_args and (buckets or on_new_bucket or aligned):
        from .runtime.buckets import BucketedLauncher

        tuned = compiled.bucket_binaries.get(spec.name, {})
        by_bucket = {name: _one_launcher(spec, device, cfg, tuned.get(name))
                     for name, cfg in buckets.items()}

        def generic(bucket: str | None) -> Any:
            """The generic variant of an ALIGN config, compiled on first need for the
            binary's target (Triton's JIT where that fails, or on the interpreter)."""
            plain = generic_config(buckets[bucket] if bucket is not None else config)
            if plain is None:
                return None
            return _one_launcher(spec, device, plain, _compile_generic(spec, plain, binary))

        return BucketedLauncher(spec, _one_launcher(spec, device, config, binary), by_bucket,
                                on_new_bucket, generic if aligned else None)
    return _one_launcher(spec, device, config, binary)


def _compile_generic(spec: KernelSpec, config: dict[str, Any],
                     like: KernelBinary | None) -> KernelBinary | None:
    """The kernel compiled with ``config`` for the target of ``like`` (None without a
    binary to follow, or where it fails: the launcher then JITs the source)."""
    if like is None or not like.binary:
        return None
    from .kernel_compile import compile_kernel

    try:
        return compile_kernel(spec, config, dict(like.target))
    except Exception as e:  # noqa: BLE001 - Triton's JIT of the same source serves
        log.warning("kiln: kernel %s: its generic variant did not compile (%s); using "
                    "Triton's JIT", spec.name, e)
        return None


def _one_launcher(spec: KernelSpec, device: torch.device, config: dict[str, Any],
                  binary: KernelBinary | None) -> Any:
    """The kernel launched with one config (its binary where it has one for this GPU)."""
    if spec.backend == "cpp":
        from .codegen.cpp.build import CppLauncher

        return CppLauncher(spec, binary)
    from .runtime.triton_launcher import TritonLauncher

    if device.type != "cuda":
        return TritonLauncher(spec, config, "interpret")
    if binary is not None and binary.binary and _arch_matches(binary, device):
        static = _static_launcher(spec, binary, device.index)
        if static is not None:
            return static
        try:
            return TritonLauncher(spec, binary.config, "binary", binary)
        except Exception as e:  # a binary that will not load: JIT the source instead
            log.warning("kiln: kernel %s binary did not load (%s); using Triton's JIT",
                        spec.name, e)
    return TritonLauncher(spec, config, "jit")


def _static_launcher(spec: KernelSpec, binary: KernelBinary, device: int | None = None
                     ) -> Any:
    """torch's static CUDA launcher for the cubin (no C compiler, loaded on first launch;
    a kernel with dynamic sizes computes its grid from each launch's ``xnumel``), or None
    where it cannot take this kernel."""
    from .runtime.static_launcher import StaticCudaKernel, StaticLaunchUnsupported
    from .runtime.triton_launcher import TritonLauncher, launch_grid

    try:
        return StaticCudaKernel(spec, binary, launch_grid(spec, binary.config),
                                fallback=lambda: TritonLauncher(spec, binary.config, "binary",
                                                                binary), device=device)
    except StaticLaunchUnsupported as e:
        log.debug("kiln: kernel %s uses Triton's launcher: %s", spec.name, e)
        return None


def _arch_matches(binary: KernelBinary, device: torch.device) -> bool:
    from .runtime.static_launcher import device_arch

    return int(binary.target.get("arch", -1)) == device_arch(device.index)
