"""CUDA graphs behind a ``SwappableGraph`` (a graph that switches to tuned kernels while it
runs), on CPU with captures stood in (``tests.cudagraph_stand_in``): the
served entry replays the current runner's recordings before any other work, a switch
after recordings is seen by the next call (never a replay of the kernels it replaced), the
first call and bucket tuning keep their path. (On a GPU: tests/gpu/test_cudagraphs_gpu.py.)"""

from __future__ import annotations

import functools
import types
import warnings
from typing import Any

import pytest
import torch

from kiln.compiler.runtime import cudagraphs
from kiln.compiler.runtime.cudagraphs import CudaGraphRunner
from kiln.frontend.core import hotswap
from kiln.frontend.core.aot.cache import served_graph
from kiln.frontend.core.hotswap import SwappableGraph
from kiln.workers.autotune import FAKE_AUTOTUNE_ENV
from tests.cudagraph_stand_in import cpu_capture
from tests.unit.test_cudagraphs import _CpuRunner, _kiln_frames


def _seed(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return ((a + b) * c.relu()).sum(dim=-1)


def _copy_of_seed() -> Any:  # a code object of its own: one Dynamo cache each
    return types.FunctionType(_seed.__code__.replace(), _seed.__globals__, "seed", None,
                              _seed.__closure__)


def _replays(runner: CudaGraphRunner) -> int:
    return sum(rec.graph.replays for rec in runner.direct.values())


def _refill(args: list[torch.Tensor]) -> list[torch.Tensor]:
    for a in args:
        a.copy_(torch.randn_like(a))  # fresh values, same addresses
    return args


def _doubled(call: Any) -> Any:
    """Kernels that write twice the graph's outputs: what 'the tuned kernels' compute
    here, so that a call shows which kernels ran."""
    def call2(args: list[Any]) -> tuple[Any, ...]:
        return tuple(o * 2 for o in call(args))

    return call2


@pytest.fixture
def cpu_captures(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU graphs get CUDA-graph runners whose captures run on CPU (``_CpuRunner``)."""
    monkeypatch.setattr(cudagraphs, "skip_reason", lambda device_type, inputs: None)
    monkeypatch.setattr(CudaGraphRunner, "_capture", cpu_capture)


def test_switch_after_recordings_replays_the_new_kernels(
        cpu_captures: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """``mode="reduce-overhead"`` end to end, the graph behind a ``SwappableGraph``: its
    input sets are replayed by the served entry alone (as many Python frames as Dynamo's
    floor); after a switch to other kernels every call computes with them (outputs against
    eager on fresh values), the old recordings never replay again, and the new runner
    records and is replayed in turn."""
    from kiln import KilnFallbackWarning

    made: list[SwappableGraph] = []

    class Noted(SwappableGraph):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(hotswap, "wants_swap", lambda *args: True)
    monkeypatch.setattr(hotswap, "SwappableGraph", Noted)
    torch._dynamo.reset()
    sets = [[torch.randn(8, 16) for _ in range(3)] for _ in range(2)]
    fn = torch.compile(_copy_of_seed(), backend="kiln", mode="reduce-overhead",
                       dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        for i in range(8):
            args = _refill(sets[i % 2])
            torch.testing.assert_close(fn(*args), _seed(*args))
    (graph,) = made
    old = graph.replayer
    # Replays: the first of each recording (calls 3 and 4, right after its capture), 5-8.
    assert old is graph.call and len(old.direct) == 2 and _replays(old) == 6
    ready = torch.compile(_copy_of_seed(), backend=_floor, dynamic=False)
    ready(*sets[0])
    floor_frames = _kiln_frames(ready, sets, 20)[0]
    launched = _launches_noted(old, "old")  # (a C call each, as a replay is)
    assert _kiln_frames(fn, sets, 20) == (floor_frames, ["replay_or_call"])
    assert launched == ["old"] * 20

    build = graph._build
    graph._build = lambda compiled, hook: _tuned_runner(build(compiled, hook))
    graph._install(graph.compiled)  # what a finished tuning does (on its thread)
    new = graph.replayer
    assert graph.swaps == 1 and new is graph.call and new is not old and not new.direct
    for i in range(8):
        args = _refill(sets[i % 2])
        torch.testing.assert_close(fn(*args), 2 * _seed(*args))
    assert launched == ["old"] * 20  # not one replay of the old kernels since the switch
    assert len(new.direct) == 2 and _replays(new) == 6 and new.calls == 8
    launched = _launches_noted(new, "new")
    assert _kiln_frames(fn, sets, 20) == (floor_frames, ["replay_or_call"])
    assert launched == ["new"] * 20


def _launches_noted(runner: CudaGraphRunner, name: str) -> list[str]:
    """Each recording's replay becomes a C call that notes ``name``."""
    launched: list[str] = []
    for rec in runner.direct.values():
        rec.launch = functools.partial(launched.append, name)
    return launched


def _floor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """Dynamo's floor: a backend whose graph returns outputs made once."""
    out = gm(*example_inputs)
    return lambda *args: out


def _tuned_runner(runner: CudaGraphRunner) -> CudaGraphRunner:
    runner.call = _doubled(runner.call)
    return runner


class _Tuner:
    """The client's tuner, as a SwappableGraph sees it: what it was asked to do."""

    def __init__(self) -> None:
        self.released: list[str] = []
        self.submitted: list[str] = []

    def release(self, key: str) -> None:
        self.released.append(key)

    def submit(self, key: str, tune: Any, publish: Any, label: str = "",
               local: bool = False) -> None:
        self.submitted.append(label)


class _Client:
    def __init__(self) -> None:
        self.tuner = _Tuner()
        self.counters = types.SimpleNamespace(add=lambda **counts: None)

    def on_tuned(self, key: str, listener: Any) -> None:
        pass

    def farm_serves(self) -> bool:  # no farm: buckets tune here
        return False

    def count_gpu_share(self) -> None:
        pass


class _Counted(SwappableGraph):
    """Counts the calls that reach the SwappableGraph (the slow path)."""

    slow = 0

    def __call__(self, args: list[Any]) -> Any:
        self.slow += 1
        return super().__call__(args)


def _bucket_graph(monkeypatch: pytest.MonkeyPatch, kernels: list[int]
                  ) -> tuple[_Counted, _Client]:
    """A SwappableGraph over CPU-captured runners whose calls launch a kernel in a size
    bucket not tuned yet (through the bucket hook, as a ``BucketedLauncher`` does);
    ``kernels[0]`` says which kernels a load gets (1: the graph's, 2: twice its input)."""
    monkeypatch.setenv(FAKE_AUTOTUNE_ENV, "1")  # (a process that can tune buckets)

    def build(compiled: Any, hook: Any) -> CudaGraphRunner:
        scale = kernels[0]

        def call(args: list[Any]) -> tuple[Any, ...]:
            if hook is not None:
                hook("triton_poi_0", f"bucket{scale}", [64], [16])
            return (args[0] * scale + 1,)

        return _CpuRunner(call, "swap0")

    client = _Client()
    request = types.SimpleNamespace(options={"autotune": True},
                                    target={"kind": "cuda", "arch": 90})
    graph = _Counted(build, types.SimpleNamespace(), client,  # type: ignore[arg-type]
                     types.SimpleNamespace(key="ab" * 32), request)  # type: ignore[arg-type]
    return graph, client


def test_first_call_and_bucket_tuning_keep_their_path(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """The first call goes through ``_first_call`` (the tuner is released once, after
    it); a bucket seen in a plain call is submitted for tuning right after that call;
    replays go around the whole slow path; after a switch the new runner's warm-up calls
    take the slow path again, see their own bucket, and submit it."""
    kernels = [1]
    graph, client = _bucket_graph(monkeypatch, kernels)
    entry = served_graph(graph, False)
    assert graph.replayer is None and entry is not graph
    sets = [torch.randn(16) for _ in range(2)]
    for i in range(8):
        x = _refill([sets[i % 2]])[0]
        torch.testing.assert_close(entry(x)[0], x + 1)
        if i == 0:
            assert client.tuner.released == ["ab" * 32] and graph.called
            assert client.tuner.submitted == ["bucket autotune"]
    runner = graph.replayer
    assert runner is graph.call and _replays(runner) == 6
    assert graph.slow == 4  # calls 1-2 warm up, 3-4 record; 5-8 replay in the entry
    assert client.tuner.released == ["ab" * 32] and len(client.tuner.submitted) == 1
    kernels[0] = 2
    graph._install(types.SimpleNamespace())  # type: ignore[arg-type]
    assert graph.replayer is not runner
    for i in range(8):
        x = _refill([sets[i % 2]])[0]
        torch.testing.assert_close(entry(x)[0], 2 * x + 1)
    assert graph.slow == 8 and _replays(runner) == 6 and _replays(graph.replayer) == 6
    assert client.tuner.submitted == ["bucket autotune"] * 2  # bucket2, after its call
    assert client.tuner.released == ["ab" * 32]


def test_graph_without_cuda_graphs_is_served_as_before(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """A SwappableGraph over a plain wrapper (no CUDA graphs): ``served`` gives the slow
    path itself, with no replay frame in front of it."""
    monkeypatch.setenv(FAKE_AUTOTUNE_ENV, "1")
    graph = SwappableGraph(lambda compiled, hook: (lambda args: (args[0] + 1,)),
                           types.SimpleNamespace(), _Client(),  # type: ignore[arg-type]
                           types.SimpleNamespace(key="cd" * 32),  # type: ignore[arg-type]
                           types.SimpleNamespace(options={"autotune": False}))  # type: ignore[arg-type]

    def slow(*inputs: Any) -> Any:
        return graph(list(inputs))

    assert graph.served(slow) is slow
    x = torch.randn(4)
    torch.testing.assert_close(served_graph(graph, False)(x)[0], x + 1)
    assert graph.called and graph.replayer is None
