"""A CUDA graph's capture and replay stood in on CPU, for the CUDA-graph runner's tests
(tests/unit/test_cudagraphs.py, test_cudagraph_swap.py) and bench/replay_host.py: a
capture runs the wrapper on clones of its inputs (like a CUDA capture, it changes nothing
the caller sees) and keeps the outputs; each replay reads the recorded inputs as they are
now and writes those outputs in place, as a CUDA graph does."""

from __future__ import annotations

from typing import Any

import torch

from kiln.compiler.runtime import cudagraphs


class CpuGraph:
    """What a CUDA graph does, over CPU tensors: each replay reads the tensors it was
    recorded with as they are now and writes the outputs it was recorded with."""

    def __init__(self, call: Any, inputs: list[torch.Tensor], outputs: tuple[Any, ...]
                 ) -> None:
        self.call, self.inputs, self.outputs, self.replays = call, inputs, outputs, 0

    def replay(self) -> None:
        self.replays += 1
        for out, fresh in zip(self.outputs, self.call(list(self.inputs))):
            out.copy_(fresh)


def cpu_capture(runner: cudagraphs.CudaGraphRunner, graph_inputs: list[Any]) -> Any:
    """``CudaGraphRunner._capture`` on CPU: a recording of ``runner.call`` over
    ``graph_inputs`` (not run yet)."""
    outputs = runner.call([x.clone() for x in graph_inputs])
    graph = CpuGraph(runner.call, graph_inputs, outputs)
    return cudagraphs._Recording(graph, list(cudagraphs._pointers(graph_inputs)),
                                 graph_inputs, outputs)
