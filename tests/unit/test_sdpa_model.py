"""The SDPA chooser of a GPU host this machine does not have (``frontend.cross.sdpa_model``):
which fused kernel the target's torch picks, and the ops its CUDA path records."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.nn.attention import SDPBackend, sdpa_kernel

from kiln.frontend.cross.cuda_guard_shim import ensure_fake_cuda_guard
from kiln.frontend.cross.sdpa_model import SdpaCall, SdpaHost, choose, gpu_sdpa, host_runtime

H200_211 = SdpaHost(torch=(2, 11), capability=(9, 0), cuda=(13, 0))
H200_210 = SdpaHost(torch=(2, 10), capability=(9, 0), cuda=(12, 8))
A100_211 = SdpaHost(torch=(2, 11), capability=(8, 0), cuda=(13, 0))


@pytest.fixture
def mode() -> Iterator[FakeTensorMode]:
    ensure_fake_cuda_guard()
    yield FakeTensorMode()


def qkv(mode: FakeTensorMode, dtype: torch.dtype, *, b: int = 4, h: int = 2, s: int = 16,
        d: int = 16, s_k: int | None = None) -> tuple[torch.Tensor, ...]:
    """q, k, v as a block's projections make them: [b, h, s, d] views of [b, s, h, d]."""
    s_k = s if s_k is None else s_k
    with mode:
        return tuple(torch.empty(b, n, h, d, dtype=dtype, device="cuda").transpose(1, 2)
                     for n in (s, s_k, s_k))


def pick(host: SdpaHost, *tensors: torch.Tensor, mask: torch.Tensor | None = None,
         dropout: float = 0.0, causal: bool = False) -> str:
    q, k, v = tensors
    return choose(SdpaCall(q, k, v, mask, dropout, causal), host)


def test_torch_211_on_hopper_picks_cudnn_for_half(mode: FakeTensorMode) -> None:
    """The H200 host (torch 2.11.0+cu130) traces _scaled_dot_product_cudnn_attention for
    fp16 (the fp16 key miss); 2.10 and Ampere keep flash; fp32 is memory-efficient."""
    half, bf16, fp32 = (qkv(mode, dt) for dt in (torch.float16, torch.bfloat16,
                                                  torch.float32))
    assert pick(H200_211, *half) == "cudnn" and pick(H200_211, *bf16) == "cudnn"
    assert pick(H200_211, *half, causal=True) == "cudnn"
    assert pick(H200_210, *half) == "flash" and pick(A100_211, *half) == "flash"
    assert pick(H200_211, *fp32) == "efficient" == pick(A100_211, *fp32)
    # The host's own cuDNN decides when known: 9.10 is below the 9.15 threshold.
    assert pick(SdpaHost((2, 11), (9, 0), (12, 8), cudnn=91002), *half) == "flash"
    assert pick(SdpaHost((2, 11), (9, 0), (12, 8), cudnn=91701), *half) == "cudnn"
    assert pick(SdpaHost((2, 11), (9, 0), cudnn_deprioritized=True), *half) == "flash"
    # CUDA 12 builds prefer cuDNN only on sm_90 / sm_100 / sm_103 (minor 0 or 3).
    assert pick(SdpaHost((2, 11), (10, 1), (12, 8), cudnn=91701), *half) == "flash"
    assert pick(SdpaHost((2, 11), (10, 1), (13, 0), cudnn=91701), *half) == "cudnn"
    assert pick(SdpaHost((2, 8), (9, 0)), *half) == "flash"


def test_shapes_and_strides_decide(mode: FakeTensorMode) -> None:
    # cuDNN needs head dims that are multiples of 8 (up to 128 here); flash pads them.
    assert pick(H200_211, *qkv(mode, torch.float16, d=20)) == "flash"
    assert pick(H200_211, *qkv(mode, torch.float16, d=256)) == "flash"
    assert pick(H200_211, *qkv(mode, torch.float16, d=512)) == "efficient"
    assert pick(H200_211, *qkv(mode, torch.float32, d=6)) == "math"  # not aligned to 4
    # Flash refuses causal with different lengths; cuDNN does not check it.
    assert pick(H200_210, *qkv(mode, torch.float16, s=8, s_k=16), causal=True) == "efficient"
    assert pick(H200_211, *qkv(mode, torch.float16, s=8, s_k=16), causal=True) == "cudnn"
    assert pick(H200_211, *qkv(mode, torch.float16, s_k=1)) == "flash"  # cuDNN: kv len 1
    assert pick(H200_211, *qkv(mode, torch.float16), dropout=0.1) == "flash"  # not n/16
    assert pick(H200_211, *qkv(mode, torch.float16), dropout=0.125) == "cudnn"
    with mode:
        q, k, v = (torch.empty(4, 2, 16, 32, dtype=torch.float16, device="cuda")[..., ::2]
                   for _ in range(3))
    assert pick(H200_211, q, k, v) == "math"  # no backend takes a strided last dim


def test_masks(mode: FakeTensorMode) -> None:
    """Attention with a mask on sm_90: cuDNN for half when the mask is 2-D or 4-D
    (broadcastable to [b, h, s, s_k]), memory-efficient otherwise and for fp32."""
    half, fp32 = qkv(mode, torch.float16), qkv(mode, torch.float32)
    with mode:
        bool_2d = torch.empty(16, 16, dtype=torch.bool, device="cuda")
        add_4d = torch.empty(4, 1, 1, 16, dtype=torch.float16, device="cuda")
        add_3d = torch.empty(4, 16, 16, dtype=torch.float16, device="cuda")
        heads_3 = torch.empty(4, 3, 16, 16, dtype=torch.float16, device="cuda")
        fp32_4d = torch.empty(4, 1, 16, 16, dtype=torch.float32, device="cuda")
    assert pick(H200_211, *half, mask=bool_2d) == "cudnn"
    assert pick(H200_211, *half, mask=add_4d) == "cudnn"
    assert pick(H200_211, *half, mask=add_3d) == "efficient"
    assert pick(H200_211, *half, mask=heads_3) == "efficient"
    assert pick(H200_210, *half, mask=bool_2d) == "efficient"  # flash takes no mask
    assert pick(A100_211, *half, mask=add_4d) == "efficient"
    assert pick(H200_211, *fp32, mask=fp32_4d) == "efficient"


def test_user_switches(mode: FakeTensorMode) -> None:
    half = qkv(mode, torch.float16)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        assert pick(H200_211, *half) == "flash"
    with sdpa_kernel(SDPBackend.MATH):
        assert pick(H200_211, *half) == "math"
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION],
                     set_priority=True):
        assert pick(H200_211, *half) == "efficient"
        assert pick(H200_210, *half) == "efficient"
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):  # explicit on a host that would not
        assert pick(H200_210, *half) == "cudnn"
    with deterministic():
        assert pick(H200_211, *half) == "flash"
    assert pick(H200_211, *half) == "cudnn"  # all restored


@contextmanager
def deterministic() -> Iterator[None]:
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


def traced_ops(host: SdpaHost, dtype: torch.dtype, mask: tuple[tuple[int, ...],
               torch.dtype] | None = None, d: int = 16) -> list[str]:
    """The ATen ops the modelled SDPA records for one call (make_fx on fake CUDA
    tensors), with a mask of (shape, dtype) if given."""
    from torch.fx.experimental.proxy_tensor import make_fx

    ensure_fake_cuda_guard()
    sdpa = gpu_sdpa(host, [])
    mode = FakeTensorMode()
    inputs = list(qkv(mode, dtype, d=d))
    if mask is not None:
        with mode:
            inputs.append(torch.empty(mask[0], dtype=mask[1], device="cuda"))

    def f(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *m: torch.Tensor
          ) -> torch.Tensor:
        return sdpa(q, k, v, m[0] if m else None)

    with torch.no_grad():
        gm = make_fx(f, tracing_mode="fake")(*inputs)
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def test_recorded_ops_are_those_of_the_cuda_path() -> None:
    """attention.cpp's CUDA branches: cuDNN gets a boolean mask made additive
    (where(~mask, -65504, 0)); flash pads a head dim to a multiple of 8 and slices the
    output back; memory-efficient expands the additive mask to [b, h, s, s_k]; math is
    the matmul-softmax-matmul form."""
    def ops(*args: object, **kw: object) -> list[str]:
        return [op for op in traced_ops(*args, **kw) if "getitem" not in op]  # type: ignore

    cudnn = "aten._scaled_dot_product_cudnn_attention.default"
    where = ["aten.scalar_tensor.default", "aten.logical_not.default",
             "aten.scalar_tensor.default", "aten.where.self"]
    assert ops(H200_211, torch.float16) == [cudnn]
    assert ops(H200_211, torch.float16, ((16, 16), torch.bool)) == [*where, cudnn]
    assert ops(H200_211, torch.float16, ((4, 1, 1, 16), torch.float16)) == [cudnn]
    assert ops(H200_210, torch.float16, d=20) == [
        *["aten.constant_pad_nd.default"] * 3,
        "aten._scaled_dot_product_flash_attention.default", "aten.slice.Tensor"]
    assert ops(H200_211, torch.float32, ((16, 16), torch.bool)) == [
        *where, "aten.expand.default", "aten._scaled_dot_product_efficient_attention.default"]
    math_ops = ops(H200_211, torch.float32, d=6)
    assert math_ops.count("aten.bmm.default") == 2 and "aten._safe_softmax.default" in math_ops
    assert not any("_scaled_dot_product" in op for op in math_ops)


def test_math_choice_matches_eager_sdpa() -> None:
    """The one choice that runs on this host: the math fallback equals F.sdpa."""
    notes: list[str] = []
    sdpa = gpu_sdpa(H200_211, notes)
    q, k, v = (torch.randn(2, 3, 8, 6) for _ in range(3))
    mask = torch.randn(8, 8) > 0
    torch.testing.assert_close(sdpa(q, k, v, mask), F.scaled_dot_product_attention(
        q, k, v, mask), rtol=1e-5, atol=1e-5)


def test_host_from_versions_and_runtime() -> None:
    target = {"kind": "cuda", "arch": 90}
    host = SdpaHost.for_target(target, {"torch": "2.11.0+cu130"},
                               {"cuda": "13.0", "cudnn": 91501})
    assert host == SdpaHost((2, 11), (9, 0), (13, 0), 91501)
    assert SdpaHost.for_target({"arch": 103}).capability == (10, 3)
    runtime = host_runtime()
    assert set(runtime) == {"cuda", "cudnn", "cudnn_sdpa_deprioritized"}
    if torch.version.cuda is None:
        assert runtime["cudnn"] is None
        notes: list[str] = []
        assert SdpaHost.for_target(target, {"torch": "2.11.0"}).prefers_cudnn(notes)
        assert notes and "cuDNN version is unknown" in notes[0]
