"""Compile an ATen graph for the client and load it: request, key, store, farm, load.

The request's target follows the example inputs' device: a CUDA graph targets the
device's own arch (``cuda:3`` and ``cuda:0`` give the same key: ordinals are not part of
it), a CPU graph ``compiler.driver.DEFAULT_TARGETS["cpu"]``. A hit loads the stored
artifact and runs no compiler; a miss goes through ``frontend.core.client``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any

import torch

from kiln.compiler import debug, trace
from kiln.compiler.compiled_graph import CompiledGraph, load
from kiln.compiler.driver import DEFAULT_TARGETS
from kiln.compiler.request import CompileRequest
from kiln.compiler.runtime.buckets import NewBucket
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.client import CompileResult, KilnClient, client_for
from kiln.frontend.core.graphs import graph_constants, graph_device, observers, output_code
from kiln.frontend.core.serialize import make_request
from kiln.frontend.core.warmup import Warmup
from kiln.frontend.trace import flush as flush_trace
from kiln.frontend.trace import write_trace
from kiln.workers import foreground

log = logging.getLogger("kiln.compile")


# Errors that say a verified artifact is itself broken (its wrapper does not parse, names
# something that is not there): it is quarantined and rebuilt. Others (a library this
# machine cannot map, a device error) are this machine's: a load error, eager, no repair.
ARTIFACT_DEFECTS = (SyntaxError, AttributeError, NameError, KeyError, TypeError, ValueError,
                    ImportError, IndexError)


class LoadFailure(RuntimeError):
    """A compiled graph (a hit, or just compiled) that could not be loaded here."""

    stage = "load"


def cuda_target(arch: int, sm_count: int) -> dict[str, Any]:
    """The target of a CUDA GPU of compute capability ``arch`` (90 for sm_90) with
    ``sm_count`` multiprocessors: what a client on that GPU derives, and what
    ``kiln precompile --gpu`` builds for."""
    return {"kind": "cuda", "backend": "cuda", "arch": int(arch), "warp_size": 32,
            "sm_count": int(sm_count)}


def target_for(device: torch.device) -> dict[str, Any]:
    """The compile target of a device: its GPU arch, or the CPU default."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return cuda_target(major * 10 + minor, sms)
    cpu: dict[str, Any] = dict(DEFAULT_TARGETS["cpu"])  # type: ignore[call-overload]
    return cpu


def request_options(config: KilnConfig, name: str = "") -> dict[str, Any]:
    """Options that reach the compiler and the key: those that change compiled code
    (``frontend.config.SETTINGS``'s ``in_key``; autotuning changes chosen configs), and,
    only when on, max-autotune (matmuls lower otherwise; fp32 templates follow torch's
    TF32 flag). An inference graph (``name`` from ``aot_kiln``) returns only the user's
    outputs: they may keep a padded matmul's row stride (no copy to eager's strides)."""
    options = config.compiler_options()
    if name.startswith("inference_"):
        options["padded_outputs"] = True
    if config.max_autotune:
        options.update(max_autotune=True, allow_tf32=bool(torch.backends.cuda.matmul.allow_tf32))
    if torch.are_deterministic_algorithms_enabled():
        options["deterministic"] = True  # scatters run ATen's sorted kernels, not atomics
    return options


def build_request(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                  config: KilnConfig, target: dict[str, Any] | None = None,
                  name: str = "") -> CompileRequest:
    target = target if target is not None else target_for(graph_device(gm, example_inputs))
    return make_request(gm, example_inputs, options=request_options(config, name),
                        target=target)


def compile_request(request: CompileRequest, config: KilnConfig, name: str = "graph"
                    ) -> CompileResult:
    """Look up or compile one request (no loading): what ``kiln precompile`` and the
    benchmarks use for targets this machine cannot run."""
    return client_for(config).compile(request, name)


def compile_and_load(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                     config: KilnConfig, name: str) -> Callable[..., Any]:
    """The graph's callable, from the store or compiled; background tuning of graphs
    compiled before waits meanwhile (``workers.foreground``)."""
    with foreground.compiling():
        return _compile_and_load(gm, example_inputs, config, name)


def _compile_and_load(gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                      config: KilnConfig, name: str) -> Callable[..., Any]:
    start = time.perf_counter()
    began_us = trace.now_us()
    with trace.span("serialize request", cat="client", graph=name):
        request = build_request(gm, example_inputs, config, name=name)
    built = time.perf_counter()
    client = client_for(config)
    regional = compile_as_regions(client, gm, example_inputs, config, name, request)
    if regional is not None:
        flush_trace()
        return regional
    warm = Warmup.for_graph(gm, graph_device(gm, example_inputs), config.warm_first_call)
    result = client.compile(request, name, count_hit=False, warm=warm)
    loaded_at = time.perf_counter()
    build = _builder(gm, example_inputs, config, name)
    try:
        with trace.span("load graph", cat="client", graph=name, source=result.source,
                        kernels=len(result.compiled.kernels)):
            fn = _loaded(build, result, request, client)
    except Exception as e:
        if result.source != "hit" or not isinstance(e, ARTIFACT_DEFECTS):
            client.loaded(result, ok=False)
            raise LoadFailure(f"{type(e).__name__}: {e}") from e
        # A stored artifact that verified but does not load: set aside and rebuilt.
        client.counters.add(load_errors=1)
        result = client.repair(request, name, e)
        try:
            fn = _loaded(build, result, request, client)
        except Exception as again:
            client.loaded(result, ok=False)
            raise LoadFailure(f"{type(again).__name__}: {again}") from again
    client.loaded(result, ok=True)
    done = time.perf_counter()
    result.timings.update(request_s=built - start, load_s=done - loaded_at,
                          backend_s=done - start)
    _debug_dump(config, name, request, result, began_us)
    print_output_code(config, name, result)
    log.debug("kiln graph %s key %s: %s in %.1f ms (%s)", name, result.key.key[:16],
              result.source, 1000 * (done - start),
              ", ".join(f"{k} {1000 * v:.1f} ms" for k, v in result.timings.items()))
    _notify(name, result)
    flush_trace()
    return fn


def _builder(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: KilnConfig,
             name: str) -> Callable[[CompiledGraph, NewBucket | None], Callable[..., Any]]:
    """How this graph's compiled form becomes its callable (its constants, its device,
    CUDA graphs if asked): for the first kernels, and again for tuned ones."""
    constants, device = graph_constants(gm), graph_device(gm, example_inputs)

    def build(compiled: CompiledGraph, on_new_bucket: NewBucket | None = None
              ) -> Callable[..., Any]:
        with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
            fn = load(compiled, constants, device, on_new_bucket)
        if config.cudagraphs:
            from kiln.compiler.runtime.cudagraphs import cudagraphify

            fn = cudagraphify(fn, compiled.device_type, example_inputs, name,
                              compiled.stats.get("mutated_inputs", []))
        return fn

    return build


def _loaded(build: Callable[[CompiledGraph, NewBucket | None], Callable[..., Any]],
            result: CompileResult, request: CompileRequest, client: KilnClient
            ) -> Callable[..., Any]:
    """The graph's callable: one that switches to tuned kernels while it runs where
    tuning may still come (``frontend.core.hotswap``), else the loaded wrapper itself."""
    from kiln.frontend.core.first_call import FirstCallSpan
    from kiln.frontend.core.hotswap import SwappableGraph, wants_swap

    if not wants_swap(result.compiled, request, result.source, client):
        fn = build(result.compiled, None)
        return FirstCallSpan(fn, result.key.key) if trace.recording() else fn
    recorded = result.recorded_compile_s or result.timings.get("compile_s", 0.0)
    return SwappableGraph(build, result.compiled, client, result.key,
                          request, recorded)


def compile_as_regions(client: KilnClient, gm: torch.fx.GraphModule,
                       example_inputs: Sequence[Any], config: KilnConfig, name: str,
                       request: CompileRequest) -> Callable[..., Any] | None:
    """A large graph compiled as regions (``frontend.core.regions``); None: compile it whole."""
    from kiln.frontend.core.regions import compile_regional, wanted

    if not wanted(gm, example_inputs, config):
        return None
    return compile_regional(client, gm, example_inputs, config, name, request)


def load_stored(result: CompileResult, constants: dict[str, torch.Tensor],
                device: torch.device, config: KilnConfig, name: str,
                client: KilnClient | None = None) -> Callable[..., Any]:
    """Load a graph the store gave for a key alone (the AOT cache's warm path: no request,
    so no repair here: a graph that does not load raises :class:`LoadFailure` and the
    caller takes the traced path, which repairs it). A graph with dynamic sizes that this
    process can tune (``client`` given) is a ``SwappableGraph``: each size bucket it meets
    that its artifact has no tuned config for is tuned here, switched to and published,
    from the request's parts that its manifest keeps."""
    from kiln.frontend.core.hotswap import SwappableGraph, wants_swap

    stored = result.stored_request
    try:
        with trace.span("load graph", cat="client", graph=name, source="aot cache hit",
                        kernels=len(result.compiled.kernels)):
            if client is not None and stored is not None and wants_swap(
                    result.compiled, stored, result.source, client):
                def build(compiled: CompiledGraph, on_new_bucket: NewBucket | None = None
                          ) -> Callable[..., Any]:
                    with torch.cuda.device(device) if device.type == "cuda" else nullcontext():
                        return load(compiled, constants, device, on_new_bucket)

                fn: Callable[..., Any] = SwappableGraph(
                    build, result.compiled, client, result.key, stored,
                    result.recorded_compile_s)
            else:
                fn = load(result.compiled, constants, device)
    except Exception as e:
        raise LoadFailure(f"{type(e).__name__}: {e}") from e
    print_output_code(config, name, result)
    _notify(name, result)
    if trace.recording():
        from kiln.frontend.core.first_call import FirstCallSpan

        return FirstCallSpan(fn, result.key.key)
    return fn


def print_output_code(config: KilnConfig, name: str, result: CompileResult) -> None:
    """``KILN_LOGS=output_code``: the graph's wrapper and kernels, on stderr."""
    if "output_code" in config.logs.split(","):
        print(f"# ==== kiln output code: graph {name} (key {result.key.key}, "
              f"{result.source}) ====\n{output_code(result.compiled)}", file=sys.stderr)


def _notify(name: str, result: CompileResult) -> None:
    for observer in list(observers):
        observer(name, result)


def _debug_dump(config: KilnConfig, name: str, request: CompileRequest,
                result: CompileResult, began_us: float) -> None:
    """With ``KILN_DEBUG``: the request and its key parts (for ``kiln explain-miss``) and
    the output code, whichever way the graph came (a hit, the farm, this process); the
    compiler's own IR dumps are written where it ran in this process."""
    if not config.debug:
        return
    import json

    options = config.debug_options()
    folder = debug.debug_dir(f"{name}_request", options)
    (folder / "request.msgpack").write_bytes(request.to_bytes())
    (folder / "output_code.py").write_text(output_code(result.compiled) + "\n")
    if trace.recording():
        # This graph's spans: those that began since its compile did.
        write_trace(folder / "trace.json",
                    [e for e in trace.events() if float(e.get("ts", 0)) >= began_us])
    (folder / "key.json").write_text(json.dumps(
        {"key": result.key.key, "parts": result.key.parts, "source": result.source,
         "lookup": result.lookup, "timings": result.timings}, indent=2) + "\n")
    log.info("kiln: request of graph %s (key %s) saved in %s", name, result.key.key, folder)
