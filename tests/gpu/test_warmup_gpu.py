"""The first-call warm-up on a real GPU (``frontend.core.warmup``): every library call of an
attention block's graph (SDPA's fused kernel as this torch picks it, the linear layers'
matmuls) runs once on scratch tensors without error, leaves the user's CUDA random state
as it was, and a model compiled with the warm-up on matches eager, with its calls warmed
beside the compile and the first call's spans on the timeline."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch
import torch.nn.functional as F

from kiln.compiler import trace
from kiln.frontend.core import warmup
from kiln.frontend.core.warmup import Warmup, plan, run
from tests.warmup_helpers import compile_after_the_warmup


class Attention(torch.nn.Module):
    def __init__(self, dim: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, d))


def test_every_call_of_an_attention_graph_warms_and_the_random_state_is_kept(
        caplog: pytest.LogCaptureFixture) -> None:
    from torch._dynamo.backends.common import aot_autograd

    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, inputs: object) -> object:
        graphs.append(gm)
        return gm.forward

    model = Attention().cuda().half()
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.half)
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=aot_autograd(fw_compiler=keep))(x)
    calls = plan(graphs[0])
    names = {c.name for c in calls}
    assert any(n.startswith("_scaled_dot_product") for n in names), names
    assert names & {"addmm", "mm"}, names
    state = torch.cuda.get_rng_state()
    with caplog.at_level(logging.INFO, logger="kiln.warmup"):
        assert run(calls, x.device) == len(calls), caplog.text
    assert torch.equal(torch.cuda.get_rng_state(), state)


@pytest.mark.parametrize("on_callers_thread", [False, True])
def test_a_model_compiled_with_the_warm_up_matches_eager(tmp_path: object,
                                                         monkeypatch: pytest.MonkeyPatch,
                                                         on_callers_thread: bool) -> None:
    """``on_callers_thread``: placed as beside a farm's compile (the client's thread,
    inside Dynamo's fake mode)."""
    from kiln.frontend.core import compile as kiln_compile
    from kiln.frontend.core.client import reset_clients
    from kiln.frontend.core.fallback import KilnFallbackWarning

    monkeypatch.setenv("KILN_FARM", "inprocess")
    monkeypatch.setenv("KILN_STORE", str(tmp_path) + "/store")
    made: list[Warmup] = []
    real = Warmup.for_graph

    def counted(*args: object, **kwargs: object) -> Warmup | None:
        warm = real(*args, **kwargs)  # type: ignore[arg-type]
        made.extend([warm] if warm is not None else [])
        return warm

    monkeypatch.setattr(kiln_compile.Warmup, "for_graph", staticmethod(counted))
    kinds: set[str] = set()
    real_scratch = warmup._scratch

    def scratch(value: object, device: torch.device, generator: torch.Generator) -> object:
        made_now = real_scratch(value, device, generator)
        if isinstance(made_now, torch.Tensor):
            kinds.add(f"{made_now.device.type}:{type(made_now).__module__.split('.')[0]}."
                      f"{type(made_now).__name__}")
        return made_now

    monkeypatch.setattr(warmup, "_scratch", scratch)
    compile_after_the_warmup(monkeypatch, warm_here=True if on_callers_thread else None)
    reset_clients()
    torch.manual_seed(0)
    model = Attention(dim=256 if on_callers_thread else 128).cuda().half()
    x = torch.randn(2, 128, model.out.in_features, device="cuda", dtype=torch.half)
    torch._dynamo.reset()
    trace.clear()
    trace.enable(True)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("error", KilnFallbackWarning)
            out = torch.compile(model, backend="kiln")(x)
            torch.testing.assert_close(out, model(x), atol=1e-2, rtol=1e-2)  # fp16
        names = [e["name"] for e in trace.events()]
    finally:
        trace.enable(False)
        reset_clients()
    assert made and all(not w.left and w.ran >= 2 for w in made)
    assert kinds and kinds <= {"cuda:torch.Tensor"}, kinds  # real tensors, never fake
    assert names.count("first-call warm-up") >= 2
    assert any(n.startswith("first _scaled_dot_product") for n in names), names
