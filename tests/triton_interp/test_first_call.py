"""The first call of graphs run by Triton kernels (the interpreter, on CPU) with the
first-call warm-up forced on (``frontend.core.warmup``; it never runs for CPU graphs by
itself, so the test builds a CPU one): an MLP's library calls run beside the compile on
scratch tensors, the outputs match eager, the user's random state is untouched, and the
timeline holds the first call with its library calls."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.compiler import trace
from kiln.frontend.core import compile as kiln_compile
from kiln.frontend.core.client import reset_clients
from kiln.frontend.core.fallback import KilnFallbackWarning
from kiln.frontend.core.warmup import Warmup, plan
from tests.warmup_helpers import compile_after_the_warmup

OPTIONS: dict[str, Any] = {"cpu_backend": "triton-interpret"}


@pytest.mark.parametrize("on_callers_thread", [False, True])
def test_a_warmed_graph_matches_eager_and_its_first_call_is_on_the_timeline(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_callers_thread: bool) -> None:
    """``on_callers_thread``: the warm-up placed as beside a farm's compile (on the
    client's thread, inside Dynamo's fake mode), here beside a local compile."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "c"))
    monkeypatch.setenv("KILN_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("KILN_FARM_FILE", str(tmp_path / "none.json"))
    reset_clients()
    made: list[Warmup] = []

    def on_cpu_too(gm: torch.fx.GraphModule, device: torch.device, enabled: bool = True
                   ) -> Any:
        made.append(Warmup(plan(gm), device))
        return made[-1]

    monkeypatch.setattr(kiln_compile.Warmup, "for_graph", staticmethod(on_cpu_too))
    compile_after_the_warmup(monkeypatch, warm_here=True if on_callers_thread else None)
    torch.manual_seed(0)
    hidden = 48 if on_callers_thread else 64  # another graph: no cache serves it
    model = torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.GELU(),
                                torch.nn.Linear(hidden, 16))
    x = torch.randn(8, 32)
    ref = model(x)
    state = torch.get_rng_state()
    torch._dynamo.reset()
    trace.clear()
    trace.enable(True)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("error", KilnFallbackWarning)
            out = torch.compile(model, backend="kiln", options=OPTIONS)(x)
        events = trace.events()
    finally:
        trace.enable(False)
        reset_clients()
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(torch.get_rng_state(), state)
    warm, = made
    assert warm.ran == 2 and not warm.left  # the two linear layers' matmuls
    names = [e["name"] for e in events]
    assert names.count("first-call warm-up") == 2
    assert names.count("first call of a graph") == 1
    assert sum(n.startswith("first ") and "mm" in n for n in names) == 2, names
