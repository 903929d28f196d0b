"""Pay a GPU graph's first-call library costs while the client waits for its compile.

The first call of a compiled graph is the first time this process runs some library
calls at their shapes: cuDNN attention builds a plan per shape (and loads its engines),
cuBLAS makes a handle and a workspace, cuDNN convolutions pick an algorithm. On the H200
host that was 0.6-0.9 s of GPT-2's first call through a farm, all of it in 12 calls of
``_scaled_dot_product_cudnn_attention``. Those costs do not depend on the compiled code:
they can be paid while the farm compiles.

:func:`plan` reads the ATen graph the client sends (each node's ``meta["val"]``) and
lists its library calls (:data:`WARM_OPS`) with their exact arguments: tensors become
:class:`ScratchTensor` (shape, stride, dtype), everything else (flags, scales, dropout)
stays as the graph has it; one entry per distinct call. :func:`run` makes random scratch
tensors on the graph's device (from a private generator: the user's random state is not
touched), calls each op once, waits for it, and frees them. Nothing the graph computes
reads them, so numerics and outputs do not change.

``frontend.core.overlap`` runs the client's compile with the warm-up beside it. cuDNN keeps
its attention plans per thread, so where the client only waits (a farm compiles), the
warm-up runs on the calling thread, the one that will call the graph, and the wait on a
helper thread; where the client compiles itself, the warm-up takes the helper thread
(library loads, handles and lazily loaded library kernels are per process). A failing
op is logged (``kiln.warmup``) and skipped: the first call then pays as before.
``KILN_WARM_FIRST_CALL=0`` turns it off; graphs on CPU are never warmed.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
from torch._dispatch.python import no_python_dispatcher
from torch.utils._python_dispatch import _disable_current_modes

from kiln.compiler import trace

log = logging.getLogger("kiln.warmup")
aten = torch.ops.aten

# Library calls whose first call at a shape costs host time (plans, handles, heuristics).
WARM_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.convolution.default, aten.convolution_backward.default,
    aten._scaled_dot_product_cudnn_attention.default,
    aten._scaled_dot_product_cudnn_attention_backward.default,
    aten._scaled_dot_product_flash_attention.default,
    aten._scaled_dot_product_flash_attention_backward.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_efficient_attention_backward.default,
})
MAX_SCRATCH_BYTES = 1 << 30  # one call's inputs and outputs; a larger call is not warmed


@dataclass(frozen=True)
class ScratchTensor:
    """A tensor argument of a warm-up call: made random, on the graph's device."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        extent = 1 + sum((n - 1) * s for n, s in zip(self.shape, self.stride))
        return (extent if all(self.shape) else 0) * self.dtype.itemsize


@dataclass(frozen=True)
class WarmCall:
    """One library call of the graph, as :func:`run` makes it."""

    op: Any  # an ATen OpOverload
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]

    @property
    def name(self) -> str:
        return str(getattr(self.op, "__name__", self.op)).removesuffix(".default")

    def scratch(self) -> list[ScratchTensor]:
        return [a for a in _flat([*self.args, *(v for _, v in self.kwargs)])
                if isinstance(a, ScratchTensor)]

    @property
    def random(self) -> bool:
        """Whether the call draws random numbers (attention with ``dropout_p`` > 0)."""
        schema = getattr(self.op, "_schema", None)
        names = [a.name for a in schema.arguments] if schema is not None else []
        if "dropout_p" not in names:
            return False
        at = names.index("dropout_p")
        value = self.args[at] if at < len(self.args) else dict(self.kwargs).get("dropout_p")
        return float(value or 0.0) > 0


class NotWarmable(ValueError):
    """An argument :func:`plan` cannot rebuild (symbolic sizes, a non-tensor node)."""


def plan(gm: torch.fx.GraphModule) -> list[WarmCall]:
    """The graph's library calls worth warming, one per distinct call: attention first,
    then convolutions, then matmuls (the costliest first: a compile that ends early
    stops the warm-up), each kind in graph order."""
    calls: dict[WarmCall, None] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in WARM_OPS:
            continue
        try:
            call = WarmCall(node.target, tuple(_template(a) for a in node.args),
                            tuple((k, _template(v)) for k, v in node.kwargs.items()))
        except NotWarmable as e:
            log.debug("kiln: %s not warmed: %s", node.target, e)
            continue
        if sum(t.nbytes for t in call.scratch()) + _output_bytes(node) <= MAX_SCRATCH_BYTES:
            calls.setdefault(call)
    return sorted(calls, key=_priority)


def _priority(call: WarmCall) -> int:
    name = call.name
    return 0 if "attention" in name else 1 if "convolution" in name else 2


def _output_bytes(node: torch.fx.Node) -> int:
    """What the call allocates for its outputs (as the graph's metadata says)."""
    val = node.meta.get("val")
    outs = val if isinstance(val, (list, tuple)) else [val]
    total = 0
    for t in outs:
        if isinstance(t, torch.Tensor) and isinstance(t.numel(), int):
            total += int(t.numel()) * t.element_size()
    return total


def _template(value: Any) -> Any:
    if isinstance(value, torch.fx.Node):
        val = value.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise NotWarmable(f"argument {value.name} is not a tensor")
        shape, stride = tuple(val.shape), tuple(val.stride())
        if not all(isinstance(n, int) for n in (*shape, *stride)):
            raise NotWarmable(f"argument {value.name} has symbolic sizes")
        return ScratchTensor(shape, stride, val.dtype)
    if isinstance(value, (list, tuple)):
        return tuple(_template(v) for v in value)
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        raise NotWarmable("a symbolic argument")
    return value


def _flat(values: Sequence[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        out.extend(_flat(v) if isinstance(v, tuple) else [v])
    return out


def run(calls: Sequence[WarmCall], device: torch.device, *, may_draw: bool = False,
        stop: threading.Event | None = None) -> int:
    """Call each op once on scratch tensors on ``device``; the number that ran. Graphs
    on CPU are not warmed (their first call pays nothing a warm-up would save).

    ``may_draw``: ops that draw random numbers (dropout) run too, with the device's
    random state restored after (only on the thread that will call the graph: the state
    is the process's). ``stop`` set: the calls left are skipped."""
    if device.type != "cuda":
        return 0
    return run_on(calls, device, may_draw=may_draw, stop=stop)


def run_on(calls: Sequence[WarmCall], device: torch.device, *, may_draw: bool = False,
           stop: threading.Event | None = None) -> int:
    """:func:`run` on any device (tests run it on CPU)."""
    cuda = device.type == "cuda"
    try:
        generator = torch.Generator(device=device)
        generator.manual_seed(0)
        place = torch.cuda.device(device) if cuda else nullcontext()
    except Exception as e:
        log.info("kiln: no first-call warm-up on %s (%s: %s); ignored", device,
                 type(e).__name__, e)
        return 0
    done = 0
    # Real tensors even inside a compile (the client's thread has Dynamo's fake mode on).
    with _disable_current_modes(), no_python_dispatcher(), place, torch.no_grad():
        for call in calls:
            if stop is not None and stop.is_set():
                break
            if call.random and not may_draw:
                continue
            done += _run_one(call, device, generator)
    return done


def _scratch(value: Any, device: torch.device, generator: torch.Generator) -> Any:
    """A template's argument: random tensors (never zeros) where it has tensors."""
    if isinstance(value, ScratchTensor):
        # The whole extent filled, then viewed: broadcast (stride 0) layouts too.
        base = torch.empty(value.nbytes // value.dtype.itemsize, dtype=value.dtype,
                           device=device)
        if base.is_floating_point():
            base.normal_(generator=generator)
        else:
            base.random_(0, 2, generator=generator)
        return base.as_strided(value.shape, value.stride)
    if isinstance(value, tuple):
        return tuple(_scratch(v, device, generator) for v in value)
    return value


def _rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _run_one(call: WarmCall, device: torch.device, generator: torch.Generator) -> int:
    """One call, waited for (its cost is paid here, not at the graph's first call)."""
    with trace.span("first-call warm-up", cat="client", op=call.name) as span_args:
        state = _rng_state(device) if call.random else None
        try:
            args = _scratch(call.args, device, generator)
            kwargs = {k: _scratch(v, device, generator) for k, v in call.kwargs}
            out = call.op(*args, **kwargs)
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            del out, args, kwargs
            return 1
        except Exception as e:  # the first call pays as before
            span_args["error"] = f"{type(e).__name__}: {e}"[:300]  # on the timeline too
            log.info("kiln: first-call warm-up of %s failed (%s: %s); ignored", call.name,
                     type(e).__name__, e)
            return 0
        finally:
            if state is not None:
                _set_rng_state(state, device)


class Warmup:
    """A graph's warm-up, callable as ``warm(stop)`` (what ``frontend.core.overlap`` takes). Each
    call runs once however often it is called (a farm wait that ends in a local compile
    resumes where the first part stopped); random ops only on the creating thread."""

    def __init__(self, calls: Sequence[WarmCall], device: torch.device) -> None:
        self.left = list(calls)
        self.device = device
        self.ran = 0
        self._owner = threading.get_ident()
        self._lock = threading.Lock()

    @staticmethod
    def for_graph(gm: torch.fx.GraphModule, device: torch.device, enabled: bool = True
                  ) -> Warmup | None:
        """The graph's warm-up; None when off, on CPU, or with nothing to warm."""
        if not enabled or device.type != "cuda":
            return None
        try:
            calls = plan(gm)
        except Exception as e:  # a graph this module does not understand: no warm-up
            log.info("kiln: no first-call warm-up (%s: %s)", type(e).__name__, e)
            return None
        return Warmup(calls, device) if calls else None

    def __call__(self, stop: threading.Event | None = None) -> None:
        may_draw = threading.get_ident() == self._owner
        while stop is None or not stop.is_set():
            with self._lock:
                if not self.left:
                    return
                call = self.left.pop(0)
            self.ran += run_on([call], self.device, may_draw=may_draw)
