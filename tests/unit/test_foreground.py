"""Background tuning lets compiles on the way to a first output go first
(``workers.foreground``): its kernel compiles wait while a graph compiles here, or while
a training step's backward is expected after its forward ran."""

from __future__ import annotations

import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from kiln.compiler import trace
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.runtime.kernel_files import interpreter_active
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.compile import build_request
from kiln.frontend.core.keys import compute_key
from kiln.workers import foreground
from kiln.workers.pipeline import KERNEL_THREADS_ENV, KernelCache, compile_inprocess, kernel_jobs
from tests.unit.test_cubin import SM90, fake_cuda


def _idle_within(seconds: float) -> threading.Event:
    """An event set once ``wait_idle`` returns True in another thread."""
    done = threading.Event()

    def run() -> None:
        if foreground.wait_idle(seconds):
            done.set()

    threading.Thread(target=run, daemon=True).start()
    return done


def test_background_waits_for_a_compile_running_or_expected() -> None:
    assert foreground.active() == 0
    with foreground.compiling():
        with foreground.compiling():  # nested: one compile inside another
            assert foreground.active() == 2
        idle = _idle_within(30)
        assert not idle.wait(0.3)
    assert idle.wait(5) and foreground.active() == 0
    with trace.background(), foreground.compiling():  # background work is never waited for
        assert foreground.active() == 0 and foreground.wait_idle(0)
    foreground.expect("backward_7", within=30)
    idle = _idle_within(30)
    assert not idle.wait(0.3) and foreground.active() == 1
    with foreground.compiling("backward_7"):  # the expected compile started
        assert foreground.active() == 1
    assert idle.wait(5) and foreground.active() == 0
    foreground.expect("backward_8", within=0.3)  # never comes: counts only a while
    started = time.monotonic()
    assert foreground.wait_idle(10)
    assert 0.2 < time.monotonic() - started < 5
    with foreground.compiling():  # a wait is bounded, and says it was cut off
        assert not foreground.wait_idle(0.2)


def test_waiting_for_tuning_stops_expecting_a_backward_that_may_never_come() -> None:
    from kiln.frontend.tuning import BackgroundTuner

    foreground.expect("backward_9", within=60)  # a forward run without its backward
    idle = _idle_within(30)
    assert not idle.wait(0.3)
    assert BackgroundTuner().wait(1)  # exit, or a benchmark waiting for its tuning
    assert idle.wait(5) and foreground.active() == 0


@pytest.mark.skipif(interpreter_active(), reason="Triton was imported for its interpreter")
def test_background_kernel_compiles_start_after_the_foreground_compile(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "kcache"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv(KERNEL_THREADS_ENV, "2")
    args = fake_cuda([torch.randn(64, 128), torch.randn(64, 128)])
    gm = trace_aten(lambda a, b: (torch.softmax(a * 2, -1), (a + b).sum(0)), args)
    request = build_request(gm, args, KilnConfig.resolve({"farm": "inprocess"}),
                            target=dict(SM90))
    compiled = compile_inprocess(request.to_bytes(), compute_key(request).key,
                                 cache=KernelCache())
    jobs = [group[0] for group in kernel_jobs(compiled, dict(SM90)).values()]
    assert len(jobs) >= 2
    cache, out = KernelCache(), []

    def tune() -> None:
        with trace.background():
            out.extend(cache.compile_all(jobs))

    with trace.capture() as events:
        with foreground.compiling():
            worker = threading.Thread(target=trace.carry(lambda _: tune()), args=(None,))
            worker.start()
            time.sleep(1.0)
            assert cache.compiles == 0 and not out  # every job waits
            released_us = trace.now_us()
        worker.join(300)
    assert not worker.is_alive() and cache.compiles == len(jobs)
    for binary, job in zip(out, jobs):
        assert binary.binary == compiled.binaries[job.spec.name].binary  # the same cubins
    spans = [e for e in events if e["name"] == "kernel compile"]
    assert len(spans) == len(jobs)
    assert all(e["ts"] >= released_us and e["args"].get("background") for e in spans)
    waits = [e for e in events if e["name"] == "wait for foreground compile"]
    assert waits and all(e["dur"] >= 0.5e6 for e in waits)


class _Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.lin = torch.nn.Linear(32, 50)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        logits = self.lin(torch.nn.functional.gelu(self.norm(self.emb(tokens))))
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())


@pytest.mark.usefixtures("kiln_isolated")
def test_a_training_steps_backward_is_expected_from_its_forward_until_it_compiles() -> None:
    from kiln.frontend.core.fallback import KilnFallbackWarning

    torch.manual_seed(0)
    model = _Encoder()
    eager = _Encoder()
    eager.load_state_dict(model.state_dict())
    tokens = torch.randint(0, 50, (4, 16))
    step = torch.compile(model, backend="kiln")
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        loss = step(tokens)
        assert foreground.active() == 1  # the backward, expected
        idle = _idle_within(30)
        assert not idle.wait(0.2)
        loss.backward()
    assert idle.wait(5) and foreground.active() == 0
    expected = eager(tokens)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
    torch._dynamo.reset()
