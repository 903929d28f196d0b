"""Tracing a model for a GPU this machine does not have: fake CUDA tensors.

``kiln precompile --gpu h200`` on a CPU-only host builds the model on the CPU, turns its
parameters, buffers and inputs into fake CUDA tensors (FakeTensorMode: shapes, strides
and dtypes, no storage), and runs it through ``torch.compile`` with the same Dynamo,
FX-pass and AOTAutograd path as the ``kiln`` backend (``backend.aot_kiln``). Each ATen
graph becomes the request, and so the key, that a client on that GPU computes: the
target is the GPU's (``compile.cuda_target``: arch, warp 32, SM count; never an ordinal).

What a real GPU decides at trace time is modelled here, in one place:

- ``scaled_dot_product_attention`` picks a fused kernel from the GPU and the inputs.
  A CPU-only torch has no CUDA chooser (it traces the math form), so for targets of
  sm_80 and newer the choice PyTorch's CUDA path makes is reproduced: flash attention
  for fp16/bf16 without a mask, memory-efficient attention otherwise (see
  :func:`sdpa_choice`). A case it cannot vouch for keeps the math form, and the summary
  says the key may differ from the GPU's.
- A torch built without CUDA has no CUDA device guard, which Python indexing and
  autograd open even for fake tensors: ``cuda_guard_shim`` registers a stand-in. Its
  autograd engine also needs CUDA's runtime hooks to run a backward, so training graphs
  for a GPU need a CUDA build of torch (a runner without a GPU is fine).
"""

from __future__ import annotations

import json
import math
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

from .backend import aot_kiln, unsupported_reason
from .compile import cuda_target, request_options
from .config import KilnConfig
from .serialize import make_request

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
    from .keys import versions as local_versions

    try:
        theirs = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise FakeDeviceError(f"versions file {path}: {e}") from None
    theirs = theirs.get("versions", theirs) if isinstance(theirs, dict) else theirs
    mine = local_versions()
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
# scaled_dot_product_attention as the target GPU runs it.


def sdpa_choice(arch: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                attn_mask: Any, dropout_p: float, enable_gqa: bool) -> str:
    """``flash``, ``efficient`` or ``math``: the kernel PyTorch's CUDA path picks on a GPU
    of ``arch`` for these inputs, in the cases Kiln models (else ``math``)."""
    if arch < 80 or enable_gqa or dropout_p != 0.0 or q.dim() != 4:
        return "math"
    same = q.dtype == k.dtype == v.dtype and q.shape[1] == k.shape[1] == v.shape[1]
    head_dim = q.shape[-1]
    if not same or any(t.stride(-1) != 1 for t in (q, k, v)) or v.shape[-1] != head_dim:
        return "math"
    if attn_mask is None and q.dtype in (torch.float16, torch.bfloat16) and \
            head_dim <= 256 and head_dim % 8 == 0:
        return "flash"
    align = 16 // q.element_size()
    if attn_mask is None and q.dtype in (torch.float32, torch.float16, torch.bfloat16) and \
            head_dim % align == 0:
        return "efficient"
    return "math"


def gpu_sdpa(arch: int, notes: list[str], fallback: Callable[..., torch.Tensor] | None = None
             ) -> Callable[..., torch.Tensor]:
    """``F.scaled_dot_product_attention`` as PyTorch's CUDA path runs it on ``arch``: the
    fused ATen op it calls, with the arguments it passes (flash attention gets the scale
    computed from the head dim; memory-efficient attention the scale as given). Cases
    not modelled (a mask, dropout, GQA) run ``fallback`` (default: SDPA itself)."""
    run_math = fallback or F.scaled_dot_product_attention

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
             enable_gqa: bool = False) -> torch.Tensor:
        choice = sdpa_choice(arch, q, k, v, attn_mask, dropout_p, enable_gqa)
        if choice == "flash":
            og_scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
            return aten._scaled_dot_product_flash_attention.default(
                q, k, v, dropout_p, is_causal, False, scale=og_scale)[0]
        if choice == "efficient":
            return aten._scaled_dot_product_efficient_attention.default(
                q, k, v, None, False, dropout_p, is_causal, scale=scale)[0]
        notes.append(f"scaled_dot_product_attention on {tuple(q.shape)} {q.dtype}: the "
                     "fused kernel a GPU picks is not modelled here; the key may differ")
        return run_math(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                        enable_gqa=enable_gqa)

    return sdpa


def gpu_device_model(target: dict[str, Any], notes: list[str]
                     ) -> Callable[[torch.fx.GraphModule], None]:
    """The FX pass that stands in for the target GPU's trace-time choices."""
    sdpa = gpu_sdpa(int(target.get("arch", 0)), notes)

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
                   train: bool = False) -> list[TracedGraph]:
    """Run ``model(*inputs)`` through ``torch.compile`` on the kiln backend's path and
    return the request of every ATen graph, keyed for ``target`` (and ``versions``).
    Nothing compiles: each graph runs as traced, on the (fake) inputs."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._guards import detect_fake_mode

    if train and target.get("kind") == "cuda" and not torch.backends.cuda.is_built():
        raise FakeDeviceError(
            "training graphs for a GPU cannot be traced with this torch: it is built "
            "without CUDA, and autograd's engine needs CUDA's runtime hooks even for fake "
            "tensors. Precompile them with a CUDA build of torch (no GPU needed), or "
            "inference graphs only")
    if target.get("kind") == "cuda":
        from .cuda_guard_shim import ShimError, ensure_fake_cuda_guard

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

    device_model = gpu_device_model(target, notes) if target.get("kind") == "cuda" else None

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        return aot_kiln(gm, example_inputs, graph_compiler, device_model=device_model)

    torch._dynamo.reset()  # a fresh compile per shape set: no recompile limit
    compiled = torch.compile(model, backend=backend, dynamic=False)
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
        return TracedGraph(name, None, reason, list(notes))
    try:
        request = make_request(gm, inputs, options=request_options(config), target=target,
                               versions=versions)
    except SerializationError as e:
        return TracedGraph(name, None, f"cannot be keyed: {e}", list(notes))
    return TracedGraph(name, request, "", list(notes))
