"""Row-column kernels on the GPU: layer-norm backward at sizes with a part of the rows per
SM, every autotuning candidate compiled to a cubin for this device and launched from it,
against eager (fp64 truth for the column sums of bf16, which eager rounds differently)."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from kiln.compiler.compiled_graph import load
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.kernel_compile import compile_kernel
from tests.numerics_cases import tolerance
from tests.triton_interp.helpers import assert_close_to_eager

aten = torch.ops.aten


def _target() -> dict[str, Any]:
    major, minor = torch.cuda.get_device_capability()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {"kind": "cuda", "backend": "cuda", "arch": major * 10 + minor, "warp_size": 32,
            "sm_count": sms}


def _ln_backward(g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor,
                 w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return aten.native_layer_norm_backward(g, x, [x.shape[-1]], mean, rstd, w, b,
                                           [True, True, True])


def _truth(args: list[torch.Tensor], i: int) -> torch.Tensor:
    return _ln_backward(*[a.double() for a in args])[i]


def _inputs(shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    cols = shape[-1]
    x = torch.randn(*shape, device="cuda", dtype=dtype)
    w = torch.randn(cols, device="cuda", dtype=dtype)
    b = torch.randn(cols, device="cuda", dtype=dtype)
    _, mean, rstd = aten.native_layer_norm(x, [cols], w, b, 1e-5)
    return [torch.randn(*shape, device="cuda", dtype=dtype), x, mean, rstd, w, b]


@pytest.mark.gpu
@pytest.mark.parametrize("shape,dtype", [((8192, 4096), torch.bfloat16),
                                         ((16384, 1024), torch.float32),
                                         ((16, 1024, 768), torch.bfloat16)],
                         ids=["8192x4096-bf16", "16384x1024-fp32", "16x1024x768-bf16"])
def test_layer_norm_backward_every_candidate_matches_eager(shape: tuple[int, ...],
                                                           dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    args = _inputs(shape, dtype)
    target = _target()
    compiled = compile_graph(trace_aten(_ln_backward, args), args, {}, target=target)
    assert [k.kind for k in compiled.kernels] == ["row_column", "reduction"]
    row = compiled.kernels[0]
    refs = _ln_backward(*args)

    for config in row.configs:
        compiled.binaries[row.name] = compile_kernel(row, dict(config), target)
        compiled.configs[row.name] = dict(config)
        outs = load(compiled)([a.clone() for a in args])
        for i, (out, ref) in enumerate(zip(outs, refs)):
            assert_close_to_eager(out, ref, functools.partial(_truth, args, i),
                                  tolerance(dtype, reduction=True))
