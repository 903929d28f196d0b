"""Regional compilation, the client's half: a large ATen graph compiled as regions, in
parallel, identical regions once.

    key = compute_key(whole request)
    store manifest of key, kind "regions"  hit  -> each distinct region's artifact (hits)
                                                   -> stitched callable; nothing compiles
    miss -> compiler.regions.split_graph: regions cut where few values are live
         -> a canonical request per region; identical layers, identical keys
         -> each distinct key once, all at once: the farm's workers when a farm is up,
            else this process with its graph stages in a few child processes
            (``workers.stage_pool``: the graph stage holds the GIL)
         -> compiler.runtime.stitch: regions in order, each value freed after its last use
         -> the plan (region keys, where each value comes from) published under the
            whole graph's key: a warm start reads one manifest, then its regions

A frame whose graphs will be cut, with a farm up (``overlap_backward``), compiles a
training backward right after its forward, and each graph returns as soon as its regions
are submitted (``DeferredGraph``) and waits for them at its first call: the farm compiles
forward and backward at once, the backward's regions go on compiling while the forward
runs, and an inference graph's while AOTAutograd and Dynamo finish the frame.

``KILN_REGIONS`` (auto, on, off) and ``KILN_REGION_NODES`` choose which graphs are cut and
how finely. A region that fails to compile raises an error naming the region and the
graph; the backend then runs that graph eagerly, with one warning.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from kiln.artifact_store import Artifact
from kiln.compiler import trace
from kiln.compiler.compiled_graph import load
from kiln.compiler.errors import KilnCompileError
from kiln.compiler.keys import KeyInfo, compute_key
from kiln.compiler.regions import Region, Source, Split, compute_nodes, split_graph
from kiln.compiler.request import CompileRequest
from kiln.compiler.runtime.stitch import Step, schedule, stitch
from kiln.frontend.config import REGION_AUTO_NODES, KilnConfig
from kiln.frontend.core.client import CompileResult, KilnClient
from kiln.frontend.core.serialize import make_request
from kiln.frontend.trace import flush as flush_trace

log = logging.getLogger("kiln.regions")

REGIONS_KIND = "regions"
PLAN_LAYOUT = 2  # 2: the plan names the whole graph's inputs (the AOT cache checks them)
MIN_REGION_NODES = 16
MAX_SUBMITTED = 64
_KEY_RE = re.compile(r"[0-9a-f]{64}")


class RegionCompileError(KilnCompileError):
    """One region of a graph did not compile (the message names region and graph)."""


# ---------------------------------------------------------------------------------------
# Which graphs.


def region_nodes(config: KilnConfig) -> int:
    return max(MIN_REGION_NODES, config.region_nodes)


def wanted(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: KilnConfig
           ) -> bool:
    """Whether to compile ``gm`` as regions: static shapes, no CUDA graphs, no list ops,
    and large enough (``auto``) or any size that makes two regions (``on``).

    A graph of ``_foreach_*`` ops (a compiled optimizer step) stays whole: its lowering
    fuses each parameter's chain of list ops into one kernel, and regions cut the chain
    (BERT's AdamW step on the H100: about 17 kernels per parameter, 5656 launches a
    training step against Inductor's 869); it has no repeated layers to share anyway."""
    if config.regions == "off" or config.cudagraphs:
        return False
    if any(n.op == "call_function" and getattr(n.target, "__name__", "").startswith(
            "_foreach_") for n in gm.graph.nodes):
        return False
    if any(isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(
            isinstance(d, torch.SymInt) for d in x.shape)) for x in example_inputs):
        return False
    nodes = len(compute_nodes(gm))
    if config.regions == "on":
        return nodes >= 2 * region_nodes(config)
    return nodes >= REGION_AUTO_NODES


# ---------------------------------------------------------------------------------------
# The plan: what the store keeps under the whole graph's key.


@dataclass(frozen=True)
class RegionPlan:
    key: str
    inputs: tuple[Source, ...]
    strides: tuple[tuple[int, ...] | None, ...]
    constants: tuple[int, ...]
    num_outputs: int
    label: str

    def to_wire(self) -> dict[str, Any]:
        return {"key": self.key, "inputs": [s.to_wire() for s in self.inputs],
                "strides": [None if s is None else list(s) for s in self.strides],
                "constants": list(self.constants), "outputs": self.num_outputs,
                "label": self.label}

    @staticmethod
    def from_wire(wire: Any) -> RegionPlan:
        key, inputs, strides = wire["key"], wire["inputs"], wire["strides"]
        if not (isinstance(key, str) and _KEY_RE.fullmatch(key)):
            raise ValueError("a region key is not a sha256 hex digest")
        if not isinstance(inputs, list) or not isinstance(strides, list) or \
                len(inputs) != len(strides):
            raise ValueError("region inputs and strides do not match")
        return RegionPlan(key, tuple(Source.from_wire(s) for s in inputs),
                          tuple(None if s is None else _ints(s) for s in strides),
                          _ints(wire["constants"]), _int(wire["outputs"]),
                          str(wire.get("label", ""))[:200])


@dataclass(frozen=True)
class Plan:
    num_inputs: int
    regions: tuple[RegionPlan, ...]
    outputs: tuple[Source, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"num_inputs": self.num_inputs,
                "regions": [r.to_wire() for r in self.regions],
                "outputs": [s.to_wire() for s in self.outputs]}

    @staticmethod
    def from_wire(wire: Any, num_inputs: int, num_constants: int) -> Plan:
        """A plan from a (verified) manifest, checked against this graph: every index in
        range, every value made before it is read (``ValueError`` otherwise)."""
        if wire.get("num_inputs") != num_inputs:
            raise ValueError("the plan is for another number of inputs")
        regions = tuple(RegionPlan.from_wire(r) for r in wire["regions"])
        plan = Plan(num_inputs, regions, tuple(Source.from_wire(s) for s in wire["outputs"]))
        if any(c >= num_constants for r in regions for c in r.constants):
            raise ValueError("the plan names a constant the graph does not have")
        schedule([Step(_no_call, r.inputs, r.strides, r.num_outputs) for r in regions],
                 plan.outputs, num_inputs)
        return plan


def _no_call(args: list[Any]) -> tuple[Any, ...]:
    raise AssertionError("a plan being checked is never run")


def _int(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"expected a count, got {value!r:.40}")
    return value


def _ints(values: Any) -> tuple[int, ...]:
    if not isinstance(values, list):
        raise ValueError("expected a list of counts")
    return tuple(_int(v) for v in values)


def plan_manifest(key: KeyInfo, request: CompileRequest, plan: Plan, wall: float
                  ) -> dict[str, Any]:
    return {"kind": REGIONS_KIND, "layout": PLAN_LAYOUT, "key": key.key,
            "key_parts": dict(key.parts), "target": request.target,
            "versions": request.versions, "options": request.options,
            "inputs": [meta.to_wire() for meta in request.inputs],
            "plan": plan.to_wire(), "compile": {"wall_s": wall, "mode": REGIONS_KIND}}


class WholeGraphStored(Exception):
    """The store holds the whole graph compiled as one (``kiln precompile``, or a client
    with regions off): that artifact is used."""


def stored_plan(client: KilnClient, key: str, num_inputs: int, num_constants: int
                ) -> Plan | None:
    """The region plan stored under the whole graph's key; None if there is none (or it
    is unusable); ``WholeGraphStored`` if the key holds a whole compiled graph."""
    manifest = client.store.get_manifest(key)
    if not manifest:
        return None
    if manifest.get("kind") != REGIONS_KIND:
        raise WholeGraphStored(key)
    try:
        return read_plan(manifest, key, num_inputs, num_constants)
    except ValueError as e:
        log.warning("kiln: the region plan stored under %s cannot be used (%s); the graph "
                    "is cut and compiled again", key[:16], e)
        return None


def read_plan(manifest: Any, key: str, num_inputs: int, num_constants: int) -> Plan:
    """The plan of a verified manifest stored under ``key``, checked against a graph of
    ``num_inputs`` inputs and ``num_constants`` constants; ``ValueError`` says why not."""
    try:
        if not isinstance(manifest, dict) or manifest.get("kind") != REGIONS_KIND:
            raise ValueError("not a region plan")
        if manifest.get("layout") != PLAN_LAYOUT or manifest.get("key") != key:
            raise ValueError("another layout or key")
        return Plan.from_wire(manifest["plan"], num_inputs, num_constants)
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ValueError(f"{type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------------------
# Compiling.


_regional: dict[str, str] = {}  # graph name -> its whole graph's key
_stored: set[str] = set()  # regional graphs whose plan is in the store (or was found)
# Told (graph name, stored) when a regional graph's plan is stored or found (True), or its
# regions failed and it runs eagerly (False): the AOT cache's entries wait for their plans.
plan_observers: list[Callable[[str, bool], None]] = []


def regional_key(name: str) -> str | None:
    """The whole graph's key where graph ``name`` of this process was compiled as regions
    (its plan is stored under that key), else None."""
    return _regional.get(name)


def plan_stored(name: str) -> bool:
    """Whether regional graph ``name``'s plan is in the store (published or found)."""
    return name in _stored


def _plan_done(name: str, stored: bool) -> None:
    if stored:
        _stored.add(name)
    for observer in list(plan_observers):
        try:
            observer(name, stored)
        except Exception as e:  # an observer's failure must not cost the graph
            log.warning("kiln: a region plan observer failed (%s: %s)", type(e).__name__, e)


def compile_regional(client: KilnClient, gm: torch.fx.GraphModule,
                     example_inputs: Sequence[Any], config: KilnConfig, name: str,
                     request: CompileRequest) -> Callable[..., Any] | None:
    """The stitched callable of ``gm`` compiled as regions, or None where the graph does
    not cut into two regions or more (the caller compiles it whole)."""
    from kiln.frontend.core.graphs import graph_constants, graph_device

    start = time.perf_counter()
    key = compute_key(request)
    constants = list(graph_constants(gm).values())
    device = graph_device(gm, example_inputs)
    try:
        plan = stored_plan(client, key.key, len(example_inputs), len(constants))
    except WholeGraphStored:
        return None  # the caller's lookup finds it
    if plan is not None:
        fn = _load_stored(client, plan, constants, device, name)
        if fn is not None:
            client.counters.add(region_plan_hits=1)
            _regional[name] = key.key
            _plan_done(name, True)
            return fn
    with trace.span("cut into regions", cat="client", graph=name):
        split = split_graph(gm, list(example_inputs), region_nodes(config))
    if split is None:
        return None
    _regional[name] = key.key
    with trace.span("regional compile", cat="client", graph=name,
                    regions=len(split.regions)):
        submitted = _submit_split(client, split, request, key, config, name)
        finish = _Finish(submitted, constants, device, start, config)
        if not (deferring() and name.startswith(DEFERRED_GRAPHS)):
            try:
                return finish()
            except Exception:
                _plan_done(name, False)
                raise
    return DeferredGraph(finish, gm, name)


@dataclass(frozen=True)
class _Submitted:
    """A split graph's distinct regions, submitted: one future per distinct key."""

    client: KilnClient
    split: Split
    request: CompileRequest
    key: KeyInfo
    keys: list[KeyInfo]
    first: dict[str, int]  # distinct key -> index of its first region
    futures: dict[str, Future[CompileResult]]
    name: str


def _submit_split(client: KilnClient, split: Split, request: CompileRequest, key: KeyInfo,
                  config: KilnConfig, name: str) -> _Submitted:
    requests = [make_request(r.gm, r.example_inputs, options=request.options,
                             target=request.target, versions=request.versions)
                for r in split.regions]
    keys = [compute_key(r) for r in requests]
    first: dict[str, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k.key, i)
    futures = submit_distinct(client, config, {k: (split.regions[i], requests[i])
                                               for k, i in first.items()}, name)
    return _Submitted(client, split, request, key, keys, first, futures, name)


@dataclass(frozen=True)
class _Finish:
    """Wait for a submitted split's regions, load and stitch them, publish the plan."""

    submitted: _Submitted
    constants: list[torch.Tensor]
    device: torch.device
    start: float
    config: KilnConfig

    def __call__(self) -> Callable[..., Any]:
        s, client, name = self.submitted, self.submitted.client, self.submitted.name
        split, first = s.split, s.first
        results = collect_distinct(s.futures, {k: split.regions[i] for k, i in first.items()},
                                   name)
        calls = {k: _load_region(client, results[k], split.regions[i].constants,
                                 self.constants, self.device) for k, i in first.items()}
        plan = Plan(len(s.request.inputs),
                    tuple(_region_plan(r, s.keys[r.index].key) for r in split.regions),
                    split.outputs)
        fn = stitch([_step(calls[p.key], p) for p in plan.regions], plan.outputs,
                    plan.num_inputs)
        for k, i in first.items():
            notify(f"{name}.region{i}", results[k])
        if "output_code" in self.config.logs.split(","):
            _print_output_code(name, [(split.regions[i].describe(), results[k])
                                      for k, i in first.items()])
        wall = time.perf_counter() - self.start
        client.counters.add(regional_graphs=1, regions=len(split.regions),
                            regions_distinct=len(first))
        stored = client.store.can_publish and client.store.publish(
            Artifact(s.key.key, plan_manifest(s.key, s.request, plan, wall), {}))
        _plan_done(name, bool(stored))
        log.info("kiln: graph %s compiled as %d regions (%d distinct) in %.2fs", name,
                 len(split.regions), len(first), wall)
        return fn


# ---------------------------------------------------------------------------------------
# Deferred waiting: the farm compiles while the client goes on (forward and backward
# at once; an inference graph while the frame's trace ends).


_deferral = threading.local()
DEFERRED_GRAPHS = ("forward_", "backward_", "inference_")  # backend.aot_kiln's names


def overlap_backward(gm: torch.fx.GraphModule, config: KilnConfig) -> bool:
    """Whether Dynamo's graph ``gm`` compiles with its farm work overlapped: a training
    frame's backward compiled at once beside its forward, and each regional graph
    waiting for its regions at its first call (an inference graph's regions then
    compile while AOTAutograd and Dynamo finish the frame: 0.7 s of Dynamo's own work
    after the backend returned, for ResNet-50 on the H200). Where its ATen graphs are
    likely cut into regions and misses go to a farm that is up (whose workers take them
    at once; compiling here, a backward the program never runs would cost this process
    its compile)."""
    if not likely_cut(gm, config):
        return False
    from kiln.frontend.core.client import client_for

    return not compiles_here(client_for(config))


def deferring() -> bool:
    """Whether a regional graph compiled now returns before its regions are compiled."""
    return bool(getattr(_deferral, "on", False))


@contextmanager
def regions_deferred() -> Iterator[None]:
    """While AOTAutograd compiles a training frame's forward and then, at once, its
    backward (``backend.aot_kiln``), each regional graph returns as soon as its regions
    are submitted: the backward's regions are cut and on the farm while the forward's
    compile, and the backward's keep compiling while the forward runs."""
    before = deferring()
    _deferral.on = True
    try:
        yield
    finally:
        _deferral.on = before


class DeferredGraph:
    """A regional graph whose regions were submitted but maybe not compiled yet: its
    first call waits for them (span "wait for regions"), then loads and stitches them.
    A region that failed makes the graph run eagerly from then on, with one warning
    naming the graph and the stage, as a failure at compile time does (the backend's
    ``eager_instead``): the user's program runs on."""

    def __init__(self, finish: Callable[[], Callable[..., Any]], graph: torch.fx.GraphModule,
                 name: str) -> None:
        self._boxed_call = True  # on the instance: AOTAutograd calls it with a list
        self._finish, self.name = finish, name
        self._graph: torch.fx.GraphModule | None = graph
        self._fn: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    def resolve(self) -> Callable[..., Any]:
        with self._lock:
            if self._fn is None:
                self._fn = self._resolved()
            return self._fn

    def _resolved(self) -> Callable[..., Any]:
        from kiln.frontend.core.fallback import eager_instead
        from kiln.workers import foreground

        # Loaded as at compile time (AOTAutograd compiles with autocast off), and a
        # compile on the way to a first output: background tuning here waits for it.
        try:
            with trace.span("wait for regions", cat="client", graph=self.name), \
                    torch._C._DisableAutocast(), foreground.compiling(self.name):
                fn = self._finish()
        except Exception as e:
            assert self._graph is not None  # dropped only once resolved
            _plan_done(self.name, False)
            return eager_instead(self._graph, self.name, e)
        finally:
            flush_trace()
        self._graph = None  # kept only to run eagerly
        return fn

    def __call__(self, args: list[Any]) -> Any:
        fn = self._fn if self._fn is not None else self.resolve()
        return fn(args)


def notify(name: str, result: CompileResult) -> None:
    """Tell ``frontend.core.compile``'s observers (``kiln precompile``'s tally) of a region:
    each distinct region is an artifact of its own."""
    from kiln.frontend.core.graphs import observers

    for observer in list(observers):
        observer(name, result)


def _print_output_code(name: str, regions: list[tuple[str, CompileResult]]) -> None:
    import sys

    from kiln.frontend.core.graphs import output_code

    for label, result in regions:
        print(f"# ==== kiln output code: graph {name}, {label} (key {result.key.key}, "
              f"{result.source}) ====\n{output_code(result.compiled)}", file=sys.stderr)


def _region_plan(region: Region, key: str) -> RegionPlan:
    strides = tuple(tuple(x.stride()) if s.kind == "value" else None
                    for s, x in zip(region.inputs, region.example_inputs))
    return RegionPlan(key, region.inputs, strides, region.constants, region.num_outputs,
                      region.describe())


def _step(call: Callable[[list[Any]], Any], plan: RegionPlan) -> Step:
    return Step(call, plan.inputs, plan.strides, plan.num_outputs)


def submit_distinct(client: KilnClient, config: KilnConfig,
                    todo: dict[str, tuple[Region, CompileRequest]], name: str
                    ) -> dict[str, Future[CompileResult]]:
    """Each distinct region submitted at once (compiled, or found in the store, on
    threads that run on after this returns)."""
    if compiles_here(client):
        attach_stage_pool(client, config)
    workers = max(1, min(MAX_SUBMITTED, len(todo)))
    pool = ThreadPoolExecutor(workers, thread_name_prefix="kiln-region")
    futures = {k: pool.submit(client.compile, request, f"{name}.region{region.index}",
                              count_hit=False)
               for k, (region, request) in todo.items()}
    pool.shutdown(wait=False)  # its threads end when their compiles do
    return futures


def collect_distinct(futures: dict[str, Future[CompileResult]], regions: dict[str, Region],
                     name: str) -> dict[str, CompileResult]:
    """Every region's result; the first failure, by region order, raised as a
    ``RegionCompileError``."""
    results: dict[str, CompileResult] = {}
    for k, future in sorted(futures.items(), key=lambda kv: regions[kv[0]].index):
        error = future.exception()
        if error is not None:
            region = regions[k]
            stage = str(getattr(error, "stage", "compile") or "compile")
            raise RegionCompileError(
                f"{region.describe()} of graph {name} (region key {k[:16]}) failed at "
                f"stage {stage}: {error}", stage=stage, graph=name) from error
        results[k] = future.result()
    return results


def _load_region(client: KilnClient, result: CompileResult, indices: Sequence[int],
                 constants: list[torch.Tensor], device: torch.device
                 ) -> Callable[[list[Any]], Any]:
    """A region's callable; ``indices``: the whole graph's constants it reads, in order."""
    named = {f"_tensor_constant{i}": constants[c] for i, c in enumerate(indices)}
    try:
        fn = load(result.compiled, named, device)
    except Exception:
        client.loaded(result, ok=False)
        raise
    client.loaded(result, ok=True)
    return fn


def load_plan(client: KilnClient, plan: Plan, constants: list[torch.Tensor],
              device: torch.device, name: str) -> Callable[..., Any] | None:
    """A stored plan's stitched callable, every region a verified store hit, loaded as at
    compile time (autocast off); None if a region is missing or does not load (the AOT
    cache's warm path then traces the graph)."""
    with torch._C._DisableAutocast():
        return _load_stored(client, plan, constants, device, name)


MAX_FETCHES = 16


def _fetch_regions(client: KilnClient, keys: list[str]) -> dict[str, CompileResult | None]:
    """Each key's stored graph (verified, as ``client.lookup`` reads it), on up to
    ``MAX_FETCHES`` threads."""
    if len(keys) < 2:
        return {k: client.lookup(k) for k in keys}
    with ThreadPoolExecutor(min(MAX_FETCHES, len(keys)),
                            thread_name_prefix="kiln-region-fetch") as pool:
        return dict(zip(keys, pool.map(client.lookup, keys)))


def _load_stored(client: KilnClient, plan: Plan, constants: list[torch.Tensor],
                 device: torch.device, name: str) -> Callable[..., Any] | None:
    """The stitched callable from stored regions; None if one is missing or unloadable
    (the graph is then cut and compiled again: present regions are hits). The distinct
    regions are fetched at once (a store on another machine answers each in a round
    trip or more), then loaded in order."""
    calls: dict[str, Callable[[list[Any]], Any]] = {}
    found = _fetch_regions(client, list(dict.fromkeys(r.key for r in plan.regions)))
    for index, region in enumerate(plan.regions):
        if region.key in calls:
            continue
        result = found[region.key]
        if result is None:
            return None
        try:
            calls[region.key] = _load_region(client, result, region.constants, constants,
                                             device)
            notify(f"{name}.region{index}", result)
        except Exception as e:  # a region that does not load: compile the graph again
            log.warning("kiln: a stored region of graph %s does not load (%s: %s)", name,
                        type(e).__name__, e)
            return None
    return stitch([_step(calls[r.key], r) for r in plan.regions], plan.outputs,
                  plan.num_inputs)


# ---------------------------------------------------------------------------------------
# Where regions compile: the farm, or here with a few graph-stage processes.


def compiles_here(client: KilnClient) -> bool:
    """Whether the client's misses compile in this process (no farm, or none up)."""
    farm = client.farm
    if farm is client.local or client.farm_down is not None:
        return True
    address = getattr(farm, "address", None)
    return callable(address) and address() is None


def stage_processes(config: KilnConfig) -> int:
    if config.region_processes != "auto":
        return int(config.region_processes)
    return min(4, (os.cpu_count() or 1) // 4)


_pool: Any = None
_pool_lock = threading.Lock()


def stage_pool(config: KilnConfig) -> Any:
    """The process's graph-stage pool (started once), or None for fewer than 2."""
    global _pool
    processes = stage_processes(config)
    if processes < 2:
        return None
    with _pool_lock:
        if _pool is None:
            from kiln.workers.stage_pool import StagePool

            _pool = StagePool(processes)
            atexit.register(_pool.close)
        return _pool


def attach_stage_pool(client: KilnClient, config: KilnConfig) -> None:
    pool = stage_pool(config)
    if pool is not None:
        client.local.stages = pool


# ATen nodes per node of Dynamo's graph, measured with Kiln's decompositions: HF GPT-2
# 929 / 715 = 1.3, the decoders of bench/coldstart_models.py 2.1. A larger guess starts
# child processes for graphs that are then not cut (GPT-2 was one at 3).
ATEN_PER_DYNAMO_NODE = 2


def likely_cut(gm: torch.fx.GraphModule, config: KilnConfig) -> bool:
    """Whether Dynamo's graph ``gm`` will likely make an ATen graph large enough to cut."""
    need = 2 * region_nodes(config) if config.regions == "on" else REGION_AUTO_NODES
    return config.regions != "off" and ATEN_PER_DYNAMO_NODE * len(gm.graph.nodes) >= need


def prestart(gm: torch.fx.GraphModule, config: KilnConfig) -> None:
    """Start the graph-stage processes while Dynamo and AOTAutograd trace, when the
    model's graph is likely to be cut and misses would compile here."""
    if stage_processes(config) < 2 or not likely_cut(gm, config):
        return
    from kiln.frontend.core.client import client_for

    if compiles_here(client_for(config)):
        stage_pool(config)
