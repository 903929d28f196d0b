"""A reduce-overhead graph of one Triton kernel served by launching it
(``compiler.runtime.one_launch``), the kernel run by Triton's interpreter on CPU tensors
and the CUDA-graph capture stood in (``tests.cudagraph_stand_in``): outputs against eager
at fresh input addresses each call, no replay after the first."""

from __future__ import annotations

from typing import Any

import torch

from kiln.compiler.compiled_graph import load
from kiln.compiler.runtime.cudagraphs import CudaGraphRunner
from kiln.compiler.runtime.one_launch import OneLaunch
from kiln.compiler.runtime.triton_launcher import TritonLauncher
from tests.cudagraph_stand_in import cpu_capture
from tests.triton_interp.helpers import compile_fn


class _CpuRunner(CudaGraphRunner):
    _capture = cpu_capture


def _seed(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> tuple[Any, ...]:
    return (((a + b) * c.relu()).sum(dim=-1),)


def test_one_triton_kernel_is_launched_not_replayed() -> None:
    shape = (64, 128)
    compiled = compile_fn(_seed, [torch.randn(shape) for _ in range(3)])
    assert len(compiled.kernels) == 1 and compiled.kernels[0].backend == "triton"
    runner = _CpuRunner(load(compiled), "seed")
    sets = [[torch.randn(shape) for _ in range(3)] for _ in range(2)]
    for i in range(10):  # two sets (warm-up, recording), then fresh tensors each call
        args = sets[i % 2] if i < 4 else [torch.randn(shape) for _ in range(3)]
        (out,) = runner(list(args))
        torch.testing.assert_close(out, _seed(*args)[0], rtol=1e-5, atol=1e-5)
    assert len(runner.direct) == 1, [r.one for r in runner.direct.values()]
    (rec,) = runner.direct.values()
    one = runner.one_launch
    assert isinstance(one, OneLaunch) and rec.graph.replays == 1
    kernel = load(compiled).__globals__[one.kernel]
    assert isinstance(kernel, TritonLauncher) and one.kernel == compiled.kernels[0].name
