"""The first call's warm-up (``frontend.core.warmup``, ``frontend.core.overlap``) and its spans
(``frontend.core.first_call``, the static launcher's ``load cubin``).

No GPU here: plans are read from ATen graphs traced on fake CUDA tensors; the warm-up's
calls run on CPU through ``run_on`` (``run`` itself never warms a CPU graph); the client
is a real one compiling real CPU graphs, checked against eager."""

from __future__ import annotations

import logging
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from kiln.compiler import trace
from kiln.frontend.core.first_call import FirstCallSpan, traced_first_call
from kiln.frontend.core.overlap import overlap
from kiln.frontend.core.warmup import ScratchTensor, WarmCall, Warmup, plan, run, run_on
from kiln.frontend.cross.cuda_guard_shim import ensure_fake_cuda_guard

aten = torch.ops.aten
HALF = torch.float16


@pytest.fixture
def fake() -> Iterator[FakeTensorMode]:
    ensure_fake_cuda_guard()
    yield FakeTensorMode()


def attention_graph(mode: FakeTensorMode, dropout: float = 0.0) -> torch.fx.GraphModule:
    """Two identical cuDNN attention calls (q, k, v: [b, h, s, d] views of [b, s, h, d]),
    a linear layer (addmm), a matmul and pointwise ops, as AOTAutograd would hand them."""
    def f(q: Any, k: Any, v: Any, x: Any, w: Any, b: Any) -> Any:
        y = torch.relu(aten.addmm(b, x, w))  # before the attention in graph order
        o1 = aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, dropout, True)[0]
        o2 = aten._scaled_dot_product_cudnn_attention(q, k, v, None, False, dropout, True)[0]
        return o1 + o2, y, aten.mm(x, w)

    with mode:
        q, k, v = (torch.empty(2, 16, 4, 64, dtype=HALF, device="cuda").transpose(1, 2)
                   for _ in range(3))
        x = torch.empty(8, 32, dtype=HALF, device="cuda")
        w = torch.empty(32, 16, dtype=HALF, device="cuda")
        b = torch.empty(16, dtype=HALF, device="cuda")
        return make_fx(f)(q, k, v, x, w, b)


def test_plan_lists_each_library_call_once_with_the_graphs_exact_arguments(
        fake: FakeTensorMode) -> None:
    calls = plan(attention_graph(fake))  # attention first: the costliest to warm
    assert [c.name for c in calls] == ["_scaled_dot_product_cudnn_attention", "addmm",
                                       "mm"]
    sdpa, addmm, mm = calls
    qkv = ScratchTensor((2, 4, 16, 64), (4096, 64, 256, 1), HALF)  # the transposed views
    assert sdpa.args == (qkv, qkv, qkv, None, False, 0.0, True) and not sdpa.random
    assert addmm.args == (ScratchTensor((16,), (1,), HALF), ScratchTensor((8, 32), (32, 1), HALF),
                          ScratchTensor((32, 16), (16, 1), HALF))
    assert mm.args == addmm.args[1:]
    assert sum(t.nbytes for t in sdpa.scratch()) == 3 * 2 * 16 * 4 * 64 * 2


def test_no_warm_up_for_cpu_graphs_when_off_or_with_no_library_call(
        fake: FakeTensorMode) -> None:
    gm = attention_graph(fake)
    assert Warmup.for_graph(gm, torch.device("cpu")) is None
    assert Warmup.for_graph(gm, torch.device("cuda", 0), enabled=False) is None
    warm = Warmup.for_graph(gm, torch.device("cuda", 0))
    assert warm is not None and len(warm.left) == 3
    with fake:
        plain = make_fx(lambda a: torch.relu(a) * 2)(torch.empty(4, device="cuda"))
    assert Warmup.for_graph(plain, torch.device("cuda", 0)) is None
    seen: list[Any] = []
    cpu_call = WarmCall(lambda *a: seen.append(a), (ScratchTensor((2,), (1,), HALF),), ())
    assert run([cpu_call], torch.device("cpu")) == 0 and seen == []


def test_symbolic_sizes_and_calls_over_the_memory_bound_are_not_warmed(
        fake: FakeTensorMode) -> None:
    gm = make_fx(lambda a, b: aten.mm(a, b), tracing_mode="symbolic")(
        torch.randn(4, 8), torch.randn(8, 3))
    assert plan(gm) == []
    with fake:  # 64 MiB of inputs, 1 GiB of output: over the bound
        a = torch.empty(16384, 1024, dtype=HALF, device="cuda")
        b = torch.empty(1024, 32768, dtype=HALF, device="cuda")
        big = make_fx(lambda x, y: (aten.mm(x, y), aten.mm(y.t(), x.t()[:, :8])))(a, b)
    small, = plan(big)
    assert small.args[0].shape == (32768, 1024)  # the (32768 x 8) one only


class Recorder:
    """An op that records what it was called with (and may fail)."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.fail = fail
        self.__name__ = "recorder.default"

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls.append(args)
        if self.fail:
            raise RuntimeError("CUDNN_STATUS_NOT_SUPPORTED")
        return args[0] * 2


def test_calls_run_once_on_random_scratch_tensors_of_the_planned_layout() -> None:
    op = Recorder()
    layout = ScratchTensor((2, 4, 16, 8), (512, 8, 32, 1), torch.float32)
    before = torch.get_rng_state()
    assert run_on([WarmCall(op, (layout, (layout, 3), 0.5, True), ())],
                  torch.device("cpu")) == 1
    assert torch.equal(torch.get_rng_state(), before)  # a private generator
    (t, (t2, three), half, flag), = op.calls
    for x in (t, t2):
        assert tuple(x.shape) == layout.shape and tuple(x.stride()) == layout.stride
        assert x.dtype == torch.float32 and x.std() > 0.5 and not torch.equal(x, t2 * 0)
    assert (three, half, flag) == (3, 0.5, True)
    bias = ScratchTensor((4, 2, 16, 16), (0, 0, 16, 1), torch.float32)  # broadcast
    assert run_on([WarmCall(op, (bias,), ())], torch.device("cpu")) == 1
    assert op.calls[-1][0].stride() == (0, 0, 16, 1) and op.calls[-1][0].std() > 0.5


def test_calls_made_inside_a_compiles_fake_mode_use_real_tensors(
        fake: FakeTensorMode) -> None:
    """Beside a farm's compile the warm-up runs on the client's thread, inside Dynamo's
    fake mode: its scratch tensors and calls must be real all the same."""
    op = Recorder()
    with fake:
        assert run_on([WarmCall(op, (ScratchTensor((64,), (1,), torch.float32),), ())],
                      torch.device("cpu")) == 1
    (t,), = op.calls
    assert type(t) is torch.Tensor and t.std() > 0.5


def test_a_failing_call_is_logged_and_the_others_still_run(
        caplog: pytest.LogCaptureFixture) -> None:
    bad, good = Recorder(fail=True), Recorder()
    layout = (ScratchTensor((3,), (1,), torch.float32),)
    with caplog.at_level(logging.INFO, logger="kiln.warmup"), trace.capture() as events:
        ran = run_on([WarmCall(bad, layout, ()), WarmCall(good, layout, ())],
                     torch.device("cpu"))
    assert ran == 1 and len(bad.calls) == len(good.calls) == 1
    assert [e["args"].get("error") for e in events] == [
        "RuntimeError: CUDNN_STATUS_NOT_SUPPORTED", None]  # the failure on the timeline
    assert "first-call warm-up of recorder failed (RuntimeError: " \
           "CUDNN_STATUS_NOT_SUPPORTED); ignored" in caplog.text


def test_dropout_runs_only_where_allowed_and_restores_the_random_state(
        fake: FakeTensorMode) -> None:
    sdpa, = (c for c in plan(attention_graph(fake, dropout=0.1)) if c.random)
    with fake:  # flash attention takes dropout_p third, after q, k, v
        q = torch.empty(2, 4, 16, 64, dtype=HALF, device="cuda")
        flash = make_fx(lambda t: aten._scaled_dot_product_flash_attention(
            t, t, t, 0.2, True)[0])(q)
    assert [c.random for c in plan(flash)] == [True]
    op = Recorder()
    call = WarmCall(op, (ScratchTensor((4,), (1,), torch.float32),) * 3 + sdpa.args[3:], ())
    assert call.random is False  # the recorder is not an op that draws
    drawing = _drawing_call(sdpa)
    assert run_on([drawing], torch.device("cpu")) == 0  # skipped: may not draw
    before = torch.get_rng_state()
    assert run_on([drawing], torch.device("cpu"), may_draw=True) == 1
    assert torch.equal(torch.get_rng_state(), before)


def _drawing_call(sdpa: WarmCall) -> WarmCall:
    """A CPU stand-in for the dropout attention call: draws from torch's generator."""
    class Draws(WarmCall):
        @property
        def random(self) -> bool:
            return True
    return Draws(lambda *a: torch.rand(8), sdpa.args, ())


def test_a_warm_up_resumes_where_it_stopped_and_runs_each_call_once() -> None:
    """A farm wait that ends early (the farm is not up) stops the warm-up; the local
    compile after it resumes with the calls left."""
    stop = threading.Event()
    ops = [Recorder() for _ in range(3)]
    layout = (ScratchTensor((2,), (1,), torch.float32),)

    def first(*args: Any) -> torch.Tensor:
        stop.set()  # the wait ended while this call ran
        return args[0]

    calls = [WarmCall(first, layout, ())] + [WarmCall(op, layout, ()) for op in ops[1:]]
    warm = Warmup(calls, torch.device("cpu"))  # ``for_graph`` makes CUDA ones only
    warm(stop)
    assert warm.ran == 1 and [len(op.calls) for op in ops[1:]] == [0, 0]
    warm(threading.Event())
    warm(threading.Event())
    assert warm.ran == 3 and [len(op.calls) for op in ops[1:]] == [1, 1]


@pytest.mark.parametrize("warm_here", [True, False])
def test_overlap_runs_both_at_once_and_returns_the_works_result(warm_here: bool) -> None:
    """Each side waits for the other to start: both see the other only if they really
    run at the same time (one after the other, the first would time out)."""
    started_work, started_warm = threading.Event(), threading.Event()
    threads: dict[str, int] = {}
    saw: dict[str, bool] = {}

    def work() -> str:
        threads["work"] = threading.get_ident()
        started_work.set()
        saw["work"] = started_warm.wait(10)
        return "compiled"

    def warm(stop: threading.Event) -> None:
        threads["warm"] = threading.get_ident()
        started_warm.set()
        saw["warm"] = started_work.wait(10)

    assert overlap(work, warm, warm_here=warm_here) == "compiled"
    assert saw == {"work": True, "warm": True}
    here = threading.get_ident()
    assert (threads["warm"] == here) is warm_here
    assert (threads["work"] == here) is not warm_here


def test_overlap_stops_the_warm_up_when_the_work_ends_raises_its_error_hides_its_own(
        caplog: pytest.LogCaptureFixture) -> None:
    stopped: list[bool] = []

    def failing_work() -> None:
        raise ConnectionError("farm gone")

    def warm(stop: threading.Event) -> None:
        stopped.append(stop.wait(10))

    with pytest.raises(ConnectionError, match="farm gone"):
        overlap(failing_work, warm, warm_here=True)
    assert stopped == [True]
    # A compile that ends first stops the warm-up too (the first call pays the rest).
    assert overlap(lambda: "done", warm, warm_here=True) == "done"
    assert overlap(lambda: "done", warm, warm_here=False) == "done"
    assert stopped == [True, True, True]

    def broken_warm(stop: threading.Event) -> None:
        raise MemoryError("scratch")

    def interrupted(stop: threading.Event) -> None:
        raise KeyboardInterrupt

    release = threading.Event()
    with pytest.raises(KeyboardInterrupt):  # not kept waiting for the work's end
        overlap(lambda: release.wait(30), interrupted, warm_here=True)
    release.set()
    with caplog.at_level(logging.INFO, logger="kiln.warmup"):
        assert overlap(lambda: 7, broken_warm, warm_here=False) == 7
    assert "first-call warm-up failed (MemoryError: scratch); ignored" in caplog.text
    assert overlap(lambda: 8, None, warm_here=True) == 8


def test_the_first_call_span_holds_a_span_per_library_call() -> None:
    x, w, b = torch.randn(8, 32), torch.randn(32, 16), torch.randn(16)

    def wrapper(args: list[Any]) -> tuple[torch.Tensor, ...]:
        a, m, c = args
        buf = torch.empty(8, 16)
        torch.mm(a, m, out=buf)  # as generated wrappers call the library
        return (torch.addmm(c, a, m).relu() + buf,)

    expected = wrapper([x, w, b])
    wrapper.served = "runner"  # type: ignore[attr-defined]
    assert FirstCallSpan(wrapper, "k").served == "runner"  # attributes pass through
    with trace.capture() as events:
        graph = FirstCallSpan(wrapper, "k" * 64)
        out = graph([x, w, b])
        again = graph([x, w, b])
    torch.testing.assert_close(out[0], expected[0])
    torch.testing.assert_close(again[0], expected[0])
    names = [e["name"] for e in events]
    assert names.count("first call of a graph") == 1
    assert sorted(n for n in names if n.startswith("first ") and n != "first call of a graph"
                  ) == ["first addmm", "first mm.out"]
    outer = next(e for e in events if e["name"] == "first call of a graph")
    for e in events:
        assert outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + 1
    mm = next(e for e in events if e["name"] == "first mm.out")
    assert mm["args"]["shapes"][:2] == ["(8, 32):float32", "(32, 16):float32"]
    with trace.capture(False) as none:
        assert traced_first_call(wrapper, [x, w, b], "k")[0].shape == (8, 16)
    assert none == []


def test_cubin_loads_show_on_the_timeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    from kiln.compiler.runtime.kernel_files import interpreter_active

    if interpreter_active():
        pytest.skip("Triton was imported for its interpreter")
    from kiln.compiler.runtime.static_launcher import StaticCudaKernel
    from kiln.compiler.runtime.triton_launcher import launch_grid
    from tests.unit.test_static_launcher import RecordingLauncher
    from tests.unit.test_static_launcher import softmax_graph as make_graph

    graph = make_graph.__wrapped__(tmp_path, monkeypatch)  # type: ignore[attr-defined]
    spec = graph.kernels[0]
    binary = graph.binaries[spec.name]
    kernel = StaticCudaKernel(spec, binary, launch_grid(spec, binary.config),
                              impl=RecordingLauncher(), stream=lambda: 0, device=0)
    with trace.capture() as events:
        kernel.run(*[object() for t in spec.signature.values() if t.startswith("*")])
    load, = (e for e in events if e["name"] == "load cubin")
    assert load["args"]["kernel"] == spec.name and load["args"]["bytes"] == len(binary.binary)


def test_a_compile_through_the_client_runs_the_warm_up_beside_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real client compiling a CPU graph here: the warm-up given runs once, on a
    helper thread, during the compile; a hit runs none; outputs match eager."""
    from kiln.frontend.core import compile as kiln_compile
    from kiln.frontend.core.client import reset_clients
    from kiln.frontend.core.fallback import KilnFallbackWarning

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    monkeypatch.setenv("KILN_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("KILN_FARM_FILE", str(tmp_path / "none.json"))
    reset_clients()
    warmed: list[int] = []

    def fake_for_graph(gm: Any, device: torch.device, enabled: bool = True) -> Any:
        assert device.type == "cpu" and enabled  # the setting's default
        return lambda stop: warmed.append(threading.get_ident())

    monkeypatch.setattr(kiln_compile.Warmup, "for_graph", staticmethod(fake_for_graph))
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.GELU())
    x = torch.randn(4, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        for _ in range(2):  # the second: a hit, after a reset
            torch._dynamo.reset()
            out = torch.compile(model, backend="kiln")(x)
            torch.testing.assert_close(out, model(x), rtol=1e-5, atol=1e-5)
    assert len(warmed) == 1 and warmed[0] != threading.get_ident()
    reset_clients()


def test_the_trace_summary_breaks_the_first_call_down() -> None:
    from kiln.frontend.trace import Span, format_summary, summarize

    def span(name: str, start: float, end: float, tid: int = 1) -> Span:
        return Span(name, start * 1000, end * 1000, 1, tid, "client")

    spans = [span("load graph", 0, 5), span("first call of a graph", 10, 110),
             span("load cubin", 12, 14), span("load cubin", 20, 23),
             span("first _scaled_dot_product_cudnn_attention", 30, 90),
             span("first-call warm-up", 0, 8, tid=2),  # another thread: not in the call
             span("first-call warm-up", 1, 3, tid=2),
             span("farm compile (client waits)", 2, 6, tid=3)]
    summary = summarize(spans)
    assert summary["warm_up"] == {"calls": 2, "ms": 10.0, "beside_compile_ms": 5.0}
    rows = {r["stage"]: (round(r["ms"], 3), r["count"]) for r in summary["first_calls"]}
    assert rows == {"first _scaled_dot_product_cudnn_attention": (60.0, 1),
                    "load cubin": (5.0, 2), "first call of a graph (own time)": (35.0, 1)}
    text = format_summary(summary)
    assert "first calls of graphs (stage, own ms, spans):" in text
    assert "first-call warm-up: 2 calls, 10.0 ms, 5.0 ms of it beside a compile" in text
    assert "first _scaled_dot_product_cudnn_attention" in text.split("first calls of")[1]


def test_planned_calls_of_real_ops_run_on_scratch_tensors() -> None:
    """The generic path with ATen's own ops (on CPU here): a convolution (list arguments
    come back as tuples), a batched matmul and a linear layer each run once."""
    def f(x: Any, w: Any, a: Any, b: Any, bias: Any) -> Any:
        y = aten.convolution(x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
        return y.relu(), aten.bmm(a, b), aten.addmm(bias, a[0], b[0])

    gm = make_fx(f)(torch.randn(2, 3, 8, 8), torch.randn(4, 3, 3, 3), torch.randn(2, 5, 6),
                    torch.randn(2, 6, 7), torch.randn(7))
    calls = plan(gm)
    assert [c.name for c in calls] == ["convolution", "bmm", "addmm"]
    assert calls[0].args[3:6] == ((1, 1), (1, 1), (1, 1))
    assert run_on(calls, torch.device("cpu")) == 3
