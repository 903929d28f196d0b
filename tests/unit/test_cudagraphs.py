"""The CUDA-graph runner's decisions, on CPU: which graphs can be recorded, which inputs
are read in place, when a graph records again, and the one warning where it cannot.
(Recording and replay on a GPU: tests/gpu/test_cudagraphs_gpu.py.)"""

from __future__ import annotations

import functools
import gc
import sys
import types
import warnings
from typing import Any

import pytest
import torch

from kiln.compiler.runtime import cudagraphs
from kiln.compiler.runtime.cudagraphs import (
    MAX_DIRECT,
    MAX_SEEN,
    CudaGraphRunner,
    KilnCudaGraphWarning,
    can_read_in_place,
    cudagraphify,
    moved_static,
    output_bytes,
    skip_reason,
    static_inputs,
)
from kiln.frontend.config import KilnConfig
from tests.cudagraph_stand_in import CpuGraph, cpu_capture


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


class _CpuRunner(CudaGraphRunner):
    """The runner's every decision and its replay path (copy-in plan, one foreach copy,
    copy-back of mutated inputs, recordings keyed by address), with capture done on CPU:
    like a CUDA capture, it runs nothing (the outputs come from a call on clones)."""

    _capture = cpu_capture


def _copies(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the runner's ``_foreach_copy_`` launches (one entry per launch)."""
    launches: list[int] = []
    real = torch._foreach_copy_

    def counted(dst: list[torch.Tensor], src: Any) -> None:
        launches.append(len(dst))
        real(dst, src)

    monkeypatch.setattr(torch, "_foreach_copy_", counted)
    return launches


def _scale_and_bump(args: list[Any]) -> tuple[Any, ...]:
    weight, x, counter = args
    counter.add_(1)  # a mutated input
    return (x * weight,)


def test_warm_up_record_replay_and_record_again(monkeypatch: pytest.MonkeyPatch) -> None:
    copies = _copies(monkeypatch)
    runner = _CpuRunner(_call, "g1")
    weight, batches = torch.randn(4), [torch.randn(4) for _ in range(6)]
    for i in range(4):
        torch.testing.assert_close(runner([weight, batches[i]])[0], weight + 1)
    assert runner.recordings == 1 and runner.static == [True, False]  # at call 3
    # The batch copied in (before the recording's capture, then at each replay), the
    # weight read in place.
    assert copies == [1, 1]
    new_weight = torch.randn(4)
    torch.testing.assert_close(runner([new_weight, batches[4]])[0], new_weight + 1)
    assert runner.static == [False, False] and runner.recordings == 2  # it moved
    other = torch.randn(4)
    torch.testing.assert_close(runner([other, batches[5]])[0], other + 1)
    assert runner.recordings == 2 and not runner.direct  # no address set came back


def test_input_that_settles_is_promoted_when_not_read_in_place(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With no recording per address set left to make: a backward's saved tensor moves
    once (its forward starts replaying from its pool), then stays: it is promoted to
    static and the graph records again, once."""
    monkeypatch.setattr(cudagraphs, "MAX_DIRECT", 0)
    runner = _CpuRunner(_call, "g2")
    saved = [torch.randn(4) for _ in range(3)]
    runner([saved[0]])
    runner([saved[1]])
    runner([saved[2]])
    assert runner.recordings == 1 and runner.static == [False]
    runner([saved[2]])
    assert runner.recordings == 2 and runner.static == [True]
    out = runner([saved[2]])[0]
    assert runner.recordings == 2 and runner.recording is not None
    torch.testing.assert_close(out, saved[2] + 1)
    torch.testing.assert_close(runner([saved[0]])[0], saved[0] + 1)
    assert runner.recordings == 3 and runner.static == [False]  # moved: demoted
    runner([saved[0]])
    assert runner.recordings == 3  # demoted for good: never promoted again


def test_repeating_address_sets_replay_in_place_with_no_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU bench's loop: four preallocated input sets in turn, refilled in place. Each
    set gets a recording that reads it where it is on its second call; from then on no
    call copies anything, and every output matches eager on fresh values."""
    copies = _copies(monkeypatch)
    runner = _CpuRunner(_scale_and_bump, "g3", mutated=[2])
    weight = torch.randn(5)
    sets = [[weight, torch.randn(5), torch.zeros(5)] for _ in range(4)]
    for call in range(14):
        args = sets[call % 4]
        args[1].copy_(torch.randn(5))  # new values, same address
        before = args[2].clone()
        out = runner(list(args))[0]
        torch.testing.assert_close(out, args[1] * weight)
        torch.testing.assert_close(args[2], before + 1)  # the mutation reached the caller's
    assert len(runner.direct) == 4 and runner.recordings == 1
    # Calls 3-4, the first sightings of sets 2 and 3 (0 and 1 were seen warming up):
    # the copy recording (the batch and the mutated counter copied in before its capture,
    # then at its replay; the counter copied back each time). No copy since.
    assert copies == [2, 1, 2, 1]
    replays = sorted(rec.graph.replays for rec in runner.direct.values())
    assert replays == [2, 2, 3, 3]  # calls 5-14 (calls 1-2 warm up, set 0 recorded at 5)
    # A replay's outputs are the recording's own tensors (overwritten by the next replay).
    assert runner(list(sets[2]))[0] is runner(list(sets[2]))[0]


def test_more_address_sets_than_recordings_copy_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    copies = _copies(monkeypatch)
    runner = _CpuRunner(_call, "g4")
    sets = [[torch.randn(3)] for _ in range(MAX_DIRECT + 2)]
    for call in range(4 * len(sets)):
        args = sets[call % len(sets)]
        torch.testing.assert_close(runner(list(args))[0], args[0] + 1)
    assert len(runner.direct) == MAX_DIRECT and runner.recordings == 1
    copies.clear()
    for args in sets:
        runner(list(args))
    assert copies == [1, 1]  # the two sets without a recording of their own


def test_large_outputs_are_not_recorded_per_address_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cudagraphs, "DIRECT_OUTPUT_BYTES", 3 * 4 * 16)  # 3 sets of outputs
    runner = _CpuRunner(_call, "g5")
    sets = [[torch.randn(16)] for _ in range(5)]
    for call in range(20):
        args = sets[call % 5]
        torch.testing.assert_close(runner(list(args))[0], args[0] + 1)
    assert runner.out_bytes == 64 and len(runner.direct) == 3


def test_can_read_in_place_needs_a_second_sighting_within_bounds() -> None:
    seen: set[tuple[int, ...]] = set()
    assert not can_read_in_place(seen, 0, (1, 2), 100)
    assert can_read_in_place(seen, 0, (1, 2), 100)
    assert not can_read_in_place(seen, MAX_DIRECT, (1, 2), 100)
    assert not can_read_in_place(seen, 0, (1, 2), cudagraphs.DIRECT_OUTPUT_BYTES + 1)
    for i in range(MAX_SEEN):
        can_read_in_place(seen, 0, (i + 10,), 0)
    assert len(seen) <= MAX_SEEN and (1, 2) not in seen  # forgotten all at once
    assert output_bytes((torch.ones(4), None, [torch.ones(2, dtype=torch.float16)])) == 20


def test_capture_failure_runs_plainly_and_forgets_recordings() -> None:
    class _Failing(_CpuRunner):
        def _capture(self, graph_inputs: list[Any]) -> Any:
            if self.direct:  # every capture after the first
                return "capture failed: RuntimeError: synchronizes"
            return super()._capture(graph_inputs)

    runner = _Failing(_call, "g6")
    x, y = torch.randn(3), torch.randn(3)
    for _ in range(3):
        runner([x])
    assert len(runner.direct) == 1
    failed = r"graph g6 runs without CUDA graphs \(capture failed"
    with pytest.warns(KilnCudaGraphWarning, match=failed):
        torch.testing.assert_close(runner([y])[0], y + 1)  # the copy recording fails
    assert runner.plain_reason is not None and not runner.direct
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(runner([x])[0], x + 1)  # plain, no second warning


def test_served_entry_replays_before_the_slow_path() -> None:
    """What Dynamo calls for an inference graph under CUDA graphs (``served_graph`` around
    the runner): an address set with its own recording replays at once; any other call
    goes through the grad-off path into the runner; outputs match eager throughout."""
    from kiln.frontend.core.aot.cache import served_graph

    slow: list[int] = []

    class _Counted(_CpuRunner):
        def __call__(self, args: list[Any]) -> Any:
            slow.append(len(args))
            return super().__call__(args)

    runner = _Counted(_call, "g7")
    entry = served_graph(runner, False)
    sets = [[torch.randn(3)] for _ in range(2)]
    for call in range(8):
        x = sets[call % 2][0]
        x.copy_(torch.randn(3))
        torch.testing.assert_close(entry(x)[0], x + 1)
    # Calls 1-2 warm up, 3-4 record one set each; 5-8 replay with no slow path.
    assert len(slow) == 4 and len(runner.direct) == 2 and runner.calls == 8


def test_first_replay_falls_back_to_the_python_method() -> None:
    graph = CpuGraph(_call, [torch.ones(2)], (torch.zeros(2),))
    rec = cudagraphs._Recording(graph, [0], graph.inputs, graph.outputs)

    def refuses() -> None:
        raise TypeError("replay(): incompatible function arguments")

    rec.launch = refuses
    cudagraphs.first_replay(rec)
    assert rec.launch == graph.replay and graph.replays == 1
    torch.testing.assert_close(graph.outputs[0], torch.full((2,), 2.0))


def _kiln_frames(fn: Any, sets: list[list[Any]], calls: int) -> tuple[int, list[str]]:
    """Python frames per call of ``fn`` (all of them) and the names of those in Kiln's
    packages."""
    import os

    import kiln
    import kiln.artifact_store
    import kiln.compiler
    import kiln.frontend
    import kiln.workers

    packages = tuple(os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep for m in (
        kiln, kiln.artifact_store, kiln.compiler, kiln.frontend, kiln.workers))
    frames: list[Any] = []

    def note(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            frames.append(frame.f_code)

    collecting = gc.isenabled()
    gc.disable()  # (a collection's callbacks would count as frames of the call)
    sys.setprofile(note)
    try:
        for i in range(calls):
            fn(*sets[i % len(sets)])
    finally:
        sys.setprofile(None)
        if collecting:
            gc.enable()
    ours = sorted({c.co_name for c in frames if c.co_filename.startswith(packages)})
    return len(frames) // calls, ours


def test_a_replay_through_dynamo_runs_as_many_python_frames_as_a_ready_output(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``mode="reduce-overhead"`` end to end (captures on CPU): a call whose inputs have
    a recording runs one Kiln frame, the served entry, and as many Python frames in all
    as a backend that returns a ready output: between Dynamo's call and the replay's C
    call, Kiln adds nothing Dynamo's floor does not have. Outputs match eager first."""
    from kiln import KilnFallbackWarning

    recordings: list[Any] = []

    def capture(runner: CudaGraphRunner, graph_inputs: list[Any]) -> Any:
        recordings.append(cpu_capture(runner, graph_inputs))
        return recordings[-1]

    monkeypatch.setattr(cudagraphs, "skip_reason", lambda device_type, inputs: None)
    monkeypatch.setattr(CudaGraphRunner, "_capture", capture)

    def seed(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return ((a + b) * c.relu()).sum(dim=-1)

    def copy_of_seed() -> Any:  # a code object of its own: one Dynamo cache each
        return types.FunctionType(seed.__code__.replace(), seed.__globals__, "seed",
                                  None, seed.__closure__)

    def ready(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        out = gm(*example_inputs)
        return lambda *args: out

    torch._dynamo.reset()
    sets = [[torch.randn(8, 16) for _ in range(3)] for _ in range(2)]
    kiln = torch.compile(copy_of_seed(), backend="kiln", mode="reduce-overhead",
                         dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        for i in range(8):
            torch.testing.assert_close(kiln(*sets[i % 2]), seed(*sets[i % 2]))
    assert len(recordings) == 2  # one per input set, read in place (calls 3 and 4)
    replays: list[None] = []
    for rec in recordings:
        rec.launch = functools.partial(replays.append, None)  # a C call, as a replay is
    floor = torch.compile(copy_of_seed(), backend=ready, dynamic=False)
    floor(*sets[0])
    frames, ours = _kiln_frames(kiln, sets, 50)
    assert len(replays) == 50 and ours == ["replay_or_call"]
    assert frames == _kiln_frames(floor, sets, 50)[0]
