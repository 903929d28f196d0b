"""Golden output code for GPU-only paths, generated on this CPU machine from fake CUDA
tensors: matmul padding, channels-last convolution, the attention rewrite (its bmm inputs
are views, not copies) and the scatter kernels (also compiled to an sm_90 cubin; their
numerics run under Triton's interpreter in tests/triton_interp/test_scatter.py)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.fx_passes import fuse_attention
from kiln.compiler.kernel_compile import compile_kernel
from kiln.compiler.runtime.kernel_files import interpreter_active
from tests.targets import SM90

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


def _fake(*shapes: tuple[int, ...], dtype: torch.dtype = torch.float16,
          mode: FakeTensorMode | None = None) -> list[torch.Tensor]:
    with mode or FakeTensorMode():
        return [torch.empty(s, device="cuda", dtype=dtype) for s in shapes]


def _compile(fn: Callable[..., Any], args: list[torch.Tensor],
             options: dict[str, Any] | None = None) -> CompiledGraph:
    return compile_graph(trace_aten(fn, args), args, options or {}, compile_kernels=False)


def _body(compiled: CompiledGraph) -> list[str]:
    lines = [ln.strip() for ln in compiled.wrapper_source.splitlines()]
    return [ln for ln in lines[lines.index("args.clear()") + 1:]
            if "align_input" not in ln and ".data_ptr()" not in ln]


def test_matmul_with_unaligned_width_pads_the_weight() -> None:
    compiled = _compile(lambda a, b: a @ b, _fake((2048, 1024), (1024, 1001)))
    body = _body(compiled)
    assert "buf0 = empty_strided_cuda((1024, 1008), (1008, 1), torch.float16)" \
        in body
    assert "buf1 = torch.mm(arg0_1, buf0)" in body
    # Outside an inference graph (a forward's outputs may be saved for its backward), the
    # padded product is returned as eager lays it out: one copy of its first 1001 columns.
    assert "buf2 = empty_strided_cuda((2048, 1001), (1001, 1), torch.float16)" \
        in body
    assert [k.name for k in compiled.kernels] == ["triton_poi_fused_ge_logical_and_lt_0",
                                                  "triton_poi_fused_copy_1"]
    pad = compiled.kernels[0].source
    assert "xnumel = 1032192" in pad and "tl.where(" in pad


def test_gpt2_lm_head_returns_padded_logits_without_a_copy() -> None:
    """GPT-2's tied lm_head (vocabulary 50257, odd) in an inference graph: one
    weight-padding kernel and the library matmul; the logits come back as a view of the
    padded product, not copied (the 0.217 ms ``triton_poi_fused_copy`` on the H200)."""
    compiled = _compile(lambda x, w: F.linear(x, w), _fake((8, 512, 768), (50257, 768)),
                        {"padded_outputs": True})
    body = _body(compiled)
    assert "buf0 = empty_strided_cuda((768, 50264), (1, 768), torch.float16)" in body
    assert "buf1 = torch.mm(reinterpret_tensor(arg0_1, (4096, 768), (768, 1), 0), buf0)" \
        in body
    assert "return (reinterpret_tensor(buf1, (8, 512, 50257), (25735168, 50264, 1), 0), )" \
        in body
    assert [k.name for k in compiled.kernels] == ["triton_poi_fused_ge_logical_and_lt_0"]
    assert sum("empty_strided_cuda(" in ln for ln in body) == 1


def test_biased_lm_head_over_an_odd_vocabulary_is_one_library_call() -> None:
    """BERT's MLM head (vocabulary 30522, with a bias) in an inference graph: the weight
    and the bias padded, one addmm (the bias added in cuBLAS's epilogue) and the logits
    returned as a view of its padded rows. Before, a padded product and then a biased
    copy of it were both live: twice the logits' memory, the largest buffer of the
    graph."""
    compiled = _compile(lambda x, w, b: F.linear(x, w, b),
                        _fake((8, 512, 768), (30522, 768), (30522,)), {"padded_outputs": True})
    body = _body(compiled)
    assert "buf0 = empty_strided_cuda((768, 30528), (1, 768), torch.float16)" in body
    assert "buf1 = empty_strided_cuda((30528,), (1,), torch.float16)" in body
    assert "buf2 = torch.addmm(buf1, reinterpret_tensor(arg0_1, (4096, 768), (768, 1), 0), " \
           "buf0)" in body
    assert "return (reinterpret_tensor(buf2, (8, 512, 30522), (15630336, 30528, 1), 0), )" \
        in body
    assert sum("empty_strided_cuda(" in ln for ln in body) == 2  # the padded weight and bias
    logits = 8 * 512 * 30528 * 2
    assert compiled.stats["peak_bytes"] < logits * 1.25


def _never_freed(compiled: CompiledGraph) -> list[str]:
    """Buffers the wrapper makes that are neither freed nor returned: kept alive, by the
    locals of ``call``, until the graph returns."""
    body = _body(compiled)
    made: list[str] = []
    for line in body:
        found = re.match(r"(buf\d+) = (?!buf\d+\[)", line)
        if found and found.group(1) not in made:
            made.append(found.group(1))
    freed = {name for line in body for name in re.findall(r"del (buf\d+)", line)}
    returned = set(re.findall(r"buf\d+", body[-1]))
    return [name for name in made if name not in freed | returned]


def _layers(x: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
    for w1, b1, w2, b2 in zip(*[iter(weights)] * 4):
        x = F.layer_norm(x + F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2), (x.shape[-1],))
    return x


def test_every_buffer_of_a_layer_stack_is_freed_at_its_last_use() -> None:
    """Four transformer MLP blocks (addmm, GELU, addmm, residual and layer norm): every
    buffer is freed at its last use or handed to a later kernel. A library call returns
    storage of its own, so it never takes a freed buffer's over: before, the storage
    planned for it was never freed (a 12-layer BERT held 4x Inductor's memory)."""
    shapes: list[tuple[int, ...]] = [(4096, 768)]
    for _ in range(4):
        shapes += [(3072, 768), (3072,), (768, 3072), (768,)]
    compiled = _compile(_layers, _fake(*shapes))
    assert _never_freed(compiled) == []
    assert compiled.wrapper_source.count("torch.addmm(") == 8
    # What is live at once: one block's input, its 4096 x 3072 GELU input and output.
    assert compiled.stats["peak_bytes"] <= (2 * 4096 * 3072 + 3 * 4096 * 768) * 2


def test_padded_matmul_feeding_pointwise_still_returns_eager_strides() -> None:
    """Only a matmul returned as it is keeps padded rows: a fused epilogue writes eager's."""
    compiled = _compile(lambda a, b: (a @ b).relu(), _fake((2048, 1024), (1024, 1001)),
                        {"padded_outputs": True})
    body = _body(compiled)
    assert "buf2 = empty_strided_cuda((2048, 1001), (1001, 1), torch.float16)" in body
    assert len(compiled.kernels) == 2


def test_aligned_matmul_is_not_padded() -> None:
    compiled = _compile(lambda a, b: a @ b, _fake((2048, 1024), (1024, 1000)))
    assert not compiled.kernels
    assert "torch.mm(arg0_1, arg1_1)" in compiled.wrapper_source


def test_channels_last_convolution() -> None:
    fn = lambda x, w, b: F.conv2d(x, w, b, padding=1).relu()  # noqa: E731
    compiled = _compile(fn, _fake((8, 16, 32, 32), (32, 16, 3, 3), (32,)))
    body = _body(compiled)
    assert "buf0 = empty_strided_cuda((8, 16, 32, 32), (16384, 1, 512, 16), " \
           "torch.float16)" in body
    assert "buf1 = empty_strided_cuda((32, 16, 3, 3), (144, 1, 48, 16), " \
           "torch.float16)" in body
    conv = body.index("buf2 = torch.convolution(buf0, buf1, None, [1, 1], "
                      "[1, 1], [1, 1], False, [0, 0], 1)")
    assert body[conv + 1] == "buf2 = as_layout(buf2, (8, 32, 32, 32), (32768, 1, 1024, 32))"
    assert [k.name for k in compiled.kernels] == [
        "triton_poi_fused_copy_0", "triton_poi_fused_copy_1", "triton_poi_fused_add_relu_2"]


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.softmax(q @ k.transpose(-2, -1) / 8.0, dim=-1) @ v


def test_attention_rewrite_feeds_bmm_views_without_copies() -> None:
    mode = FakeTensorMode()
    q, k, v = _fake((2, 4, 64, 32), (2, 4, 64, 32), (2, 4, 64, 32), mode=mode)
    gm = torch.fx.symbolic_trace(_attention)
    FakeTensorProp(gm, mode).propagate(q, k, v)
    assert fuse_attention(gm) == 1
    assert any(n.target is F.scaled_dot_product_attention for n in gm.graph.nodes)
    # With no GPU, SDPA decomposes to its math form: two bmm around a softmax. Their
    # operands are reshapes of contiguous buffers: strided views, never copy kernels.
    compiled = _compile(gm, [q, k, v])
    src = compiled.wrapper_source
    # Each operand is only ever taken as the bmm's 3-D view of a 4-D buffer: allocated
    # as that view and passed as is (no view made per call), the reused one too.
    assert "buf0 = empty_strided_cuda((8, 64, 32), (2048, 32, 1), torch.float32)  # as " \
        "its one view" in src
    assert "buf6 = empty_strided_cuda((8, 64, 64), (4096, 64, 1), torch.float32)  # as " \
        "its one view" in src
    assert "buf2 = torch.bmm(buf0, buf1)" in src and "buf7 = buf0; del buf0  # reuse" in src
    assert "buf8 = torch.bmm(buf6, buf7)" in src
    assert "reinterpret_tensor(" not in src[src.index("def call"):]
    assert len(compiled.kernels) == 5, [k.name for k in compiled.kernels]


def test_embedding_backward_scatter_kernel_golden_and_cubin() -> None:
    with FakeTensorMode():
        g = torch.empty(8, 256, 512, device="cuda", dtype=torch.bfloat16)
        i = torch.empty(8, 256, device="cuda", dtype=torch.int64)
    fn = lambda g, i: torch.ops.aten.embedding_dense_backward(g, i, 30000, -1, False)  # noqa
    compiled = _compile(fn, [g, i])
    body = _body(compiled)
    assert body[:5] == [
        "empty_strided_cuda = cuda_allocator(DEVICE)",  # once per call: one C call a buffer
        "buf0 = empty_strided_cuda((30000, 512), (512, 1), torch.float32)",
        "triton_poi_fused_copy_0.run(buf0)",
        "buf1 = buf0  # written in place",
        "triton_poi_fused_scatter_add_1.run(arg0_1, arg1_1, buf1)"]
    scatter = compiled.kernels[1].source
    assert "xnumel = 1048576" in scatter
    assert "tmp2 = tl.where(tmp1 < 0, tmp1 + 30000, tmp1)" in scatter
    assert "tl.atomic_add(out_ptr0 + ((xindex % 512) + 512*tmp2), tmp0, xmask, " \
           "sem='relaxed')" in scatter
    assert ".to(tl.float32)" in scatter  # bf16 gradients add into the fp32 accumulator
    spec = compiled.kernels[1]
    binary = compile_kernel(spec, dict(spec.configs[0]), SM90)
    assert binary.binary[:4] == b"\x7fELF"


def test_scatter_reduce_amax_cubin() -> None:
    with FakeTensorMode():
        x = torch.empty(64, 128, device="cuda")
        i = torch.empty(256, 128, device="cuda", dtype=torch.int64)
        s = torch.empty(256, 128, device="cuda")
    compiled = _compile(lambda x, i, s: x.scatter_reduce(0, i, s, "amax"), [x, i, s])
    spec = next(k for k in compiled.kernels if "tl.atomic_max(" in k.source)
    assert spec.name == "triton_poi_fused_scatter_max_1"
    assert compile_kernel(spec, dict(spec.configs[0]), SM90).binary[:4] == b"\x7fELF"


_B, _S, _D, _H = 8, 128, 256, 4


def _encoder_layer(x: torch.Tensor, mask: torch.Tensor, *p: torch.Tensor) -> torch.Tensor:
    wqkv, bqkv, wo, bo, w1, b1, w2, b2, g1, be1, g2, be2 = p
    b, s, d = x.shape
    q, k, v = (t.view(b, s, _H, d // _H).transpose(1, 2)
               for t in F.linear(x, wqkv, bqkv).split(d, -1))
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    x = F.layer_norm(x + F.linear(y.transpose(1, 2).reshape(b, s, d), wo, bo), (d,), g1, be1)
    return F.layer_norm(x + F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2), (d,), g2, be2)


def _encoder(layers: int) -> Callable[..., torch.Tensor]:
    def encoder(x: torch.Tensor, keep: torch.Tensor, *p: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_fill(
            keep.logical_not(), float("-inf")).unsqueeze(1).unsqueeze(1)
        for i in range(layers):
            x = _encoder_layer(x, mask, *p[12 * i:12 * (i + 1)])
        return x

    return encoder


def _encoder_launches(layers: int) -> tuple[CompiledGraph, int]:
    d = _D
    shapes = [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,),
              (d,), (d,), (d,), (d,)] * layers
    with FakeTensorMode():
        x = torch.empty(_B, _S, d, device="cuda", dtype=torch.float16)
        keep = torch.empty(_B, _S, device="cuda", dtype=torch.bool)
        params = [torch.empty(s, device="cuda", dtype=torch.float16) for s in shapes]
    compiled = _compile(_encoder(layers), [x, keep, *params])
    return compiled, compiled.wrapper_source.count(".run(")


def test_encoder_layers_launches_and_mask_built_once() -> None:
    """Launches grow by the same count per layer, the padding mask costs no kernel of its
    own (it is read inside each softmax), and every matmul reads views, not copies. (With
    no GPU, SDPA is in its math form here; on a GPU it is one attention call.)"""
    one, per_layer = _encoder_launches(1)
    two, launches = _encoder_launches(2)
    assert launches == 2 * per_layer == 16, two.wrapper_source
    softmax = [k for k in one.kernels if "exp" in k.name]
    assert len(softmax) == 1 and "logical_not" in softmax[0].name  # the mask, fused
    matmuls = [ln for ln in two.wrapper_source.splitlines() if "torch.bmm(" in ln
               or "torch.addmm(" in ln]
    assert len(matmuls) == 12
    # Each weight is a transposed view of its input; the activations and the attention
    # operands are buffers allocated in the shape the library call takes (no view made
    # per call), but for the first layer's input, a view of the graph's input.
    addmm = [ln for ln in matmuls if "torch.addmm(" in ln]
    assert len(addmm) == 8 and all(re.search(
        r", reinterpret_tensor\(arg\d+_1, \(\d+, \d+\), \(1, \d+\), 0\)\)$", ln)
        for ln in addmm), addmm
    assert sum(ln.count("reinterpret_tensor(") for ln in matmuls) == 9, matmuls
    assert all(re.search(r"torch\.bmm\(buf\d+, buf\d+\)$", ln)
               for ln in matmuls if "torch.bmm(" in ln), matmuls


def test_a_cpu_scalar_input_of_a_gpu_graph_is_copied_to_the_gpu_first() -> None:
    """Eager lets a CPU scalar tensor meet CUDA tensors (``x * torch.tensor(2.)``); a
    Triton kernel reads device memory only, so the input is copied to the device once at
    the start of the call (it was handed to the kernel as a host pointer: a segfault or
    "invalid argument" on the H100 in torchvision's Swin and the detection models)."""
    mode = FakeTensorMode()
    (x,) = _fake((8, 8), dtype=torch.float32, mode=mode)
    with mode:
        s = torch.empty((), dtype=torch.float32)
    compiled = compile_graph(trace_aten(lambda x, s: (x * s).sin(), [x, s]), [x, s], {},
                             compile_kernels=False, target=SM90)
    body = _body(compiled)
    assert "buf0 = torch.ops.aten._to_copy.default(arg1_1, device=DEVICE)" in body, body
    launch = next(ln for ln in body if ".run(" in ln)
    assert "arg1_1" not in launch and "buf0" in launch, launch


def test_a_graph_with_no_gpu_input_that_makes_gpu_tensors_is_a_gpu_graph() -> None:
    """A graph that builds a mask from sizes alone (BART's, after a graph break) takes no
    CUDA tensor: its device comes from what it makes, and it compiles for the GPU (it was
    compiled for the CPU, and its mask came back on the CPU)."""
    from kiln.frontend.core.graphs import graph_device

    mode = FakeTensorMode()
    with mode:
        cpu = torch.empty(4)
    gm = trace_aten(lambda n: torch.ones(8, 8, device="cuda").tril() * n.sum(), [cpu])
    assert graph_device(gm, [cpu]).type == "cuda"
    gm_cpu = trace_aten(lambda n: torch.ones(8, 8).tril() * n.sum(), [cpu])
    assert graph_device(gm_cpu, [cpu]).type == "cpu"
    # A CPU scalar first among the inputs (Swin's and DeBERTa's graphs on the H100) does
    # not make a CPU graph of a GPU one: the wrapper's device moves its constants there.
    (x,) = _fake((4,), mode=mode)
    gm_mixed = trace_aten(lambda n, x: x * n.sum(), [cpu, x])
    assert graph_device(gm_mixed, [cpu, x]).type == "cuda"
