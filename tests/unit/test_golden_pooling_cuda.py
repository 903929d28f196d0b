"""Golden output code for pooling on a GPU, generated on this CPU machine from fake CUDA
tensors: ResNet-18's stem (convolution, batch norm, relu, 3x3/2 max pool) is one Triton
kernel after the convolution, reading the convolution's channels-last output and writing
the pooled values channels-last for the next convolution; no ATen pooling call, no
indices; the kernel compiles to an sm_90 cubin. Its numerics run under Triton's
interpreter in tests/triton_interp/test_pooling.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.kernel_compile import compile_kernel
from kiln.compiler.runtime.kernel_files import interpreter_active
from tests.targets import SM90

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


def _stem_and_first_conv(x: torch.Tensor, w: torch.Tensor, mean: torch.Tensor,
                         var: torch.Tensor, g: torch.Tensor, b: torch.Tensor,
                         w1: torch.Tensor) -> torch.Tensor:
    y = F.batch_norm(F.conv2d(x, w, None, 2, 3), mean, var, g, b, False, 0.1, 1e-5).relu()
    return F.conv2d(F.max_pool2d(y, 3, 2, 1), w1, None, 1, 1)


def _stem_with_indices(x: torch.Tensor, w: torch.Tensor, mean: torch.Tensor,
                       var: torch.Tensor, g: torch.Tensor, b: torch.Tensor) -> Any:
    y = F.batch_norm(F.conv2d(x, w, None, 2, 3), mean, var, g, b, False, 0.1, 1e-5).relu()
    return F.max_pool2d(y, 3, 2, 1, return_indices=True)


def _compile_stem(training: bool = False) -> CompiledGraph:
    with FakeTensorMode():
        args = [torch.empty(64, 3, 224, 224, device="cuda", dtype=torch.float16),
                torch.empty(64, 3, 7, 7, device="cuda", dtype=torch.float16)]
        args += [torch.empty(64, device="cuda", dtype=torch.float16) for _ in range(4)]
        args += [torch.empty(64, 64, 3, 3, device="cuda", dtype=torch.float16)]
    if training:
        return compile_graph(trace_aten(_stem_with_indices, args[:6]), args[:6], {},
                             compile_kernels=False)
    return compile_graph(trace_aten(_stem_and_first_conv, args), args, {},
                         compile_kernels=False)


def _body(compiled: CompiledGraph) -> list[str]:
    lines = [ln.strip() for ln in compiled.wrapper_source.splitlines()]
    return lines[lines.index("empty_strided_cuda = cuda_allocator(DEVICE)") + 1:]


def test_resnet_stem_is_one_kernel_after_the_convolution() -> None:
    compiled = _compile_stem()
    body = _body(compiled)
    assert "max_pool" not in compiled.wrapper_source
    names = [k.name for k in compiled.kernels]
    # input and weights to channels-last, then batch norm + relu + max pool in one kernel,
    # the next weights, and the result in eager's (NCHW) layout
    assert names == ["triton_poi_fused_copy_0", "triton_poi_fused_copy_1",
                     "triton_poi_fused_add_ge_logical_and_maximum_mul_reciprocal_2",
                     "triton_poi_fused_copy_3", "triton_poi_fused_copy_4"], names
    conv = body.index("buf2 = torch.convolution(buf0, buf1, None, [2, 2], [3, 3], [1, 1], "
                      "False, [0, 0], 1)")
    assert body[conv + 1] == "buf2 = as_layout(buf2, (64, 64, 112, 112), " \
                             "(802816, 1, 7168, 64))"
    # the pooled values, channels-last as the next convolution takes them: no copy
    assert "buf3 = empty_strided_cuda((64, 64, 56, 56), (200704, 1, 3584, 64), " \
           "torch.float16)" in body
    pool = names[2]
    launch = next(ln for ln in body if ln.startswith(f"{pool}.run("))
    assert launch == f"{pool}.run(buf2, arg2_1, arg3_1, arg4_1, arg5_1, buf3)"
    assert "buf5 = torch.convolution(buf3, buf4, None, [1, 1], [1, 1], [1, 1], False, " \
           "[0, 0], 1)" in body
    assert "torch.int64" not in compiled.wrapper_source  # no indices in inference


def test_resnet_stem_pool_kernel_source_and_cubin() -> None:
    compiled = _compile_stem()
    spec = compiled.kernels[2]
    src = spec.source
    assert "xnumel = 12845056" in src  # 64 * 64 * 56 * 56 outputs, one store each
    assert src.count("tl.store(") == 1
    assert src.count("th.maximum(") == 8  # nine taps
    # nine taps of the convolution's output (channels-last, 64 channels innermost): the
    # five taps that may fall in the padding read -inf there; a load is guarded only where
    # its address could leave the buffer (the first row's taps and the (1, 0) tap), so
    # the (2, 0) tap, whose address stays inside, loads under the block's mask alone
    conv_loads = [ln for ln in src.splitlines() if "tl.load(in_ptr0 + " in ln]
    assert len(conv_loads) == 9
    assert [", xmask, other" in ln for ln in conv_loads] == [False] * 4 + [True] * 5
    assert "14336*(xindex // 3584) + 7104), xmask, other" in conv_loads[6]
    assert src.count('float("-inf")') == 5
    centre = "tl.load(in_ptr0 + ((xindex % 64) + 128*((xindex // 64) % 56) + " \
        "14336*(xindex // 3584)), xmask, other=0.0)"
    assert centre in conv_loads[4], conv_loads[4]
    assert "14336*(xindex // 3584) - 7232), xmask & tmp" in conv_loads[0]  # (-1, -1)
    # the per-channel batch-norm vectors load once (not once per tap guard), the inverse
    # standard deviation is computed once; the normalization and relu run per tap, in
    # fp32, rounded to fp16 as eager rounds
    for vector in ("in_ptr1", "in_ptr2", "in_ptr3", "in_ptr4"):
        assert src.count(f"tl.load({vector} + ((xindex % 64)), xmask, other=0.0)") == 1
    assert src.count("tl.sqrt(") == 1 and src.count("tl.where(tmp") >= 9
    binary = compile_kernel(spec, dict(spec.configs[0]), SM90)
    assert binary.binary[:4] == b"\x7fELF"


def test_resnet_stem_training_computes_indices_in_the_same_kernel() -> None:
    """Values and indices over the same window: one kernel with two stores."""
    compiled = _compile_stem(training=True)
    assert len(compiled.kernels) == 3, [k.name for k in compiled.kernels]
    pool = compiled.kernels[2].source
    assert pool.count("tl.store(") == 2 and "th.maximum(" in pool and "tl.where(" in pool
    assert "torch.int64" in compiled.wrapper_source
    assert "max_pool" not in compiled.wrapper_source
