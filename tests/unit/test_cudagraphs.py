"""The CUDA-graph runner's decisions, on CPU: which graphs can be recorded, which inputs
are read in place, when a graph records again, and the one warning where it cannot.
(Recording and replay on a GPU: tests/gpu/test_cudagraphs_gpu.py.)"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from kiln.compiler.runtime.cudagraphs import (
    MAX_RECORDINGS,
    CudaGraphRunner,
    KilnCudaGraphWarning,
    cudagraphify,
    moved_static,
    skip_reason,
    static_inputs,
)
from kiln.frontend.config import KilnConfig


def _call(args: list[Any]) -> tuple[Any, ...]:
    return (args[0] + 1,)


def test_skip_reasons() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        gpu = torch.empty(4, device="cuda")
    assert skip_reason("cuda", [gpu, gpu]) is None
    assert skip_reason("cpu", [torch.ones(2)]) == "it is a cpu graph"
    assert skip_reason("cuda", [gpu, torch.ones(2)]) == "input 1 is on cpu"
    assert skip_reason("cuda", [gpu, 3]) == "input 1 is a Python int, not a tensor"


def test_static_inputs_and_moves() -> None:
    assert static_inputs([10, 20, 30], [10, 21, 30]) == [True, False, True]
    assert static_inputs([(10, (1,))], [(10, (2,))]) == [False]  # same address, new strides
    static = [True, False, True]
    assert moved_static([10, 21, 30], [10, 99, 30], static) == []  # a batch moves: copied
    assert moved_static([10, 21, 30], [10, 21, 31], static) == [2]  # a parameter moved


def test_cpu_graph_runs_plainly_with_one_warning() -> None:
    with pytest.warns(KilnCudaGraphWarning, match="graph g0 runs without CUDA graphs"):
        fn = cudagraphify(_call, "cpu", [torch.ones(3)], "g0")
    assert fn is _call
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(fn([torch.ones(3)])[0], torch.full((3,), 2.0))


class _Recorder(CudaGraphRunner):
    """The runner with recording replaced by bookkeeping (no GPU here)."""

    def _record(self, inputs: list[Any]) -> Any:
        self.recordings += 1
        if self.recordings > MAX_RECORDINGS:
            return self._give_up(inputs, "moved too often")
        from kiln.compiler.runtime import cudagraphs

        self.recording = cudagraphs._Recording(None, cudagraphs._pointers(inputs),
                                               list(inputs), None)
        return "recorded"

    def _replay(self, inputs: list[Any]) -> Any:
        return "replayed"


def test_warm_up_record_replay_and_record_again() -> None:
    runner = _Recorder(_call, "g1")
    weight, batches = torch.ones(4), [torch.full((4,), float(i)) for i in range(6)]
    assert torch.equal(runner([weight, batches[0]])[0], torch.full((4,), 2.0))  # plain
    runner([weight, batches[1]])  # plain: addresses noted
    assert runner([weight, batches[2]]) == "recorded"
    assert runner.static == [True, False]
    assert runner([weight, batches[3]]) == "replayed"  # the batch is copied in
    new_weight = torch.ones(4)
    assert runner([new_weight, batches[4]]) == "recorded"  # the parameter moved
    assert runner.static == [False, False] and runner.recordings == 2
    assert runner([torch.ones(4), batches[5]]) == "replayed"


def test_input_that_settles_is_read_in_place() -> None:
    """A backward's saved tensor moves once (its forward starts replaying from its pool),
    then stays: it is promoted to static and the graph records again, once."""
    runner = _Recorder(_call, "g2")
    saved = [torch.ones(4) for _ in range(3)]
    runner([saved[0]])
    runner([saved[1]])
    assert runner([saved[2]]) == "recorded" and runner.static == [False]
    assert runner([saved[2]]) == "recorded" and runner.static == [True]
    assert runner([saved[2]]) == "replayed" and runner.recordings == 2
    assert runner([saved[0]]) == "recorded" and runner.static == [False]  # moved: demoted
    assert runner([saved[0]]) == "replayed"  # demoted for good: never promoted again


def test_reduce_overhead_and_option_turn_cudagraphs_on() -> None:
    assert KilnConfig.resolve({"cudagraphs": "1"}).cudagraphs
    assert not KilnConfig.resolve({}).cudagraphs
    # Not a compiler option: the same graph has the same key with or without it.
    assert "cudagraphs" not in KilnConfig.resolve({"cudagraphs": True}).compiler_options()
    assert KilnConfig.resolve({"deterministic": "1"}).compiler_options()["deterministic"]


def test_reduce_overhead_on_a_cpu_model_warns_once_and_matches_eager() -> None:
    from kiln import KilnFallbackWarning

    torch._dynamo.reset()
    fn = torch.compile(lambda x, y: (x * y).relu().sum(-1), backend="kiln",
                       mode="reduce-overhead")
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [fn(x, y) for _ in range(4)]
    kinds = [c.category for c in caught]
    assert KilnFallbackWarning not in kinds
    assert kinds.count(KilnCudaGraphWarning) == 1, [str(c.message) for c in caught]
    for out in outs:
        torch.testing.assert_close(out, (x * y).relu().sum(-1))


class _CpuGraph:
    """Replays ``fn`` over the buffers it was recorded with (what a CUDA graph does)."""

    def __init__(self, fn: Any, buffers: list[torch.Tensor], out: torch.Tensor) -> None:
        self.fn, self.buffers, self.out, self.replays = fn, buffers, out, 0

    def replay(self) -> None:
        self.replays += 1
        self.out.copy_(self.fn(self.buffers))


class _CpuRunner(CudaGraphRunner):
    """The real replay path (copy-in plan, one foreach copy, copy-back of mutated inputs)
    over CPU tensors; recording makes the graph's own buffers as the real one does."""

    def _record(self, inputs: list[Any]) -> Any:
        from kiln.compiler.runtime import cudagraphs

        self.recordings += 1
        buffers = [x if s else torch.empty_like(x) for x, s in zip(inputs, self.static)]
        out = torch.empty_like(inputs[0])
        graph = _CpuGraph(lambda b: self.call(list(b))[0], buffers, out)
        self.recording = cudagraphs._Recording(graph, cudagraphs._pointers(buffers), buffers,
                                               (out,))
        return self._replay(inputs)


def _scale_and_bump(args: list[Any]) -> tuple[Any, ...]:
    weight, x, counter = args
    counter.add_(1)  # a mutated input
    return (x * weight,)


def test_replay_copies_only_moving_inputs_and_writes_mutations_back() -> None:
    runner = _CpuRunner(_scale_and_bump, "g3", mutated=[2])
    weight = torch.randn(5)
    counters = [torch.zeros(5) for _ in range(6)]
    for i in range(6):
        x = torch.randn(5)
        out = runner([weight, x, counters[i]])[0]
        torch.testing.assert_close(out, x * weight)
        assert torch.equal(counters[i], torch.ones(5)), i  # written back to the caller's
    assert runner.static == [True, False, False] and runner.recordings == 1
    plan = runner.plan
    assert plan is not None and len(plan.copy_to) == 2 and plan.copy_back == [2]
    assert plan.recording.inputs[0] is weight  # read in place, never copied
    assert plan.recording.graph.replays == 4  # calls 3-6
