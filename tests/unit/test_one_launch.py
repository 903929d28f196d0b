"""A reduce-overhead graph whose recording holds one kernel launch is served by launching
that kernel (``compiler.runtime.one_launch``), on CPU with captures stood in
(``tests.cudagraph_stand_in``) and Kiln's C++ kernels as the one launch: chosen only for
one launch and nothing else, outputs against eager at any input address, misaligned
inputs and other graphs on the replay path, a static kernel launched through its
launcher's C entry, a hot swap that never launches the replaced kernel. (Triton kernels
under the interpreter: tests/triton_interp/test_one_launch_interp.py.)"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

from kiln.compiler.compiled_graph import load
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.runtime import cudagraphs
from kiln.compiler.runtime.cudagraphs import CudaGraphRunner
from kiln.compiler.runtime.kernel_files import interpreter_active
from kiln.compiler.runtime.one_launch import (
    WRAPPER_FILE,
    OneLaunch,
    aligned,
    one_launch,
    watched_call,
)
from kiln.compiler.runtime.static_launcher import StaticCudaKernel
from kiln.compiler.runtime.triton_launcher import launch_grid
from kiln.frontend import hotswap
from kiln.frontend.hotswap import SwappableGraph
from tests.cudagraph_stand_in import cpu_capture
from tests.unit.test_cudagraphs import _CpuRunner, _kiln_frames

pytestmark = pytest.mark.filterwarnings("error::kiln.KilnFallbackWarning")


def _seed(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return ((a + b) * c.relu()).sum(dim=-1)


def _copy_of_seed() -> Any:  # a code object of its own: one Dynamo cache each
    return types.FunctionType(_seed.__code__.replace(), _seed.__globals__, "seed", None,
                              _seed.__closure__)


def _floor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    out = gm(*example_inputs)
    return lambda *args: out


@pytest.fixture
def captures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """CPU graphs get CUDA-graph runners whose captures run on CPU; the runners made."""
    runners: list[Any] = []

    def capture(runner: CudaGraphRunner, graph_inputs: list[Any]) -> Any:
        runners.append(runner)
        return cpu_capture(runner, graph_inputs)

    monkeypatch.setattr(cudagraphs, "skip_reason", lambda device_type, inputs: None)
    monkeypatch.setattr(CudaGraphRunner, "_capture", capture)
    return runners


def _counted(one: OneLaunch) -> tuple[OneLaunch, list[None]]:
    """``one`` with its launch a C no-op and its stream query a C call that notes it (no
    Python frame, as torch's launcher's entry and the stream query are); one entry per
    launch."""
    launches: list[None] = []
    return dataclasses.replace(one, launch=slice,
                               stream=functools.partial(launches.append, None)), launches


def _compiled_seed() -> Any:
    torch._dynamo.reset()
    return torch.compile(_copy_of_seed(), backend="kiln", mode="reduce-overhead",
                         dynamic=False)


def test_one_kernel_graph_is_launched_at_any_address_with_the_floors_frames(
        captures: list[Any]) -> None:
    """The seed (one kernel): recorded once (call 3), then every call launches the kernel
    over the caller's inputs, wherever they are (fresh tensors each call), writing the
    recording's outputs (the same tensors each call); no replay after the first. Kiln
    adds one frame, the served entry, and no more frames than Dynamo's floor has."""
    fn = _compiled_seed()
    sets = [[torch.randn(8, 16) for _ in range(3)] for _ in range(2)]
    for i in range(12):  # two sets (warm-up, recording), then fresh tensors each call
        args = sets[i % 2] if i < 4 else [torch.randn(8, 16) for _ in range(3)]
        torch.testing.assert_close(fn(*args), _seed(*args))
    (runner,) = {id(r): r for r in captures}.values()
    (rec,) = runner.direct.values()
    assert isinstance(rec.one, OneLaunch) and runner.one_launch is rec.one
    assert rec.graph.replays == 1 and runner.calls == 12  # its first replay, at capture
    assert rec.one.kernel.startswith("cpp_fused") and rec.one.pick is None
    assert fn(*args) is fn(*[torch.randn(8, 16) for _ in range(3)])  # the static outputs
    sets = [[torch.randn(8, 16) for _ in range(3)] for _ in range(4)]
    floor = torch.compile(_copy_of_seed(), backend=_floor, dynamic=False)
    floor(*sets[0])
    runner.one_launch, launches = _counted(runner.one_launch)
    assert _kiln_frames(fn, sets, 40) == (_kiln_frames(floor, sets, 40)[0],
                                          ["replay_or_call"])
    assert len(launches) == 40 and rec.graph.replays == 1


def test_misaligned_inputs_take_the_recorded_path(captures: list[Any]) -> None:
    fn = _compiled_seed()
    sets = [[torch.randn(8, 16) for _ in range(3)] for _ in range(2)]
    for i in range(4):
        fn(*sets[i % 2])
    (runner,) = {id(r): r for r in captures}.values()
    runner.one_launch, launches = _counted(runner.one_launch)
    odd = [torch.randn(8 * 16 + 1)[1:].view(8, 16) for _ in range(3)]
    assert not aligned([x.data_ptr() for x in odd]) and aligned([x.data_ptr() for x in sets[0]])
    for _ in range(3):
        for x in odd:
            x.copy_(torch.randn(8, 16))
        torch.testing.assert_close(fn(*odd), _seed(*odd))
    assert not launches and runner.recordings == 1  # the copy recording, replayed


def _cpu_call(fn: Callable[..., Any], *shapes: tuple[int, ...]) -> Callable[..., Any]:
    args = [torch.randn(s) for s in shapes]
    return load(compile_graph(trace_aten(fn, args), args, {}, name="g"))


@pytest.mark.parametrize("case", ["two kernels", "library call", "not a wrapper"])
def test_other_graphs_replay(captures: list[Any], case: str) -> None:
    """A recording of two launches, of a library call and a kernel, or of a callable that
    is not a Kiln wrapper is replayed, never launched; outputs match eager."""
    fns: dict[str, tuple[Callable[..., Any], tuple[tuple[int, ...], ...], str]] = {
        "two kernels": (lambda x: (x.softmax(-1), x.sum(0)), ((8, 16),),
                        "it launches 2 kernels"),
        "library call": (lambda a, b: ((a @ b).relu(),), ((8, 16), (16, 4)),
                         "it runs aten::mm"),
        "not a wrapper": (lambda x: (x + 1,), ((8, 16),), "it is not a Kiln wrapper's call"),
    }
    fn, shapes, reason = fns[case]
    call = _cpu_call(fn, *shapes) if case != "not a wrapper" else \
        (lambda args: fn(*args))
    runner = _CpuRunner(call, "g")
    sets = [[torch.randn(s) for s in shapes] for _ in range(2)]
    for i in range(8):
        args = sets[i % 2]
        for x in args:
            x.copy_(torch.randn_like(x))
        for got, want in zip(runner(list(args)), fn(*args)):
            torch.testing.assert_close(got, want)
    assert runner.one_launch is None and len(runner.direct) == 2
    assert {rec.one for rec in runner.direct.values()} == {reason}
    assert sorted(rec.graph.replays for rec in runner.direct.values()) == [3, 3]


def test_one_launch_declines_what_it_cannot_serve() -> None:
    kernel = types.SimpleNamespace(run=lambda *args: None, name="k")
    x, y = torch.randn(4), torch.randn(4)
    out = torch.empty(4)
    assert isinstance(one_launch(kernel, (x, y, out), [x, y], (out,)), OneLaunch)
    assert one_launch(kernel, (x, torch.empty(4), out), [x], (out,)) == \
        "argument 1 of kernel k is a buffer of its own"
    assert one_launch(kernel, (x, x[:2]), [x], (x[:2],)) == \
        "an output shares storage with an input"
    assert one_launch(kernel, (x, out), [x, x], (out,)) == "an input is passed twice"
    assert one_launch(kernel, (x, 3, out), [x], (out, 2)) == \
        "an input or output is not a tensor"
    constant = torch.randn(4)
    served = one_launch(kernel, (out, constant, y, x), [x, y], (out[:2],), [constant])
    assert isinstance(served, OneLaunch) and served.pick is not None
    assert not served.by_address and served.arguments((x, y), (1, 2)) == (out, constant, y, x)


class _Launcher:
    """Stands in for ``torch._C._StaticCudaLauncher``: notes each load and launch."""

    def __init__(self) -> None:
        self.launches: list[tuple[Any, ...]] = []

    def _load_kernel(self, path: str, name: str, shared: int, device: int) -> tuple[Any, ...]:
        return ("module", "function", 32, 0)

    def _launch_kernel(self, *args: Any) -> None:
        self.launches.append(args)


@pytest.mark.skipif(interpreter_active(), reason="Triton was imported for its interpreter")
def test_a_static_kernel_is_launched_through_the_launchers_entry(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed's wrapper generated for CUDA (its kernel cross-compiled for sm_90, run
    over CPU tensors with torch's launcher stood in): its one launch is bound to the
    launcher's entry with the kernel's function, grid, warps, shared memory, argument
    codes and scratch slots; each call passes only the arguments, as addresses (the
    inputs' taken once per call; given a tensor, the launcher would ask the driver about
    its address at every launch), and the kernel's stream."""
    from tests.targets import SM90
    from tests.unit.test_cubin import fake_cuda

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    shapes = [torch.randn(64, 128) for _ in range(3)]
    compiled = compile_graph(trace_aten(_seed, fake_cuda(shapes)), fake_cuda(shapes), {},
                             name="g", target=SM90)
    (spec,) = compiled.kernels
    binary = compiled.binaries[spec.name]
    impl, streams = _Launcher(), itertools.count(7)
    kernel = StaticCudaKernel(spec, binary, launch_grid(spec, binary.config), impl=impl,
                              stream=streams.__next__, device=0)
    namespace: dict[str, Any] = {"DEVICE": torch.device("cpu"), spec.name: kernel}
    exec(compile(compiled.wrapper_source, f"{WRAPPER_FILE} g>", "exec"), namespace)
    inputs = [torch.randn(64, 128) for _ in range(3)]
    outputs, served = watched_call(namespace["call"], inputs)
    assert isinstance(served, OneLaunch) and served.by_address and served.pick is None
    (out,) = outputs
    assert served.keep == (out,) and served.kernel == spec.name
    fresh = [torch.randn(64, 128) for _ in range(3)]
    at = tuple(x.data_ptr() for x in fresh)
    assert served.serves(at) and not served.serves((*at[:2], out.data_ptr()))
    assert served(fresh, at) is outputs
    first, again = impl.launches  # the watched call's launch (tensors), then the served
    assert again[:7] == first[:7] == ("function", *kernel.grid, kernel.num_warps,
                                      kernel.shared, kernel.arg_tys)
    assert again[7] == (*at, out.data_ptr(), *kernel.scratch) and again[8] == 8
    assert first[7][:4] == (*inputs, out) and first[8] == 7


class _Doubling:
    """A kernel that writes twice what ``kernel`` writes to its last argument: what 'the
    tuned kernels' compute here."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.name = kernel, "doubling"

    def run(self, *args: Any) -> None:
        self.kernel.run(*args)
        args[-1].mul_(2)  # (a launcher's own ops are not the wrapper's: still one launch)


def test_a_swap_launches_the_new_kernel_never_the_old(
        captures: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Behind a ``SwappableGraph`` (a graph whose tuned kernels swap in): the first
    runner's one launch serves calls until the switch; from the next call on, the new
    runner warms up, records and then launches its own kernel (outputs twice eager's),
    and the replaced kernel is never launched again."""
    made: list[SwappableGraph] = []

    class Noted(SwappableGraph):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(hotswap, "wants_swap", lambda *args: True)
    monkeypatch.setattr(hotswap, "SwappableGraph", Noted)
    fn = _compiled_seed()
    sets = [[torch.randn(8, 16) for _ in range(3)] for _ in range(2)]
    for i in range(6):
        torch.testing.assert_close(fn(*sets[i % 2]), _seed(*sets[i % 2]))
    (graph,) = made
    old = graph.replayer
    assert old is not None and old.one_launch is not None
    old.one_launch, old_launches = _counted(old.one_launch)
    fn(*sets[0])
    assert len(old_launches) == 1
    build = graph._build

    def tuned(compiled: Any, hook: Any) -> Any:
        runner = build(compiled, hook)
        names = [n for n in runner.call.__globals__ if n.startswith("cpp_fused")]
        (name,) = names
        runner.call.__globals__[name] = _Doubling(runner.call.__globals__[name])
        return runner

    graph._build = tuned
    graph._install(graph.compiled)
    new = graph.replayer
    assert new is not old and new.one_launch is None
    for _ in range(8):
        args = [torch.randn(8, 16) for _ in range(3)]
        torch.testing.assert_close(fn(*args), 2 * _seed(*args))
    assert len(old_launches) == 1  # not one launch of the old kernel since the switch
    assert new.one_launch is not None
    assert new.one_launch.kernel == "doubling"


def test_a_launch_that_cannot_be_bound_leaves_the_replay(
        captures: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault while binding the one launch (here: the launcher's entry refuses) is a
    reason on the recording, not a failed capture: the graph replays, outputs match."""
    from kiln.compiler.runtime import one_launch as module

    def refuses(kernel: Any) -> Any:
        raise RuntimeError("no launcher entry")

    monkeypatch.setattr(module, "_launcher", refuses)
    fn = _compiled_seed()
    sets = [[torch.randn(8, 16) for _ in range(3)] for _ in range(2)]
    for i in range(8):
        torch.testing.assert_close(fn(*sets[i % 2]), _seed(*sets[i % 2]))
    (runner,) = {id(r): r for r in captures}.values()
    assert runner.one_launch is None and runner.plain_reason is None
    assert {rec.one for rec in runner.direct.values()} == {
        "its launch could not be bound (RuntimeError: no launcher entry)"}
    assert sorted(rec.graph.replays for rec in runner.direct.values()) == [3, 3]


def _transposed(x: torch.Tensor) -> torch.Tensor:
    return (x.t() * 2).contiguous()


def test_an_input_in_the_outputs_memory_is_not_launched(captures: list[Any]) -> None:
    """``y = f(y)``: a call fed the previous call's output would have the kernel read what
    it writes (a transpose in place mixes old and new values); such calls take the
    runner's other paths, through Dynamo's entry and the runner's own call alike, and
    match eager each time; fresh inputs are still launched."""
    torch._dynamo.reset()
    fn = torch.compile(_transposed, backend="kiln", mode="reduce-overhead", dynamic=False)
    sets = [[torch.randn(16, 16)] for _ in range(2)]
    for i in range(4):
        torch.testing.assert_close(fn(*sets[i % 2]), _transposed(*sets[i % 2]))
    (runner,) = {id(r): r for r in captures}.values()
    one = runner.one_launch
    assert one is not None
    launched: list[int] = []

    def launch(args: tuple[Any, ...], stream: Any) -> None:
        launched.append(1)
        one.launch(args, stream)

    runner.one_launch = dataclasses.replace(one, launch=launch)
    y, fed_back = torch.randn(16, 16), 0
    for step in range(8):  # (the other paths answer in a recording's own outputs: the
        # next call, fed those, is launched again)
        own = y.data_ptr() == one.outputs[0].data_ptr()
        fed_back += own
        want, before = _transposed(y.clone()), len(launched)
        y = fn(y) if step % 2 else runner([y])[0]
        torch.testing.assert_close(y, want)
        assert len(launched) == before + (not own)
    assert fed_back >= 3
    # What the check prevents: the kernel launched over its own output.
    y = one.outputs[0]
    want = _transposed(y.clone())
    one([y], (y.data_ptr(),))
    assert not torch.allclose(y, want)
