"""One row of the suite, in one process: a model in one mode, under eager, Inductor and
Kiln (``bench/suite/run.py`` starts a fresh process per row, with fresh caches).

Steps: build the model and fresh random inputs; eager and float64 eager references (a
training step's loss, gradients and, with an optimizer, updated weights); each compiled
backend from ``torch.compile`` on: its first call (cold compile), then calls back to
back until their times settle (time to full speed); accuracy of that first call; then the
steady state of every backend in alternating blocks; peak memory; launches per call.
Kiln compiles with ``KilnFallbackWarning`` turned into an error.
"""

from __future__ import annotations

import copy
import gc
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .accuracy import same, tolerance
from .spec import Inputs, ModelSpec, flatten_tensors

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_timing import time_interleaved  # noqa: E402

Step = Callable[[Inputs], list[torch.Tensor]]
SETTLED = 1.15  # the last calls' slowest / fastest at most this: times have settled


def to_device(value: Any, device: str, dtype: torch.dtype | None) -> Any:
    """Inputs onto the device; floating tensors cast to ``dtype`` (None keeps fp32)."""
    if isinstance(value, torch.Tensor):
        cast = dtype if dtype is not None and value.is_floating_point() else value.dtype
        return value.to(device=device, dtype=cast)
    if isinstance(value, dict):
        return {k: to_device(v, device, dtype) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(v, device, dtype) for v in value)
    return value


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


class Case:
    """A model in one mode: its steps for each backend, each on its own copy."""

    def __init__(self, spec: ModelSpec, mode: str, tiny: bool, device: str):
        self.spec, self.mode, self.tiny, self.device = spec, mode, tiny, device
        self.train = mode == "train"
        torch.manual_seed(0)
        model = spec.build(tiny)
        # The base stays on the CPU: each backend gets its own copy on the device.
        self.base = model.train() if self.train else model.to(spec.dtype).eval()
        self.input_dtype = None if self.train else spec.dtype

    def inputs(self, batch: int | None = None, dtype: torch.dtype | None = None) -> Inputs:
        return to_device(self.spec.inputs(self.tiny, batch), self.device,
                         dtype or self.input_dtype)

    def step(self, model: torch.nn.Module, compile_fn: Callable[[Any], Any] | None,
             fp64: bool = False) -> Step:
        """The callable a backend runs: a forward (inference), or forward, loss, backward
        and the optimizer's update (training); returns the results to compare."""
        spec, train = self.spec, self.train
        wrap = compile_fn or (lambda f: f)
        if not train:
            forward = wrap(model)

            def infer(inputs: Inputs) -> list[torch.Tensor]:
                with torch.no_grad():
                    return flatten_tensors(forward(**spec.model_inputs(inputs, False)))
            return infer
        device_type = self.device.split(":")[0]
        # bf16 autocast as on the GPU; the CPU (CI) trains in fp32.
        autocast = not fp64 and device_type == "cuda"

        def forward_loss(inputs: Inputs) -> torch.Tensor:
            with torch.autocast(device_type, torch.bfloat16, enabled=autocast):
                return spec.loss(model(**spec.model_inputs(inputs, True)), inputs)
        loss_fn = wrap(forward_loss)
        opt_step = self._optimizer(model, wrap)
        params = [p for p in model.parameters() if p.requires_grad]

        def train_step(inputs: Inputs) -> list[torch.Tensor]:
            model.zero_grad(set_to_none=True)
            loss = loss_fn(inputs)
            loss.backward()
            if opt_step is not None:
                opt_step()
            return [loss.detach()] + [p.grad for p in params if p.grad is not None] + (
                [p.detach() for p in params] if opt_step is not None else [])
        return train_step

    def _optimizer(self, model: torch.nn.Module, wrap: Callable[[Any], Any]
                   ) -> Callable[[], Any] | None:
        name = self.spec.optimizer
        if name is None:
            return None
        params = [p for p in model.parameters() if p.requires_grad]
        if name == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(params, lr=0.01, momentum=0.9)
        else:
            opt = torch.optim.AdamW(params, lr=1e-4)
        # A compiled update, as Inductor's users compile it (a foreach update, one graph).
        return wrap(opt.step)

    def copy(self) -> torch.nn.Module:
        return copy.deepcopy(self.base).to(self.device)


def cpu_results(results: list[torch.Tensor]) -> list[torch.Tensor]:
    return [r.detach().to("cpu", copy=True) for r in results]


def references(case: Case, inputs: Inputs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Eager (the model's dtype) and float64 eager results for ``inputs``, on the CPU."""
    ref = cpu_results(case.step(case.copy(), None)(inputs))
    model64 = copy.deepcopy(case.base).double().to(case.device)
    inputs64 = to_device(inputs, case.device, torch.float64)
    fp64 = cpu_results(case.step(model64, None, fp64=True)(inputs64))
    del model64, inputs64
    gc.collect()
    if case.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return ref, fp64


def settle(step: Step, input_sets: list[Inputs], device: str, t0: float,
           cap_s: float, min_calls: int) -> list[tuple[float, float]]:
    """Calls back to back from the first one on: (seconds since ``t0`` at the end of
    each call, its duration), until the last ``min_calls`` calls have settled."""
    calls: list[tuple[float, float]] = []
    while True:
        start = time.perf_counter()
        step(input_sets[len(calls) % len(input_sets)])
        sync(device)
        end = time.perf_counter()
        calls.append((end - t0, end - start))
        recent = [d for _, d in calls[1:][-min_calls:]]
        if len(recent) >= min_calls and max(recent) <= SETTLED * min(recent):
            return calls
        if end - t0 > cap_s and len(calls) > 1:
            return calls


def full_speed_s(calls: list[tuple[float, float]], steady_ms: float) -> float | None:
    """Seconds from ``torch.compile`` to the end of the first call within 10% of steady."""
    for at, duration in calls:
        if duration * 1e3 <= 1.10 * steady_ms:
            return at
    return None


def launches_per_call(step: Step, inputs: Inputs) -> int:
    """GPU kernels (and copies) one call launches, counted by the profiler."""
    from torch.profiler import ProfilerActivity, profile

    step(inputs)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(inputs)
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def peak_memory_mb(step: Step, inputs: Inputs) -> float:
    """Peak GPU memory a call needs above what is resident before it (weights)."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    for _ in range(2):
        step(inputs)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**20


def compile_backend(name: str, dynamic: bool) -> Callable[[Any], Any]:
    if name == "kiln":
        from kiln.frontend.core.fallback import KilnFallbackWarning

        warnings.simplefilter("error", KilnFallbackWarning)
    return lambda f: torch.compile(f, backend=name, dynamic=True if dynamic else None)


def error_text(exc: BaseException) -> str:
    lines = traceback.format_exception_only(type(exc), exc)
    return "".join(lines).strip()[-2000:]


def median_ms(calls: list[tuple[float, float]]) -> float:
    return statistics.median(d for _, d in calls[1:] or calls) * 1e3


class KilnGraphs:
    """The graphs Kiln compiles while it is installed: their count and eager ops."""

    def __init__(self) -> None:
        self.graphs = 0
        self.fallback_ops: dict[str, int] = {}

    def __enter__(self) -> KilnGraphs:
        from kiln.frontend.core import compile as kiln_compile

        kiln_compile.observers.append(self.observe)
        return self

    def __exit__(self, *exc: object) -> None:
        from kiln.frontend.core import compile as kiln_compile

        kiln_compile.observers.remove(self.observe)

    def observe(self, name: str, result: Any) -> None:
        self.graphs += 1
        for op, n in result.compiled.stats.get("fallback_ops", {}).items():
            self.fallback_ops[op] = self.fallback_ops.get(op, 0) + n


def warm_up(backends: list[str], device: str) -> None:
    """A small graph through each compiler first: imports and one-time start-up are
    nobody's cold compile (each row's caches stay empty for its model's kernels)."""
    x = torch.randn(64, 64, device=device)
    for name in backends:
        if name != "eager":
            torch.compile(lambda t: (t.sin() + 1).sum(0), backend=name)(x)
    sync(device)


def cold_start(case: Case, name: str, input_sets: list[Inputs], opts: dict[str, Any]
               ) -> tuple[dict[str, Any], Step | None, list[torch.Tensor]]:
    """``torch.compile`` to full speed for one backend: the figures, its step (None if it
    failed) and its first call's results (on the CPU)."""
    figures: dict[str, Any] = {}
    model = case.copy()
    graphs = KilnGraphs() if name == "kiln" else None
    try:
        with graphs or _nothing():
            t0 = time.perf_counter()
            step = case.step(model, compile_backend(name, case.mode == "dynamic"))
            first = cpu_results(step(input_sets[0]))
            sync(case.device)
            figures["cold_compile_s"] = time.perf_counter() - t0
            calls = settle(step, input_sets, case.device, t0, opts["settle_cap_s"],
                           opts["settle_calls"])
    except Exception as exc:  # a failing backend is a result of the row
        figures.update(ok=False, error=error_text(exc))
        return figures, None, []
    finally:
        if graphs is not None:
            figures.update(graphs=graphs.graphs, fallback_ops=graphs.fallback_ops)
    figures["calls"] = [(round(at, 4), round(d * 1e3, 3)) for at, d in calls]
    return figures, step, first


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def check(case: Case, first: list[torch.Tensor], ref: list[torch.Tensor],
          fp64: list[torch.Tensor]) -> dict[str, Any]:
    labels = (["loss"] + [f"grad/param {i}" for i in range(len(ref) - 1)]
              if case.train else None)
    verdict = same(ref, first, fp64, tolerance(case.spec.dtype, case.train), labels)
    return {"ok": verdict.ok, "accuracy": verdict.why or "pass"}


def run_row(spec: ModelSpec, mode: str, backends: list[str], tiny: bool, device: str,
            opts: dict[str, Any]) -> dict[str, Any]:
    """Every figure of one row (see the module docstring)."""
    case = Case(spec, mode, tiny, device)
    input_sets = [case.inputs() for _ in range(2)]
    ref, fp64 = references(case, input_sets[0])
    warm_up(backends, device)
    row: dict[str, Any] = {"backends": {}}
    steps: dict[str, Step] = {}
    for name in backends:
        if name == "eager":
            steps[name] = case.step(case.copy(), None)
            row["backends"][name] = {"ok": True}
            continue
        figures, step, first = cold_start(case, name, input_sets, opts)
        if step is not None:
            figures.update(check(case, first, ref, fp64))
            if mode == "dynamic" and figures["ok"]:
                figures.update(dynamic_check(case, step))
            steps[name] = step
        row["backends"][name] = figures
    measure(case, steps, input_sets, row["backends"], opts)
    return row


def dynamic_check(case: Case, step: Step) -> dict[str, Any]:
    """The same compiled callable at another batch size, checked again."""
    first = case.spec.inputs(case.tiny, None)
    size = len(next(iter(first.values())))
    batch = size // 2 if size >= 4 else size + 1  # never 1: Dynamo specializes 0 and 1
    other = case.inputs(batch)
    ref, fp64 = references(case, other)
    verdict = same(ref, cpu_results(step(other)), fp64, tolerance(case.spec.dtype, False))
    return {"ok": verdict.ok, "accuracy_other_batch": verdict.why or "pass",
            "other_batch": batch}


def measure(case: Case, steps: dict[str, Step], input_sets: list[Inputs],
            figures: dict[str, dict[str, Any]], opts: dict[str, Any]) -> None:
    """Steady state (alternating), time to full speed, peak memory, launches."""
    if not steps:
        return
    cuda = case.device.startswith("cuda")
    timer = None if cuda else _wall_ms
    # About two seconds of timed calls per backend, at least a few per block.
    start = time.perf_counter()
    next(iter(steps.values()))(input_sets[0])
    sync(case.device)
    one_ms = (time.perf_counter() - start) * 1e3
    reps = max(2 * opts["blocks"], min(opts["reps"], int(2000 / max(one_ms, 1e-3))))
    steady = time_interleaved(steps, [[i] for i in input_sets], reps,
                              blocks=opts["blocks"],
                              **({"timer": timer} if timer else {}), warmup=2)
    for name, ms in steady.items():
        entry = figures[name]
        entry["steady_ms"] = ms
        if "calls" in entry:
            entry["full_speed_s"] = full_speed_s(
                [(at, d / 1e3) for at, d in entry["calls"]], ms)
            entry["settle_calls"] = len(entry["calls"])
            entry["calls"] = entry["calls"][:20]  # the first calls tell the story
        if cuda:
            entry["peak_mb"] = peak_memory_mb(steps[name], input_sets[0])
            entry["launches"] = launches_per_call(steps[name], input_sets[0])


def _wall_ms(fn: Callable[..., Any], args: list[Any]) -> float:
    start = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - start) * 1e3
