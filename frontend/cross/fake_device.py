"""Tracing a model for a GPU this machine does not have: fake CUDA tensors.

``kiln precompile --gpu h200`` on a CPU-only host builds the model on the CPU, turns its
parameters, buffers and inputs into fake CUDA tensors (FakeTensorMode: shapes, strides
and dtypes, no storage), and runs it through ``torch.compile`` with the same Dynamo,
FX-pass and AOTAutograd path as the ``kiln`` backend (``backend.aot_kiln``). Each ATen
graph becomes the request, and so the key, that a client on that GPU computes: the
target is the GPU's (``compile.cuda_target``: arch, warp 32, SM count; never an ordinal).

What a real GPU decides at trace time is modelled here, in one place:

- ``scaled_dot_product_attention`` picks a fused kernel (cuDNN, flash or
  memory-efficient attention, else math) from the GPU, the target's torch, cuDNN and
  CUDA versions, the inputs and the user's SDPA switches. A CPU-only torch has no CUDA
  chooser (it traces the math form), so ``sdpa_model`` plays the target's chooser and
  records the ops its CUDA path records. A case it cannot vouch for gets a note in the
  summary: the key may differ from the GPU's.
- A torch built without CUDA has no CUDA device guard, which Python indexing and
  autograd open even for fake tensors: ``cuda_guard_shim`` registers a stand-in. Its
  autograd engine also needs CUDA's runtime hooks to run a backward, so training graphs
  for a GPU need a CUDA build of torch (a runner without a GPU is fine).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.compiler.request import CompileRequest, SerializationError
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.backend import aot_kiln, unsupported_reason
from kiln.frontend.core.compile import cuda_target, request_options
from kiln.frontend.core.serialize import make_request
from kiln.frontend.cross.sdpa_model import SdpaHost, gpu_sdpa

aten = torch.ops.aten

# Named GPUs: (compute capability as major * 10 + minor, multiprocessors). Both are in
# the key. A bare sm_XY means the first GPU of that arch here (sm_90: H200/H100 SXM).
GPUS: dict[str, tuple[int, int]] = {
    "h200": (90, 132), "h100": (90, 132), "gh200": (90, 132), "h100-pcie": (90, 114),
    "a100": (80, 108), "a800": (80, 108), "a10": (86, 72), "a10g": (86, 80),
    "l4": (89, 58), "l40": (89, 142), "l40s": (89, 142), "rtx4090": (89, 128),
    "v100": (70, 80), "t4": (75, 40),
}
_SM = re.compile(r"^(?:sm_?)?(\d{2,3})a?(?::(\d+))?$")


class FakeDeviceError(ValueError):
    """A target or a trace this machine cannot fake (a name, a mode, a versions file)."""


def parse_gpu(text: str) -> dict[str, Any]:
    """The compile target of a named GPU (``h200``) or ``sm_90`` / ``sm_90:132`` (arch and
    multiprocessor count; a bare arch takes the count of the first GPU of that arch in
    :data:`GPUS`)."""
    name = text.strip().lower().removeprefix("nvidia-").replace(" ", "")
    if name in GPUS:
        return cuda_target(*GPUS[name])
    match = _SM.match(name)
    arch = int(match.group(1)) if match else 0
    sms = int(match.group(2)) if match and match.group(2) else next(
        (count for a, count in GPUS.values() if a == arch), None)
    if match is None or sms is None:
        raise FakeDeviceError(
            f"unknown GPU {text!r}: give sm_XY[:SMS] (e.g. sm_90 or sm_90:114) or one of "
            f"{', '.join(sorted(GPUS))}")
    return cuda_target(arch, sms)


# ---------------------------------------------------------------------------------------
# Versions of another host.


def load_versions(path: str | Path) -> dict[str, Any]:
    """Versions written by ``kiln versions --json`` on the target host.

    Kiln's own version and compiler hash must be this machine's: the code in the store is
    generated here, so claiming another compiler would be a lie. torch and triton may
    differ (a warning says what that risks): the graph part of the key then shows
    whether this torch traced the same ATen graph as the target's."""
    from kiln.frontend.core.keys import versions as local_versions

    try:
        theirs = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise FakeDeviceError(f"versions file {path}: {e}") from None
    theirs = theirs.get("versions", theirs) if isinstance(theirs, dict) else theirs
    mine = local_versions()
    if isinstance(theirs, dict):
        theirs = {k: v for k, v in theirs.items() if k != "runtime"}
    if not isinstance(theirs, dict) or set(theirs) != set(mine):
        raise FakeDeviceError(f"versions file {path}: expected the keys {sorted(mine)} "
                              "(the output of `kiln versions --json`)")
    for part in ("kiln", "compiler"):
        if theirs[part] != mine[part]:
            raise FakeDeviceError(
                f"versions file {path}: {part} is {theirs[part]!r} there, {mine[part]!r} "
                "here; precompile with the same Kiln sources the target host runs")
    differing = [k for k in ("torch", "triton") if theirs[k] != mine[k]]
    if differing:
        warnings.warn("kiln precompile: keys claim the target host's " + ", ".join(
            f"{k} {theirs[k]} (here {mine[k]})" for k in differing) + "; a graph this "
            "torch traces differently misses there, and its kernels are built by this "
            "host's triton", UserWarning, stacklevel=2)
    return dict(theirs)


def load_runtime(path: str | Path) -> dict[str, Any] | None:
    """The target host's CUDA and cuDNN versions and SDPA environment, if its versions
    file records them (``kiln versions --json`` does: ``sdpa_model.host_runtime``)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise FakeDeviceError(f"versions file {path}: {e}") from None
    runtime = data.get("runtime") if isinstance(data, dict) else None
    if runtime is not None and not isinstance(runtime, dict):
        raise FakeDeviceError(f"versions file {path}: 'runtime' is not an object")
    return runtime


# ---------------------------------------------------------------------------------------
# Fake tensors.


def fake_like(t: torch.Tensor, mode: FakeTensorMode, device: str) -> torch.Tensor:
    with mode:
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)


def fake_module(model: torch.nn.Module, mode: FakeTensorMode, device: str = "cuda"
                ) -> torch.nn.Module:
    """``model`` (in place) with every parameter and buffer a fake tensor on ``device``
    (parameters keep ``requires_grad``, as on a real client)."""
    return model._apply(lambda t: fake_like(t, mode, device))


def fake_inputs(shapes: Sequence[Sequence[int]], dtype: torch.dtype, mode: FakeTensorMode,
                device: str = "cuda") -> list[torch.Tensor]:
    with mode:
        return [torch.empty(tuple(s), dtype=dtype, device=device) for s in shapes]


# ---------------------------------------------------------------------------------------
# The target GPU's trace-time choices.


def gpu_device_model(target: dict[str, Any], notes: list[str],
                     versions: dict[str, Any] | None = None,
                     runtime: dict[str, Any] | None = None
                     ) -> Callable[[torch.fx.GraphModule], None]:
    """The FX pass that stands in for the target GPU's trace-time choices (the host's
    torch from ``versions``, its CUDA and cuDNN from ``runtime``: see ``sdpa_model``)."""
    sdpa = gpu_sdpa(SdpaHost.for_target(target, versions, runtime), notes)

    def apply(gm: torch.fx.GraphModule) -> None:
        changed = False
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target is F.scaled_dot_product_attention:
                node.target = sdpa
                changed = True
        if changed:
            gm.recompile()

    return apply


# ---------------------------------------------------------------------------------------
# Tracing.


@dataclass
class TracedGraph:
    """One ATen graph of a fake trace: its name, request (None if it cannot be keyed),
    and why not."""

    name: str
    request: CompileRequest | None
    reason: str = ""
    notes: list[str] = field(default_factory=list)


def trace_requests(model: Callable[..., Any], inputs: Sequence[Any], config: KilnConfig,
                   target: dict[str, Any], *, versions: dict[str, Any] | None = None,
                   runtime: dict[str, Any] | None = None, train: bool = False,
                   dynamic: bool = False) -> list[TracedGraph]:
    """Run ``model(*inputs)`` through ``torch.compile`` on the kiln backend's path and
    return the request of every ATen graph, keyed for ``target`` (and ``versions``).
    Nothing compiles: each graph runs as traced, on the (fake) inputs. ``dynamic``:
    traced with ``dynamic=True`` (every size symbolic but those of parameters)."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._guards import detect_fake_mode

    if train and target.get("kind") == "cuda" and not torch.backends.cuda.is_built():
        raise FakeDeviceError(
            "training graphs for a GPU cannot be traced with this torch: it is built "
            "without CUDA, and autograd's engine needs CUDA's runtime hooks even for fake "
            "tensors. Precompile them with a CUDA build of torch (no GPU needed), or "
            "inference graphs only")
    if target.get("kind") == "cuda":
        from kiln.frontend.cross.cuda_guard_shim import ShimError, ensure_fake_cuda_guard

        try:
            ensure_fake_cuda_guard()
        except ShimError as e:
            raise FakeDeviceError(f"cannot trace for a GPU on this host: {e}") from e
    graphs: list[TracedGraph] = []
    notes: list[str] = []

    fake_mode = detect_fake_mode(inputs)

    def graph_compiler(gm: torch.fx.GraphModule, ins: Sequence[Any], name: str) -> Any:
        graphs.append(_traced(gm, ins, name, config, target, versions, notes))
        notes.clear()
        if fake_mode is None:
            return make_boxed_func(gm.forward)

        def run_fake(*args: Any) -> Any:  # factories in the graph make fake tensors too
            with fake_mode:
                return gm.forward(*args)

        return make_boxed_func(run_fake)

    device_model = (gpu_device_model(target, notes, versions, runtime)
                    if target.get("kind") == "cuda" else None)

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        return aot_kiln(gm, example_inputs, graph_compiler, device_model=device_model)

    torch._dynamo.reset()  # a fresh compile per shape set: no recompile limit
    compiled = torch.compile(model, backend=backend, dynamic=dynamic)
    if train:
        out = compiled(*inputs)
        flat = out if isinstance(out, (list, tuple)) else [out]
        losses = [o.float().sum() for o in flat if torch.is_tensor(o) and o.requires_grad]
        if losses:
            torch.stack(losses).sum().backward()
    else:
        with torch.no_grad():
            compiled(*inputs)
    return graphs


def _traced(gm: torch.fx.GraphModule, inputs: Sequence[Any], name: str, config: KilnConfig,
            target: dict[str, Any], versions: dict[str, Any] | None, notes: list[str]
            ) -> TracedGraph:
    reason = unsupported_reason(inputs)
    if reason is not None:
        return TracedGraph(name, None, reason, list(dict.fromkeys(notes)))
    try:
        request = make_request(gm, inputs, options=request_options(config, name), target=target,
                               versions=versions)
    except SerializationError as e:
        return TracedGraph(name, None, f"cannot be keyed: {e}", list(dict.fromkeys(notes)))
    return TracedGraph(name, request, "", list(dict.fromkeys(notes)))
