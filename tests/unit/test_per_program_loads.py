"""A split reduction's per-channel value (``xindex // D`` -> ``xoffset // D``, one value
per program) loads through a block pointer as [XBLOCK, 1] under ``xmask``: a scalar
pointer with the block mask is what Triton refuses to compile ("Mask argument cannot be
block type if pointer argument is not a block"), seen on the H200 in ResNet-50's training
backward (batch norm and relu's gradient, 2026-12-04). Generated on this CPU machine from
fake CUDA tensors at ResNet-50's size and cross-compiled for sm_90; numerics under the
interpreter are in tests/triton_interp/test_per_program_numerics.py."""

from __future__ import annotations

import re

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.kernel_compile import triton_compiled
from kiln.compiler.runtime.kernel_files import interpreter_active
from tests.targets import SM90

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


def relu_bn_grads(out: torch.Tensor, g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Relu's gradient summed per channel, and its product with the centred input: the
    reductions of a batch norm's backward over N, H and W."""
    gr = torch.where(out <= 0, torch.zeros_like(g), g)
    return gr.sum((0, 2, 3)), (gr * (x - mean.reshape(1, -1, 1, 1))).sum((0, 2, 3))


@pytest.fixture(scope="module")
def compiled() -> CompiledGraph:
    with FakeTensorMode():
        args = [torch.empty(32, 256, 14, 14, device="cuda") for _ in range(3)]
        args.append(torch.empty(256, device="cuda"))
    return compile_graph(trace_aten(relu_bn_grads, args), args, {}, compile_kernels=False)


def test_per_program_value_loads_as_a_block(compiled: CompiledGraph) -> None:
    stage1 = compiled.kernels[0]
    assert (stage1.kind, stage1.xnumel, stage1.rnumel) == ("persistent_reduction", 512, 3136)
    loads = re.findall(r"tl\.load\((in_ptr\d) \+ \((.*?)\), (.*?), other", stage1.source)
    per_program = [(idx, mask) for _, idx, mask in loads
                   if "xindex" not in idx.replace("0*xindex", "") and "rindex" not in idx]
    assert per_program == [("(xoffset // 2) + 0*xindex", "xmask")], loads


def test_every_config_compiles_for_sm90(compiled: CompiledGraph) -> None:
    for kernel in compiled.kernels:
        assert kernel.configs
        for config in kernel.configs:
            assert triton_compiled(kernel, dict(config), SM90).asm["cubin"][:4] == b"\x7fELF"
