"""``scaled_dot_product_attention`` as a GPU this host does not have runs it.

On a CUDA device, PyTorch's SDPA is a composite: it asks ``_fused_sdp_choice`` (C++,
``sdp_utils.cpp``) which kernel to use, then calls that kernel's ATen op with some
preparation (a boolean mask made additive, the head dim padded for flash attention).
A trace on fake CUDA tensors records those ops, so the ATen graph, and so the key,
depends on the choice. A CPU-only torch has no CUDA chooser and traces the math form;
this module plays the chooser for a target GPU and records the same ops.

The choice depends on:

- the target's torch: the backends' priority order. From torch 2.9 cuDNN attention
  comes first on datacenter Hopper/Blackwell (sm_90, sm_100, sm_103: "prefer cuDNN");
  from 2.10 only when the runtime cuDNN is newer than 9.15 (its seq-len fix), which the
  wheels of 2.11 and later bundle (the H200 host's 2.11.0+cu130 picks cuDNN). Otherwise
  the order is flash, memory-efficient, math, cuDNN (math accepts everything, so cuDNN
  then never runs unless the user reorders);
- the target's CUDA and cuDNN versions (``kiln versions --json`` there records them;
  without them the defaults of that torch's wheels are assumed and a note says so) and
  ``TORCH_CUDNN_SDPA_DEPRIORITIZED`` there;
- the GPU's compute capability, the dtype, head dims, strides, mask, dropout and causal
  flags (each backend's constraints, :func:`flash_refusal` and the others);
- the user's switches, read live in the traced program:
  ``torch.backends.cuda.enable_{flash,mem_efficient,cudnn,math}_sdp``, ``sdpa_kernel``
  (Dynamo replays it inside the graph, so it is in force when the call is traced),
  a priority order set with ``sdpa_kernel(..., set_priority=True)``, and
  ``torch.use_deterministic_algorithms`` (cuDNN attention is not deterministic).

Not modelled (a note says the key may differ): nested tensors, grouped-query attention
with fewer key/value heads, cuDNN head dims above 128 on cuDNN builds this module cannot
see, and FP8 flash attention.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

aten = torch.ops.aten

# SDPBackend numbers (torch.nn.attention.SDPBackend) and names used here.
BACKENDS = {0: "math", 1: "flash", 2: "efficient", 3: "cudnn", 4: "overrideable"}
DEFAULT_ORDER = ("flash", "efficient", "math", "cudnn", "overrideable")
CUDNN_FIRST = ("cudnn", "flash", "efficient", "math")
_TRUE = {"1", "true", "yes", "on"}


def _version(text: str | None) -> tuple[int, int] | None:
    match = re.match(r"^(\d+)\.(\d+)", text or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


def host_runtime() -> dict[str, Any]:
    """This host's CUDA and cuDNN versions and SDPA environment, as ``kiln versions
    --json`` records them for another host's precompile (none needs a GPU)."""
    cudnn = None
    if torch.version.cuda and torch.backends.cudnn.is_available():
        try:
            cudnn = torch.backends.cudnn.version()
        except (RuntimeError, OSError):
            cudnn = None
    flag = os.environ.get("TORCH_CUDNN_SDPA_DEPRIORITIZED", "").strip().lower()
    return {"cuda": torch.version.cuda, "cudnn": cudnn,
            "cudnn_sdpa_deprioritized": flag in _TRUE}


@dataclass(frozen=True)
class SdpaHost:
    """What the target GPU host's chooser depends on besides the call itself."""

    torch: tuple[int, int]
    capability: tuple[int, int]
    cuda: tuple[int, int] | None = None
    cudnn: int | None = None  # e.g. 91501; None: assumed from the torch version
    cudnn_deprioritized: bool = False

    @classmethod
    def for_target(cls, target: dict[str, Any], versions: dict[str, Any] | None = None,
                   runtime: dict[str, Any] | None = None) -> SdpaHost:
        """The host of ``target`` (arch as major * 10 + minor) running ``versions``'
        torch (default: this one), with ``runtime`` (default: this host's, when this torch
        is the target's and is built with CUDA; else unknown)."""
        torch_text = (versions or {}).get("torch") or str(torch.__version__)
        if runtime is None and torch_text == str(torch.__version__) and torch.version.cuda:
            runtime = host_runtime()
        runtime = runtime or {}
        arch = int(target.get("arch", 0))
        return cls(torch=_version(torch_text) or (0, 0), capability=divmod(arch, 10),
                   cuda=_version(runtime.get("cuda")), cudnn=runtime.get("cudnn"),
                   cudnn_deprioritized=bool(runtime.get("cudnn_sdpa_deprioritized")))

    def prefers_cudnn(self, notes: list[str]) -> bool:
        """Whether this host's torch puts cuDNN attention first (``priority_order``)."""
        major, minor = self.capability
        if self.cudnn_deprioritized or self.torch < (2, 9) or major not in (9, 10):
            return False
        if self.torch < (2, 10):
            return minor == 0
        if (self.cuda is None or self.cuda < (13, 0)) and minor not in (0, 3):
            return False
        if self.cudnn is not None:
            return self.cudnn > 91500
        notes.append(f"SDPA: the target's cuDNN version is unknown; assumed the one torch "
                     f"{self.torch[0]}.{self.torch[1]}'s wheels bundle (record it with "
                     "`kiln versions --json` on the target and --versions-from)")
        return self.torch >= (2, 11)


@dataclass
class SdpaCall:
    """One call's arguments, as the chooser sees them."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None = None
    dropout: float = 0.0
    causal: bool = False
    gqa: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def requires_grad(self) -> bool:
        return torch.is_grad_enabled() and any(
            t.requires_grad for t in (self.q, self.k, self.v))


def user_order(host: SdpaHost, notes: list[str]) -> list[str]:
    """The priority order in force: the user's if they set one, else the host's."""
    getter = getattr(torch._C, "_get_sdp_priority_order", None)
    order = tuple(BACKENDS.get(int(b), "?") for b in getter()) if getter else DEFAULT_ORDER
    if order != DEFAULT_ORDER:
        return list(order)
    return list(CUDNN_FIRST if host.prefers_cudnn(notes) else DEFAULT_ORDER)


def enabled_backends() -> dict[str, bool]:
    b = torch.backends.cuda
    return {"flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(),
            "cudnn": b.cudnn_sdp_enabled(), "math": b.math_sdp_enabled(),
            "overrideable": False}


# ---------------------------------------------------------------------------------------
# Each backend's constraints: None if it can run the call, else why not.


def _common_refusal(call: SdpaCall, single_dim_ok: bool) -> str | None:
    q, k, v = call.q, call.k, call.v
    if not q.dim() == k.dim() == v.dim() == 4:
        return "inputs are not 4-D"
    if any(t.is_nested for t in (q, k, v)):
        return "nested inputs are not modelled"
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        return "a sequence length is 0"
    strides_ok = all(t.stride(-1) == 1 for t in (q, k, v)) or (
        single_dim_ok and q.shape[-1] == 1)
    if not strides_ok or (call.mask is not None and call.mask.stride(-1) != 1):
        return "a last dimension has a stride other than 1"
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        return "batch sizes differ"
    if q.shape[1] == k.shape[1] == v.shape[1]:
        return None
    if call.gqa:
        call.notes.append("SDPA: grouped-query attention is not modelled; the key may "
                          "differ from the GPU's")
    return "numbers of heads differ"


def _dtype_refusal(call: SdpaCall, allowed: tuple[torch.dtype, ...]) -> str | None:
    if not call.q.dtype == call.k.dtype == call.v.dtype or call.q.dtype not in allowed:
        return f"dtype {call.q.dtype} is not one of {allowed}"
    return None


def flash_refusal(call: SdpaCall, host: SdpaHost) -> str | None:
    q, k, v = call.q, call.k, call.v
    if call.mask is not None:
        return "flash attention takes no mask"
    if not (q.dim() == 4 and q.shape[-1] == k.shape[-1] == v.shape[-1] <= 256):
        return "head dims differ or exceed 256"
    if not (8, 0) <= host.capability <= (12, 1):
        return "flash attention needs sm_80 to sm_121"
    if call.requires_grad and (host.capability in ((8, 6), (8, 7), (8, 8), (8, 9))
                               or host.capability[0] == 12):
        hd = q.shape[-1]
        if not (hd <= 192 or (call.dropout == 0.0 and hd > 224)):
            return "training with this head dim is not supported on this arch"
    if call.causal and q.shape[-2] != k.shape[-2]:
        return "causal with different query and key lengths"
    return _dtype_refusal(call, (torch.float16, torch.bfloat16)) or _common_refusal(
        call, single_dim_ok=True)


def _gemm_alignment(call: SdpaCall, host: SdpaHost) -> int:
    half = call.q.dtype in (torch.float16, torch.bfloat16)
    tensor_cores = host.capability[0] >= 8 or (host.capability[0] >= 7 and half)
    alignment = 4 if host.capability[0] >= 8 else 1
    return max(alignment, 128 // (16 if half else 32)) if tensor_cores else alignment


def efficient_refusal(call: SdpaCall, host: SdpaHost) -> str | None:
    q, k, v = call.q, call.k, call.v
    if not (5, 0) <= host.capability <= (12, 1):
        return "memory-efficient attention needs sm_50 to sm_121"
    if q.dim() != 4:
        return "inputs are not 4-D"
    align = _gemm_alignment(call, host)
    if q.shape[-1] != k.shape[-1] or q.shape[-1] % align or v.shape[-1] % align or \
            not q.shape[-1] or not v.shape[-1]:
        return f"head dims are not equal multiples of {align}"
    if host.capability[0] >= 8 and any(
            t.numel() and (t.storage_offset() * t.element_size()) % (align * q.element_size())
            for t in (q, k, v)):
        return "an input's storage offset is not aligned"
    dtypes = (torch.float16, torch.float32) + (
        (torch.bfloat16,) if host.capability[0] >= 8 else ())
    return _common_refusal(call, single_dim_ok=False) or _dtype_refusal(call, dtypes)


def _mask_shape_ok(call: SdpaCall) -> bool:
    mask, q, k = call.mask, call.q, call.k
    if mask is None:
        return True
    if mask.requires_grad or mask.dim() not in (2, 4):
        return False
    if mask.shape[-2] not in (q.shape[2], 1) or mask.shape[-1] not in (k.shape[2], 1):
        return False
    return mask.dim() == 2 or (mask.shape[0] in (1, q.shape[0]) and
                               mask.shape[1] in (1, q.shape[1]))


def cudnn_refusal(call: SdpaCall, host: SdpaHost) -> str | None:
    q, k, v = call.q, call.k, call.v
    if torch.are_deterministic_algorithms_enabled() and \
            not torch.is_deterministic_algorithms_warn_only_enabled():
        return "cuDNN attention is not deterministic"
    refusal = _dtype_refusal(call, (torch.float16, torch.bfloat16))
    if refusal or q.dim() != 4:
        return refusal or "inputs are not 4-D"
    if not _mask_shape_ok(call):
        return "the mask's shape is not one cuDNN takes"
    if not (8, 0) <= host.capability <= (12, 1):
        return "cuDNN attention needs sm_80 to sm_121"
    if call.dropout * 16 != math.floor(call.dropout * 16):
        return "dropout is not a multiple of 1/16"
    refusal = _common_refusal(call, single_dim_ok=True)
    if refusal:
        return refusal
    if q.shape[0] > 65535 or q.shape[1] > 65535:
        return "batch or heads above 65535"
    if k.shape[2] == 1 or (call.dropout and q.shape[2] == 1):
        return "a sequence length of 1"
    d_qk, d_v = q.shape[3], v.shape[3]
    if d_qk % 8 or d_v % 8:
        return "head dims are not multiples of 8"
    if max(d_qk, d_v) > 128:
        return _cudnn_wide_head(call, host, d_qk, d_v)
    return None


def _cudnn_wide_head(call: SdpaCall, host: SdpaHost, d_qk: int, d_v: int) -> str | None:
    """Head dims above 128: allowed on sm_90/sm_10x with cuDNN newer than 9.22 (and a
    cuDNN frontend this module cannot see)."""
    wide = host.capability == (9, 0) or host.capability[0] == 10
    if wide and max(d_qk, d_v) <= 256 and host.cudnn is not None and host.cudnn > 92200:
        call.notes.append("SDPA: cuDNN attention with head dims above 128 assumed (it "
                          "also needs a new cuDNN frontend); the key may differ")
        return None
    return "head dims above 128"


REFUSALS: dict[str, Callable[[SdpaCall, SdpaHost], str | None]] = {
    "flash": flash_refusal, "efficient": efficient_refusal, "cudnn": cudnn_refusal}


def choose(call: SdpaCall, host: SdpaHost) -> str:
    """``cudnn``, ``flash``, ``efficient`` or ``math``: what ``_fused_sdp_choice`` on the
    target host returns for this call (``error`` if no enabled backend can run it)."""
    enabled = enabled_backends()
    for name in user_order(host, call.notes):
        if not enabled.get(name, False):
            continue
        if name == "math" or REFUSALS[name](call, host) is None:
            return name
    return "error"


# ---------------------------------------------------------------------------------------
# The ops SDPA's composite records for each choice.


def _additive(mask: torch.Tensor | None, dtype: torch.dtype, fill: float,
              on_mask_device: bool) -> torch.Tensor | None:
    """A boolean mask made additive (``fill`` where it is False), as SDPA does."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    device = {"device": mask.device} if on_mask_device else {}
    zero = aten.scalar_tensor.default(0.0, dtype=dtype, **device)
    return aten.where.ScalarSelf(aten.logical_not.default(mask), fill, zero)


def run_cudnn(call: SdpaCall, scale: float | None) -> torch.Tensor:
    mask = _additive(call.mask, call.q.dtype, -65504.0, on_mask_device=False)
    return aten._scaled_dot_product_cudnn_attention.default(
        call.q, call.k, call.v, mask, call.requires_grad, call.dropout, call.causal,
        False, scale=scale)[0]


def run_flash(call: SdpaCall, scale: float | None) -> torch.Tensor:
    head = call.q.shape[-1]

    def padded(t: torch.Tensor) -> torch.Tensor:
        return t if head % 8 == 0 else aten.pad.default(t, [0, 8 - head % 8])

    og_scale = scale if scale is not None else 1.0 / math.sqrt(head)
    out = aten._scaled_dot_product_flash_attention.default(
        padded(call.q), padded(call.k), padded(call.v), call.dropout, call.causal, False,
        scale=og_scale)[0]
    return out if out.shape[-1] == head else aten.slice.Tensor(out, -1, 0, head)


def run_efficient(call: SdpaCall, scale: float | None) -> torch.Tensor:
    mask = _additive(call.mask, call.q.dtype, -math.inf, on_mask_device=True)
    if mask is not None:
        aligned = mask.stride(-1) == 1 and all(s % 8 == 0 for s in mask.stride()[:-1])
        if not aligned:
            last = mask.shape[-1]
            mask = aten.slice.Tensor(aten.pad.default(mask, [0, 8 - last % 8]), -1, 0, last)
        q, k = call.q, call.k
        mask = aten.expand.default(mask, [q.shape[0], q.shape[1], q.shape[2], k.shape[2]])
    return aten._scaled_dot_product_efficient_attention.default(
        call.q, call.k, call.v, mask, call.requires_grad, call.dropout, call.causal,
        scale=scale)[0]


RUNNERS: dict[str, Callable[[SdpaCall, float | None], torch.Tensor]] = {
    "cudnn": run_cudnn, "flash": run_flash, "efficient": run_efficient}


def gpu_sdpa(host: SdpaHost, notes: list[str],
             fallback: Callable[..., torch.Tensor] | None = None
             ) -> Callable[..., torch.Tensor]:
    """``F.scaled_dot_product_attention`` as PyTorch's CUDA path on ``host`` runs it: the
    fused op its chooser picks, with that path's preparation. The math choice (and a
    case with no enabled backend, which the GPU refuses) runs ``fallback`` (default:
    SDPA itself, which a torch without CUDA traces in its math form, as the GPU would)."""
    import torch.nn.functional as F

    run_math = fallback or F.scaled_dot_product_attention

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Any = None,
             dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
             enable_gqa: bool = False) -> torch.Tensor:
        call = SdpaCall(q, k, v, attn_mask, float(dropout_p), bool(is_causal),
                        bool(enable_gqa))
        choice = choose(call, host)
        notes.extend(call.notes)
        if choice in RUNNERS:
            return RUNNERS[choice](call, scale)
        if choice == "error":
            notes.append(f"SDPA on {tuple(q.shape)} {q.dtype}: no enabled backend can run "
                         "it on the target (the GPU raises); traced in its math form")
        return run_math(q, k, v, attn_mask, dropout_p, is_causal, scale=scale,
                        enable_gqa=enable_gqa)

    return sdpa
