"""CUDA graphs on the GPU: mode="reduce-overhead" records each graph and replays it,
forward and backward; results match eager on every call with fresh inputs; input sets
that come back are read in place with no copy; a moved parameter records again; scatter
kernels (embedding backward) match eager on the GPU."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from kiln.compiler.runtime import cudagraphs
from kiln.compiler.runtime.cudagraphs import CudaGraphRunner
from tests.models import mlp


def _runners(exclude: set[int] | None = None) -> list[CudaGraphRunner]:
    """The CUDA-graph runners alive now (those not in ``exclude``, by id)."""
    import gc

    # type(), not isinstance(): isinstance on a dead weakref proxy raises ReferenceError
    return [o for o in gc.get_objects() if type(o) is CudaGraphRunner
            and id(o) not in (exclude or set())]


@pytest.mark.gpu
def test_reduce_overhead_inference_replays_and_matches_eager() -> None:
    torch._dynamo.reset()
    before = {id(r) for r in _runners()}
    seed = lambda a, b, c: ((a + b) * c.relu()).sum(-1)  # noqa: E731
    fn = torch.compile(seed, backend="kiln", mode="reduce-overhead")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(6):
            args = [torch.randn(64, 128, device="cuda") for _ in range(3)]
            out = fn(*args).clone()
            torch.testing.assert_close(out, seed(*args), atol=1e-4, rtol=1e-4)
    (runner,) = _runners(before)
    # Fresh inputs each call: the copy recording, or, where the allocator gave the same
    # addresses back, recordings that read them in place.
    assert runner.recording is not None or runner.direct
    assert 1 <= runner.recordings + len(runner.direct) <= 2 + cudagraphs.MAX_DIRECT


@pytest.mark.gpu
def test_preallocated_input_sets_are_read_in_place_with_one_launch() -> None:
    """gpu_bench's loop: four input sets in turn, refilled in place. Each set gets its own
    recording that reads it where it is: a call is one graph launch, one kernel, no
    copy; every output matches eager on the values of that call."""
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    before = {id(r) for r in _runners()}
    seed = lambda a, b, c: ((a + b) * c.relu()).sum(-1)  # noqa: E731
    fn = torch.compile(seed, backend="kiln", mode="reduce-overhead", dynamic=False)
    sets = [[torch.randn(64, 128, device="cuda") for _ in range(3)] for _ in range(4)]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        for call in range(16):
            args = sets[call % 4]
            for a in args:
                a.normal_()
            torch.testing.assert_close(fn(*args), seed(*args), atol=1e-4, rtol=1e-4)
        (runner,) = _runners(before)
        assert len(runner.direct) == 4 and runner.recordings <= 1
        torch.cuda.synchronize()
        # torch's profiler warns on entry about its own event cycles: not Kiln's warning.
        warnings.filterwarnings("ignore", message=".*Profiler clears events", category=UserWarning)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for call in range(8):
                fn(*sets[call % 4])
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events()
               if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == 8, kernels  # one kernel a call: no copy kernel


@pytest.mark.gpu
def test_reduce_overhead_training_steps_match_eager() -> None:
    torch.manual_seed(0)
    torch._dynamo.reset()
    before = {id(r) for r in _runners()}
    model = mlp().cuda()
    ref = mlp().cuda()
    ref.load_state_dict(model.state_dict())
    step = torch.compile(lambda x: model(x).square().mean(), backend="kiln",
                         mode="reduce-overhead")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(5):
            x = torch.randn(64, 32, device="cuda")
            model.zero_grad()
            ref.zero_grad()
            loss = step(x)
            loss.backward()
            want = ref(x).square().mean()
            want.backward()
            torch.testing.assert_close(loss, want, atol=1e-4, rtol=1e-3)
            for (n, p), q in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(p.grad, q.grad, atol=1e-4, rtol=1e-3, msg=n)
    recorded = [r for r in _runners(before) if r.recording is not None or r.direct]
    assert len(recorded) >= 2  # forward and backward
    # The backward reads the forward's saved tensors in place once they settle (they come
    # from a recording's pool: their addresses repeat).
    assert any(r.direct or any(r.static) for r in recorded)


@pytest.mark.gpu
def test_moved_parameter_records_again() -> None:
    torch._dynamo.reset()
    lin = nn.Linear(32, 32).cuda()
    fn = torch.compile(lambda x: lin(x).relu(), backend="kiln", mode="reduce-overhead")
    x = torch.randn(8, 32, device="cuda")
    with torch.no_grad():
        for _ in range(4):
            fn(x)
        lin.weight.data = torch.randn(32, 32, device="cuda")  # a new tensor: new address
        out = fn(x).clone()
    torch.testing.assert_close(out, torch.relu(x @ lin.weight.t() + lin.bias))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embedding_backward_scatter_on_gpu(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    torch._dynamo.reset()
    emb = nn.Embedding(30000, 512).cuda().to(dtype)
    ids = torch.randint(0, 30000, (8, 256), device="cuda")
    ids[:, :64] = 7  # many repeats of one row: contended atomics
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = torch.compile(lambda i: emb(i).float().square().sum(), backend="kiln")(ids)
        loss.backward()
    got = emb.weight.grad.clone()
    emb.weight.grad = None
    emb(ids).float().square().sum().backward()
    tol = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.5,
                                                                        "rtol": 2e-2}
    torch.testing.assert_close(got, emb.weight.grad, **tol)


@pytest.mark.gpu
def test_switch_of_kernels_after_recordings_is_replayed_from_the_next_call(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A graph behind a ``SwappableGraph`` (as gpu_bench's are while their autotuning is
    pending; forced here, with autotuning off so that no tuning switches it meanwhile):
    its input sets replay from the served entry with no Python call of the wrapper; after
    a switch of kernels every call computes with the new ones (twice the graph's outputs,
    a stand-in that shows which kernels ran), never a replay of the old recordings; the
    new runner records each set again and then replays it with no wrapper call either."""
    from kiln.frontend.core import hotswap

    made: list[hotswap.SwappableGraph] = []

    class Noted(hotswap.SwappableGraph):
        def __init__(self, *args: object, **kwargs: object) -> None:
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]
            made.append(self)

    monkeypatch.setattr(hotswap, "wants_swap", lambda *args: True)
    monkeypatch.setattr(hotswap, "SwappableGraph", Noted)
    torch._dynamo.reset()
    seed = lambda a, b, c: ((a + b) * c.relu()).sum(-1)  # noqa: E731
    fn = torch.compile(seed, backend="kiln", dynamic=False,
                       options={"cudagraphs": True, "autotune": False})
    sets = [[torch.randn(64, 128, device="cuda") for _ in range(3)] for _ in range(4)]
    wrapper_calls: list[int] = []

    def calls(scale: int, count: int) -> None:
        for call in range(count):
            args = sets[call % 4]
            for a in args:
                a.normal_()
            torch.testing.assert_close(fn(*args), scale * seed(*args), atol=1e-4,
                                       rtol=1e-4)

    def tuned(compiled: object, hook: object) -> CudaGraphRunner:
        runner = build(compiled, hook)
        inner = runner.call

        def doubled(args: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
            wrapper_calls.append(2)
            return tuple(o * 2 for o in inner(args))

        runner.call = doubled
        return runner

    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        calls(1, 12)
        (graph,) = made
        old = graph.replayer
        assert old is not None and old is graph.call and len(old.direct) == 4
        build = graph._build
        graph._build = tuned  # type: ignore[method-assign,assignment]
        graph._install(graph.compiled)  # what a finished tuning does (on its thread)
        assert graph.replayer is graph.call and graph.replayer is not old
        calls(2, 12)
        new = graph.replayer
        assert new is not None and new is not old and len(new.direct) == 4
        recorded = len(wrapper_calls)  # warm-up calls and captures
        calls(2, 8)
    assert len(wrapper_calls) == recorded  # replays only
