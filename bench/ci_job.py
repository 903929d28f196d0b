"""One CI-shaped job (a benchmark's runner, not a test): several small models compiled in
one process, as a test job runs them, checked against eager, with what the job cost.

Run by ``bench/ci_cache.py`` (and ``tests/store/test_ci_runners.py``) as a fresh process
per runner; the environment says which store and caches it uses. It prints one JSON line:
job seconds (from after ``import torch`` to the last check, a mega-cache load included),
Dynamo graphs, compiles, AOTAutograd traces, hits, bytes fetched from the store, Dynamo's
warnings, and every model's check against eager.

    python bench/ci_job.py --backend kiln [--device cpu|cuda] [--models a,b]
    python bench/ci_job.py --backend inductor [--mega-load FILE] [--mega-save FILE]

Models (:data:`MODELS`): inference under ``no_grad`` (an MLP, a conv net with BatchNorm in
eval mode, ``nn.TransformerEncoderLayer`` in eval mode, a model with a graph break, an MLP
called at two batch sizes) and training steps with ``loss.backward()`` inside the compiled
function (an MLP, a conv net with BatchNorm in train mode, a model with a graph break).
"""

from __future__ import annotations

import argparse
import copy
import json
import logging
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

AFTER_TORCH = time.perf_counter()


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(32, 64), nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class ConvBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn(self.conv(x)))
        return self.head(y.mean(dim=(2, 3)))


class Head(nn.Module):
    """The model called at two batch sizes (a class of its own: models of one class and
    different sizes share a compiled frame, whose sizes Dynamo then makes dynamic)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 48), nn.Linear(48, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.b(torch.relu(self.a(x))), dim=-1)


class Broken(nn.Module):
    """A model with a graph break in its forward (a data-dependent Python branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(32, 48), nn.Linear(48, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        torch._dynamo.graph_break()
        return self.b(h * torch.sigmoid(h))


def encoder() -> nn.Module:
    return nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0,
                                      batch_first=True)


@dataclass(frozen=True)
class Case:
    """One model of the job: ``make`` builds it, ``inputs`` one call's inputs (fresh
    random values, shapes fixed), ``train``: a training step (else inference under
    ``no_grad``), ``batches``: the batch sizes it is called at."""

    make: Callable[[], nn.Module]
    inputs: Callable[[int, torch.device], tuple[torch.Tensor, ...]]
    train: bool = False
    eval_mode: bool = True
    batches: tuple[int, ...] = (16,)


def _vec(b: int, d: torch.device) -> tuple[torch.Tensor, ...]:
    return (torch.randn(b, 32, device=d), torch.randint(0, 10, (b,), device=d))


def _img(b: int, d: torch.device) -> tuple[torch.Tensor, ...]:
    return (torch.randn(b, 3, 12, 12, device=d), torch.randint(0, 10, (b,), device=d))


def _seq(b: int, d: torch.device) -> tuple[torch.Tensor, ...]:
    return (torch.randn(b, 10, 32, device=d),)


MODELS: dict[str, Case] = {
    "mlp": Case(MLP, _vec),
    "conv_bn_eval": Case(ConvBN, _img),
    "encoder_eval": Case(encoder, _seq),
    "graph_break": Case(Broken, _vec),
    "two_batches": Case(Head, _vec, batches=(8, 24)),
    "train_mlp": Case(MLP, _vec, train=True, eval_mode=False),
    "train_conv_bn": Case(ConvBN, _img, train=True, eval_mode=False),
    "train_graph_break": Case(Broken, _vec, train=True, eval_mode=False),
}
QUICK = ("mlp", "conv_bn_eval", "encoder_eval", "train_mlp")  # the four


def train_step(model: nn.Module, name: str) -> Callable[..., torch.Tensor]:
    """A training step with its own code object per model, as each test of a job writes
    its own: one shared step function recompiles for each model, and Dynamo then makes
    its inputs' sizes dynamic (automatic dynamic shapes), which is another job."""
    def step(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(model(x), target)
        loss.backward()
        return loss.detach()

    code = step.__code__.replace(co_name=f"step_{name}")
    return types.FunctionType(code, step.__globals__, code.co_name, None, step.__closure__)


def _tolerance(device: torch.device) -> dict[str, float]:
    # fp32 throughout; GPU matmuls may reorder sums, CPU conv kernels too
    return {"rtol": 1e-3, "atol": 1e-3} if device.type == "cuda" else {"rtol": 1e-4,
                                                                       "atol": 1e-4}


def run_case(name: str, case: Case, backend: str, device: torch.device) -> float:
    """The model compiled and eager side by side on the same inputs (two steps where it
    trains); the largest difference seen. Raises AssertionError where they differ."""
    torch.manual_seed(sum(map(ord, name)))
    model = case.make().to(device)
    model.train(not case.eval_mode)
    reference = copy.deepcopy(model)
    tol = _tolerance(device)
    worst = 0.0
    if case.train:
        compiled = torch.compile(train_step(model, name), backend=backend)
        eager = train_step(reference, name)
        for _ in range(2):
            x, target = case.inputs(case.batches[0], device)
            got, want = compiled(x, target), eager(x, target)
            pairs = [(got, want)] + [(p.grad, q.grad) for p, q in
                                     zip(model.parameters(), reference.parameters())]
            pairs += [(a, b) for a, b in zip(model.buffers(), reference.buffers())]
            for a, b in pairs:
                torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{name}: {m}")
                worst = max(worst, float((a.double() - b.double()).abs().max()))
            for module in (model, reference):
                for p in module.parameters():  # one SGD step, the same on both sides
                    with torch.no_grad():
                        p -= 0.1 * p.grad
                    p.grad = None
        return worst
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        for batch in case.batches:
            x = case.inputs(batch, device)[0]
            got, want = compiled(x), reference(x)
            torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{name}: {m}")
            worst = max(worst, float((got.double() - want.double()).abs().max()))
    return worst


class _Warnings(logging.Handler):
    """Dynamo's and Kiln's warnings (log records) seen during the job."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.name.startswith(("torch._dynamo", "kiln")):
            self.seen.append(f"{record.name}: {record.getMessage()[:160]}")


def count_aot_traces() -> list[int]:
    """AOTAutograd's entry point, counted (an Inductor AOT-cache hit goes through it
    too: the caller subtracts those)."""
    import torch._dynamo.backends.common as common

    calls: list[int] = []
    real = common.aot_module_simplified

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    common.aot_module_simplified = counted
    return calls


def kiln_figures() -> dict[str, Any]:
    from kiln.frontend.core.client import _clients, _clients_lock

    with _clients_lock:
        clients = list(_clients.values())
    counts: dict[str, float] = {}
    fetched = 0
    for client in clients:
        for k, v in client.counters.snapshot().items():
            if isinstance(v, (int, float)):
                counts[k] = counts.get(k, 0) + v
        tiers = client.store.stats().get("tiers") or {}
        remote = [t for name, t in tiers.items() if name != "local"] or list(tiers.values())
        fetched += sum(int(t.get("bytes_read", 0)) for t in remote[-1:])
        client.counters.flush()
    graphs = counts.get("graphs", 0)
    return {"compiles": int(counts.get("compiles", 0)), "aot_hits": int(counts.get("aot_hits", 0)),
            "graph_hits": int(counts.get("hits", 0)), "graph_lookups": int(graphs),
            "aot_uncached": int(counts.get("aot_uncached", 0)), "bytes_fetched": fetched,
            "counters": {k: v for k, v in counts.items() if k.startswith("aot_")}}


def inductor_figures() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    ind, aot = counters["inductor"], counters["aot_autograd"]
    return {"compiles": int(ind["fxgraph_cache_miss"] + ind["fxgraph_cache_bypass"]),
            "graph_hits": int(ind["fxgraph_cache_hit"]),
            "aot_hits": int(aot["autograd_cache_hit"]),
            "graph_lookups": int(ind["fxgraph_cache_hit"] + ind["fxgraph_cache_miss"]
                                 + ind["fxgraph_cache_bypass"])}


def run_job(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    names = args.models.split(",") if args.models else list(MODELS)
    fetched = 0
    if args.mega_load:
        with open(args.mega_load, "rb") as f:
            blob = f.read()
        fetched = len(blob)
        torch.compiler.load_cache_artifacts(blob)
    calls = count_aot_traces()
    handler = _Warnings()
    logging.getLogger().addHandler(handler)
    errors: dict[str, str] = {}
    worst: dict[str, float] = {}
    seconds: dict[str, float] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in names:
            start = time.perf_counter()
            try:
                worst[name] = run_case(name, MODELS[name], args.backend, device)
            except AssertionError as e:
                errors[name] = str(e)[:300]
            seconds[name] = round(time.perf_counter() - start, 3)
    if device.type == "cuda":
        torch.cuda.synchronize()
    job_s = time.perf_counter() - AFTER_TORCH
    from torch._dynamo.utils import counters

    figures = kiln_figures() if args.backend == "kiln" else inductor_figures()
    if args.mega_save:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            with open(args.mega_save, "wb") as f:
                f.write(saved[0])
    fallbacks = [str(w.message)[:200] for w in caught
                 if w.category.__name__ == "KilnFallbackWarning"]
    dynamo = sorted({m for m in handler.seen if m.startswith("torch._dynamo")}
                    | {str(w.message)[:160] for w in caught if "Dynamo" in str(w.message)})
    return {"backend": args.backend, "device": str(device), "models": names,
            "job_s": round(job_s, 3), "graphs": int(counters["stats"]["unique_graphs"]),
            "aot_traces": len(calls) - figures["aot_hits"] * (args.backend != "kiln"),
            "bytes_fetched": figures.pop("bytes_fetched", fetched) or fetched,
            **figures, "fallback_warnings": fallbacks, "dynamo_warnings": dynamo,
            "errors": errors, "max_abs_diff": worst, "model_s": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", choices=("kiln", "inductor"), default="kiln")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default="", help="comma-separated; all by default")
    parser.add_argument("--mega-load", default="", help="a mega-cache file loaded first")
    parser.add_argument("--mega-save", default="", help="where the mega-cache goes")
    args = parser.parse_args()
    if args.models == "quick":
        args.models = ",".join(QUICK)
    result = run_job(args)
    print(json.dumps(result, sort_keys=True))


if __name__ == "__main__":
    main()
