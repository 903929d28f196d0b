"""The ``kiln`` Dynamo backend: AOTAutograd with Kiln's decompositions, then each forward
and backward ATen graph compiled by Kiln and loaded as a callable.

Graphs with symbolic sizes (dynamic shapes) compile once for every size Dynamo's guards
admit. A graph Kiln cannot compile (a size it cannot encode, a compile error) runs eagerly, with one
warning naming the graph and the stage; the backend never raises into the user's program.
"""

from __future__ import annotations

import gc
import itertools
import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from kiln.compiler import trace
from kiln.compiler.decompositions import kiln_decompositions
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.fallback import eager_instead, warn_eager
from kiln.frontend.trace import flush as flush_trace
from kiln.frontend.trace import start_recording, trace_path
from kiln.workers import foreground

log = logging.getLogger("kiln.backend")
_graph_ids = itertools.count()


def kiln_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                 mode: str | None = None, options: dict[str, Any] | None = None
                 ) -> Callable[..., Any]:
    """``torch.compile(model, backend="kiln", options={...})``."""
    with older_objects_frozen():
        return _compile_frame(gm, example_inputs, mode, options)


_freeze_depth = 0
_freeze_lock = threading.Lock()


@contextmanager
def older_objects_frozen() -> Iterator[None]:
    """While the outermost compile runs, Python's garbage collector leaves alone the
    objects that existed before it (``gc.freeze``); what the compile makes is collected as
    usual. A full collection of a process holding a model, torch and Dynamo's state took
    0.9 and 1.2 s, twice, in HF GPT-2's cold compile on the CPU machine (on the H200 host
    one landed in the AOT cache key: its 0.32 s). The objects go back to the collector
    (``gc.unfreeze``) when the compile returns. Nothing is done where the program froze
    objects itself or turned the collector off."""
    global _freeze_depth
    with _freeze_lock:
        outermost = _freeze_depth == 0 and gc.isenabled() and gc.get_freeze_count() == 0
        if outermost or _freeze_depth:
            _freeze_depth += 1
        if outermost:
            gc.freeze()
    try:
        yield
    finally:
        with _freeze_lock:
            if _freeze_depth:
                _freeze_depth -= 1
                if _freeze_depth == 0:
                    gc.unfreeze()


def _compile_frame(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                   mode: str | None, options: dict[str, Any] | None) -> Callable[..., Any]:
    from kiln.frontend.core.aot.cache import AotCache

    config = KilnConfig.resolve(options).with_mode(mode)
    if start_recording(config.debug):
        register_dynamo_spans()
    # A warm start: the graph AOTAutograd made of this one last time, with no trace.
    looked_up = AotCache(config).lookup(gm, example_inputs)
    if callable(looked_up):
        return looked_up
    from kiln.frontend.core.client import client_for
    from kiln.frontend.core.regions import overlap_backward, prestart

    prestart(gm, config)  # graph-stage processes start while AOTAutograd traces
    client_for(config).connect_farm_early()  # and the farm's connection is made

    def graph_compiler(graph: torch.fx.GraphModule, inputs: Sequence[Any], name: str) -> Any:
        fn = compile_aten_graph(graph, inputs, config, name)
        looked_up.record(name, graph, inputs, fn)
        return fn

    with looked_up.listening():
        compiled = aot_kiln(gm, example_inputs, graph_compiler,
                            backward_now=overlap_backward(gm, config))
    looked_up.finish()
    # An inference graph AOTAutograd's runtime would only call: called directly.
    direct = looked_up.direct() if config.inference_direct else None
    return direct if direct is not None else compiled


GraphCompiler = Callable[[torch.fx.GraphModule, Sequence[Any], str], Any]


def aot_kiln(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
             graph_compiler: GraphCompiler,
             device_model: Callable[[torch.fx.GraphModule], Any] | None = None,
             backward_now: bool = False) -> Callable[..., Any]:
    """Dynamo's graph through Kiln's FX passes and AOTAutograd (Kiln's decompositions);
    each forward, backward or inference ATen graph goes to ``graph_compiler(graph,
    inputs, name)``. The one path every caller shares, so that ``kiln precompile`` on
    fake devices makes exactly the ATen graphs (and keys) that a real client makes
    (``device_model``: an FX pass standing in for what a GPU it does not have decides
    at trace time). ``backward_now``: a training graph's backward is compiled right
    after its forward (not at the first backward call, AOTAutograd's default), and
    regional graphs wait for their regions at their first call (``regions_deferred``):
    forward and backward compile on the farm at once."""
    from torch._dynamo.backends.common import aot_autograd

    model_id = next(_graph_ids)
    from kiln.compiler.fx_passes import fuse_attention

    fuse_attention(gm)  # attention as one flash-attention call, on GPU graphs
    if device_model is not None:
        device_model(gm)

    def compiler(kind: str) -> Callable[..., Any]:
        def compile_fn(graph: torch.fx.GraphModule, inputs: Sequence[Any]) -> Any:
            with foreground.compiling(f"{kind}_{model_id}"):
                compiled = graph_compiler(graph, inputs, f"{kind}_{model_id}")
            if kind == "forward":  # its backward comes at the first backward pass:
                foreground.expect(f"backward_{model_id}")  # tuning waits for it
            return compiled

        return compile_fn

    with trace.span("AOTAutograd (compiles inside)", cat="client", model=model_id,
                    nodes=len(gm.graph.nodes)), _backward_now(backward_now):
        return aot_autograd(fw_compiler=compiler("forward"),
                            bw_compiler=compiler("backward"),
                            inference_compiler=compiler("inference"),
                            decompositions=kiln_decompositions(),
                            keep_inference_input_mutations=True)(gm, example_inputs)


@contextmanager
def _backward_now(wanted: bool) -> Iterator[None]:
    """AOTAutograd compiles backward graphs at once, and regional graphs return before
    their regions are compiled (nothing where ``wanted`` is false, or where this torch
    has no such AOTAutograd setting)."""
    from torch._functorch import config as functorch_config

    from kiln.frontend.core.regions import regions_deferred

    if not wanted or not hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        yield
        return
    with functorch_config.patch(force_non_lazy_backward_lowering=True), regions_deferred():
        yield


def compile_aten_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                       config: KilnConfig, name: str) -> Callable[..., Any]:
    """Compile one ATen graph; on any failure, the eager graph with one warning."""
    from torch._functorch.aot_autograd import make_boxed_func

    from kiln.frontend.core.opaque import without_opaque_inputs

    try:
        stripped = without_opaque_inputs(gm, example_inputs)
    except ValueError as e:
        warn_eager(name, "graph check", str(e))
        return make_boxed_func(gm.forward)
    if stripped is not None:  # a mesh or process group the graph passes along
        inner, inputs, where = stripped
        return where.wrap(compile_aten_graph(inner, inputs, config, name))
    reason = unsupported_reason(example_inputs)
    if reason is not None:
        warn_eager(name, "graph check", reason)
        return make_boxed_func(gm.forward)
    try:
        from kiln.frontend.core.compile import compile_and_load

        return compile_and_load(gm, example_inputs, config, name)
    except Exception as e:  # the user's program must keep running
        return eager_instead(gm, name, e)


class _DynamoSpans:
    """Dynamo's whole compile of a frame (its trace, AOT, Kiln) as a span, through
    torch's compile callbacks; registered when a timeline is asked for."""

    def __init__(self) -> None:
        self.started: dict[int, float] = {}

    def start(self, *args: Any) -> None:
        import threading

        self.started[threading.get_ident()] = trace.now_us()

    def end(self, *args: Any) -> None:
        import threading

        began = self.started.pop(threading.get_ident(), None)
        if began is not None and trace.recording():
            trace.complete("Dynamo compile of a frame", began, trace.now_us(), cat="client")
            flush_trace()


_dynamo_spans = _DynamoSpans()


def register_dynamo_spans() -> None:
    """Time Dynamo's compiles (idempotent; ``torch._dynamo.reset()`` drops callbacks, so
    the backend calls it again: frames compiled after a reset are timed from the next)."""
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # a torch without compile callbacks: no Dynamo span
        return
    if _dynamo_spans.start not in callback_handler.start_callbacks:
        callback_handler.register_start_callback(_dynamo_spans.start)
        callback_handler.register_end_callback(_dynamo_spans.end)


def reach_farm_early(config: KilnConfig) -> None:
    """Before Dynamo starts, with ``KILN_FARM_PROCESS=1``: a farm that is up is reached
    through a child process (``frontend.transports.process``), started now so that it has imported
    Ray and joined by the first miss. (A farm joined in this process, the default, is joined
    on a thread when the backend is called.)"""
    from kiln.frontend.transports.base import INPROCESS
    from kiln.frontend.transports.modes import connect_early, farm_for
    from kiln.frontend.transports.process import wanted

    if config.farm.strip().lower() != INPROCESS and wanted():
        try:
            connect_early(farm_for(config.farm))
        except Exception as e:  # the first miss tries again and reports it
            log.debug("kiln: reaching the farm early failed: %s", e)


# torch.compile imports this module when it looks the backend up, before Dynamo starts.
_config_at_import = KilnConfig.resolve()
if trace_path() or _config_at_import.debug:
    start_recording(True)
    register_dynamo_spans()
reach_farm_early(_config_at_import)


def unsupported_reason(example_inputs: Sequence[Any]) -> str | None:
    for i, x in enumerate(example_inputs):
        if isinstance(x, (torch.SymFloat, torch.SymBool)):
            return f"input {i} is a {type(x).__name__}; Kiln compiles integer sizes only"
        if isinstance(x, torch.Tensor) and x.device.type not in ("cpu", "cuda"):
            return f"input {i} is on {x.device.type}, which Kiln does not target"
    return None
