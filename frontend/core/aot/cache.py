"""Kiln's cache in front of AOTAutograd: a warm start runs no AOT trace.

    Dynamo graph -> aot_key (frontend.core.aot.dynamo_key)
        store.get(aot key)  an entry -> the Kiln key of the ATen graph AOTAutograd made
                            -> client.lookup(graph key) -> load -> call it, no tracing
                            none -> AOTAutograd as always; afterwards the entry is
                                    published (where this process is a builder)

The entry is a store artifact under the AOT key, signed and verified like any other
(``artifact_store``); what it says is still checked before anything runs
(``frontend.core.aot.entry``: its manifest and blobs, and :func:`entry_from_artifact`, the one
place its bytes become a plan).

Served: exactly what AOTAutograd's runtime would do with it, and nothing it would do
differently. That is one inference graph whose ``ViewAndMutationMeta`` is trivial (no
input mutation, no output aliasing an input or intermediate, no output requiring grad,
no effect tokens, no subclasses, no RNG state, no grad-mode change) and whose inputs are
Dynamo's inputs in order. Its runtime is then: grad off, autocast off if it was on, the
compiled graph called with the inputs. Or one training graph (a forward and its
backward) whose metadata is as simple save that outputs may require grad: served by
Kiln's own ``autograd.Function`` (``frontend.core.aot.training``, which says what is
simple), both graphs loaded at the first call. Its entry is published once the
backward is compiled (at once with ``backward_now``, else at the first backward).
A graph compiled as regions (``frontend.core.regions``) is named by its whole graph's key
too, whose store manifest is its plan (``"regions": true``): served, the plan is read
and checked as a warm compile reads it (``regions.read_plan``: every index in range, the
inputs the plan names equal to Dynamo's), then every region's artifact, each a verified
hit, loaded and stitched; an entry naming regional graphs is published once every plan it
names is stored (a ``DeferredGraph``'s at its first call). A region missing or not loading
at serve time rejects the entry: the graph is traced (and its regions compiled again).
A graph with symbolic sizes (inference only) is served as a static one, its inputs
compared as a request names them and its dynamic outputs marked, where AOTAutograd's
trace added no guard to the shape environment (a served graph adds none: ``"serve":
false``, ``trace_guards``, otherwise).
Anything else (a graph whose runtime does more, a graph run eagerly, a regional graph
whose plan was not stored) is recorded as an entry that is not served (``"serve":
false`` and why), so a warm start knows at once to trace it. A graph that is not keyed
(``NotCacheable``) is traced too. An entry that fails its checks, names a graph that is
gone or whose inputs differ, or does not load is rejected: the graph is traced (and the
entry replaced).

The same test decides whether a graph that was traced (a miss, or the cache off) runs
without AOTAutograd's runtime wrappers: ``Pending.direct`` gives the compiled graph behind
``served_graph`` when they would only call it (``inference_direct``, on by default).

Counters (``kiln stats``): ``aot_hits``, ``aot_misses``, ``aot_traces``,
``aot_uncached`` (and ``aot_uncached_<reason>``), ``aot_publishes``, ``aot_rejected``,
``inference_direct`` (traced graphs called with no AOT runtime wrapper), ``aot_region_plans``
(region plans served).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.artifact_store import Artifact
from kiln.compiler import trace
from kiln.compiler.request import SerializationError, TensorMeta, symint_meta
from kiln.compiler.symwire import SymbolTable, is_static
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.aot.dynamo_key import (
    NotCacheable,
    aot_key,
    symbolic_shape_env,
    traced_value,
)
from kiln.frontend.core.aot.entry import AotEntry, EntryError, entry_from_artifact, to_artifact
from kiln.frontend.core.aot.training import (
    ForwardFacts,
    TrainingPlan,
    forward_facts,
    mutates_inputs,
    plan_with_backward,
    runtime_problem,
    served_training,
)
from kiln.frontend.core.client import CompileResult, KilnClient, client_for
from kiln.frontend.core.compile import LoadFailure, load_stored, request_options, target_for
from kiln.frontend.core.graphs import graph_constants, graph_device, observers
from kiln.frontend.core.regions import (
    DeferredGraph,
    Plan,
    load_plan,
    plan_observers,
    plan_stored,
    read_plan,
    regional_key,
)
from kiln.frontend.trace import flush as flush_trace

log = logging.getLogger("kiln.aot_cache")


# ---------------------------------------------------------------------------------------
# What AOTAutograd made of a graph: servable or not.


def meta_problem(meta: Any) -> str | None:
    """Why AOTAutograd's runtime would do more around this inference graph than call it
    with grad off (a reason counter), or None. Attributes read with defaults that refuse,
    so that a torch without one caches nothing rather than something wrong."""
    if meta is None:
        return "no_metadata"

    if mutates_inputs(meta):
        return "input_mutation"
    if input_aliases(meta) is None:
        return "output_alias_or_grad"
    return runtime_problem(meta, ("subclass_inp_meta", "subclass_fw_graph_out_meta"))


# (output, input, is_input): an output AOTAutograd's runtime makes a view of an input
# (``is_input``: the input itself), not what the compiled graph returned.
Aliases = tuple[tuple[int, int, bool], ...]


def input_aliases(meta: Any) -> Aliases | None:
    """The outputs of an inference graph that alias one of its inputs (``x.detach()``,
    a view, the input itself: the resume graph of a training step that returns
    ``loss.detach()``), none of them requiring grad; None where an output requires grad
    or aliases anything else (an intermediate), which only AOTAutograd's runtime serves."""
    from torch._functorch._aot_autograd.schemas import OutputType

    aliases = []
    for i, o in enumerate(getattr(meta, "output_info", [None])):
        kind, base = getattr(o, "output_type", None), getattr(o, "base_idx", None)
        if getattr(o, "requires_grad", True):
            return None
        if kind in (OutputType.alias_of_input, OutputType.is_input) and type(base) is int:
            aliases.append((i, base, kind is OutputType.is_input))
        elif kind is not OutputType.non_alias:
            return None
    return tuple(aliases)


DynamicOutputs = tuple[tuple[int, frozenset[int]], ...]


def dynamic_outputs(meta: Any) -> DynamicOutputs:
    """The outputs with symbolic sizes and their dimensions: AOTAutograd's runtime marks
    those dimensions on each output it returns (Dynamo then treats them as dynamic where
    the output is an input of another compiled frame), so a graph called without that
    runtime marks them itself (:func:`served_graph`)."""
    return tuple((i, frozenset(o.dynamic_dims))
                 for i, o in enumerate(getattr(meta, "output_info", None) or [])
                 if getattr(o, "dynamic_dims", None))


@dataclass
class _Made:
    """One ATen graph AOTAutograd handed to Kiln for a Dynamo graph: why AOTAutograd's
    runtime must stay around it (``runtime``; None: it would only call it), and why the
    cache cannot serve it (``problem``)."""

    name: str
    problem: str | None
    runtime: str | None = None
    num_inputs: int = 0
    constants: dict[str, torch.Tensor] = field(default_factory=dict)
    fn: Callable[..., Any] | None = None
    dynamic: DynamicOutputs = ()
    aliases: Aliases = ()  # outputs made views of inputs (input_aliases)
    facts: ForwardFacts | None = None  # a training forward's layout
    plan: TrainingPlan | None = None  # a training backward's: the whole plan
    regional: str | None = None  # compiled as regions: the whole graph's (the plan's) key


class Pending:
    """A Dynamo graph on the traced path: what AOTAutograd makes of it is recorded, the
    entry published when done (see the module docstring), and, for an inference graph
    that AOTAutograd's runtime would only call, :meth:`direct` gives the compiled graph
    without that runtime (``frontend.core.backend``)."""

    def __init__(self, cache: AotCache, key: str | None,
                 example_inputs: Sequence[Any]) -> None:
        self.cache = cache
        self.key = key
        self.expected: list[Any] | None = None
        try:
            self.expected = _input_wires(example_inputs)
        except Exception:  # inputs with no wire form: neither served nor called directly
            self.key = None
        self.disable_amp = bool(torch._C._is_any_autocast_enabled())
        # Symbolic sizes: the shape environment, and its guards before AOTAutograd traced.
        # A trace that adds guards is not served (a warm start would not add them).
        self.shape_env = symbolic_shape_env(example_inputs)
        self.guards_before = len(getattr(self.shape_env, "guards", ()))
        self.made: list[_Made] = []
        self.results: dict[str, CompileResult] = {}
        self.backward_observer: Callable[[str, CompileResult], None] | None = None
        self.plan_observer: Callable[[str, bool], None] | None = None
        self.lock = threading.RLock()
        self.finished = False

    def record(self, name: str, graph: torch.fx.GraphModule, inputs: Sequence[Any],
               fn: Callable[..., Any] | None = None) -> None:
        """Called for each ATen graph, once Kiln has compiled (or given up on) it, with
        its callable ``fn``; never raises (a failure here costs the entry and the direct
        call, not the graph)."""
        if self.expected is None:
            return
        try:
            self._record(name, graph, inputs, fn)
        except Exception as e:
            self.expected = None
            self.made.clear()
            if self.key is not None:
                self.key = None
                self.cache.failed("record", e)

    def _record(self, name: str, graph: torch.fx.GraphModule, inputs: Sequence[Any],
                fn: Callable[..., Any] | None) -> None:
        context = torch._guards.TracingContext.try_get()
        meta = getattr(context, "fw_metadata", None)
        if name.startswith(("forward_", "backward_")):
            self._record_training(name, graph, inputs, meta, fn)
            return
        runtime = meta_problem(meta)
        outputs = graph.graph.find_nodes(op="output")[0].args[0]
        if not name.startswith("inference_"):
            runtime = "training"
        elif _input_wires(inputs) != self.expected:
            runtime = "inputs_changed"  # deduplicated, a synthetic base, lifted parameters
        elif meta is not None and runtime is None and len(outputs) != len(meta.output_info):
            runtime = "extra_outputs"
        problem = runtime
        regional = regional_key(name)
        if runtime != "training" and regional is not None:
            problem = problem or _plan_problem(name, fn)
        elif runtime != "training" and name not in self.results:
            problem = "eager_graph"
        dynamic = dynamic_outputs(meta)
        if problem is None and dynamic and self.shape_env is None:
            problem = "dynamic_outputs"  # symbolic outputs of a graph without symbols
        aliases = input_aliases(meta) or () if runtime is None else ()
        if problem is None and not _same_dtypes(aliases, outputs, inputs):
            problem = runtime = "output_alias_or_grad"  # a view as another dtype
        made = _Made(name, problem, runtime, len(inputs), fn=fn, dynamic=dynamic,
                     aliases=aliases, regional=regional)
        if problem is None and self.key is not None:
            made.constants = graph_constants(graph)
        self.made.append(made)

    def _record_training(self, name: str, graph: torch.fx.GraphModule,
                         inputs: Sequence[Any], meta: Any, fn: Callable[..., Any] | None
                         ) -> None:
        """A training graph's forward (its layout) or backward (the whole plan)."""
        problem: str | None = None
        facts: ForwardFacts | None = None
        plan: TrainingPlan | None = None
        dynamic: DynamicOutputs = ()
        if name.startswith("forward_"):
            got = forward_facts(meta, graph, len(inputs))
            dynamic = dynamic_outputs(meta)
            if dynamic and self.shape_env is None:
                problem = "dynamic_outputs"
            elif isinstance(got, str):
                problem = got
            elif _input_wires(inputs) != self.expected:
                problem = "inputs_changed"
            else:
                facts = got
        else:
            forward = self.made[0] if len(self.made) == 1 else None
            if forward is None or forward.facts is None:
                problem = forward.problem if forward is not None else "no_forward"
            else:
                done = plan_with_backward(forward.facts, graph)
                problem, plan = (done, None) if isinstance(done, str) else (None, done)
        regional = regional_key(name)
        if problem is None and regional is not None:
            problem = _plan_problem(name, fn)
        elif problem is None and name not in self.results:
            problem = "eager_graph"
        made = _Made(name, problem or None, "training", len(inputs), fn=fn, facts=facts,
                     plan=plan, regional=regional, dynamic=dynamic)
        if problem is None and self.key is not None:
            made.constants = graph_constants(graph)
        self.made.append(made)
        if name.startswith("backward_") and self.backward_observer is not None:
            observers.remove(self.backward_observer)  # a backward compiled at its first call
            self.backward_observer = None
            self.finish()

    def _awaits_backward(self) -> bool:
        """A training forward that could be served, whose backward is not compiled yet
        (AOTAutograd compiles it at the first backward): the entry waits for it."""
        return len(self.made) == 1 and self.made[0].runtime == "training" \
            and self.made[0].problem is None

    def direct(self) -> Callable[..., Any] | None:
        """The Dynamo graph's callable without AOTAutograd's runtime wrappers, where they
        would do nothing but call the one inference graph with grad (and autocast) off;
        None otherwise."""
        if len(self.made) != 1:
            return None
        made = self.made[0]
        fn = made.fn
        if made.runtime is not None or fn is None or not getattr(fn, "_boxed_call", False):
            return None  # (served_graph passes the inputs as one list)
        self.cache.client.counters.add(inference_direct=1)
        return served_graph(fn, self.disable_amp, made.dynamic, made.aliases)

    @contextmanager
    def listening(self) -> Iterator[None]:
        """Collect the compile results of this thread's graphs while AOTAutograd runs."""
        thread = threading.get_ident()

        def observe(name: str, result: CompileResult) -> None:
            if threading.get_ident() == thread:
                self.results[name] = result

        observers.append(observe)
        try:
            yield
        finally:
            observers.remove(observe)

    def finish(self) -> None:
        """Publish what AOTAutograd made of the graph (an entry served or not), once
        every graph it names is stored: a training graph's once its backward is
        compiled, a regional graph's once its plan is stored (a ``DeferredGraph``'s at
        its first call, on whichever thread makes it). Published once."""
        if self.key is None:
            return
        with self.lock:
            if self.finished:
                return
            if self._awaits_backward():
                if self.backward_observer is None:
                    self._await_backward()
                return
            try:
                entry = self.entry()
            except Exception as e:
                self.finished = True
                self._stop_plan_observer()
                self.cache.failed("publish", e)
                return
            if entry.serve and self._awaits_plans():
                return
            self.finished = True
            self._stop_plan_observer()
        try:
            try:
                artifact = to_artifact(self.key, entry)
            except SerializationError:  # a constant with no value to store
                entry = AotEntry(False, reason="constants")
                artifact = to_artifact(self.key, entry)
            if not entry.serve:
                self.cache.uncached(entry.reason)
            self.cache.publish(artifact)
        except Exception as e:
            self.cache.failed("publish", e)

    def _await_backward(self) -> None:
        backward = "backward_" + self.made[0].name.removeprefix("forward_")

        def observe(name: str, result: CompileResult) -> None:
            if name == backward:  # (on whichever thread runs the backward)
                self.results[name] = result

        self.backward_observer = observe
        observers.append(observe)

    def _awaits_plans(self) -> bool:
        """Whether a regional graph the entry names has no plan stored yet: then the
        entry waits for it (observer registered before looking, so none is missed)."""
        regional = [m.name for m in self.made if m.regional is not None]
        if not regional:
            return False
        if self.plan_observer is None:
            def observe(name: str, stored: bool) -> None:
                if name in regional:
                    self._plan_done(name, stored)

            self.plan_observer = observe
            plan_observers.append(observe)
        return not all(plan_stored(name) for name in regional)

    def _plan_done(self, name: str, stored: bool) -> None:
        with self.lock:
            if not stored:  # its regions failed (run eagerly) or its plan was not stored
                for made in self.made:
                    if made.name == name and made.problem is None:
                        made.problem = "regions"
        self.finish()

    def _stop_plan_observer(self) -> None:
        if self.plan_observer is not None:
            try:
                plan_observers.remove(self.plan_observer)
            except ValueError:
                pass
            self.plan_observer = None

    def entry(self) -> AotEntry:
        if self.made and self.made[0].runtime == "training":
            return self._training_entry()
        if len(self.made) != 1:
            return AotEntry(False, reason="training" if self.made else "no_graph")
        made = self.made[0]
        if made.problem is not None:
            return AotEntry(False, reason=made.problem)
        symbolic = self.shape_env is not None
        if symbolic and len(self.shape_env.guards) != self.guards_before:
            return AotEntry(False, reason="trace_guards")
        if symbolic and made.regional is not None:
            return AotEntry(False, reason="dynamic_regions")
        return AotEntry(True, self._graph_key(made), made.num_inputs, made.constants,
                        regions=made.regional is not None, aliases=made.aliases,
                        symbolic=symbolic, dynamic=made.dynamic)

    def _training_entry(self) -> AotEntry:
        if len(self.made) != 2:
            return AotEntry(False, reason=self.made[0].problem or "training")
        forward, backward = self.made
        problem = forward.problem or backward.problem
        if problem is not None or backward.plan is None:
            return AotEntry(False, reason=problem or "training")
        symbolic = self.shape_env is not None
        if symbolic and len(self.shape_env.guards) != self.guards_before:
            return AotEntry(False, reason="trace_guards")
        if symbolic and (forward.regional or backward.regional):
            return AotEntry(False, reason="dynamic_regions")
        return AotEntry(True, self._graph_key(forward), forward.num_inputs,
                        forward.constants, training=backward.plan,
                        backward=self._graph_key(backward),
                        backward_constants=backward.constants,
                        regions=forward.regional is not None,
                        backward_regions=backward.regional is not None,
                        symbolic=symbolic, dynamic=forward.dynamic)

    def _graph_key(self, made: _Made) -> str:
        """The Kiln key an entry names for a graph: its plan's where it is regional."""
        return made.regional if made.regional is not None else self.results[made.name].key.key


def _same_dtypes(aliases: Aliases, outputs: Sequence[Any], inputs: Sequence[Any]) -> bool:
    """Whether each aliasing output has its input's dtype (a view as another dtype is not
    one :func:`served_graph` makes)."""
    for output, base, _ in aliases:
        val = outputs[output].meta.get("val") if isinstance(outputs[output], torch.fx.Node) \
            else None
        x = inputs[base] if base < len(inputs) else None
        if not isinstance(val, torch.Tensor) or not isinstance(x, torch.Tensor) \
                or val.dtype != x.dtype:
            return False
    return True


def _plan_problem(name: str, fn: Callable[..., Any] | None) -> str | None:
    """None where regional graph ``name``'s plan is stored or will be (a
    ``DeferredGraph``, whose first call stores it); else "regions" (not stored: its
    regions failed, or the store did not take it)."""
    if plan_stored(name) or isinstance(fn, DeferredGraph):
        return None
    return "regions"


# ---------------------------------------------------------------------------------------
# The cache.


@dataclass(frozen=True)
class _Stored:
    """A graph an entry names, found in the store: one compiled graph (``result``) or a
    region plan (``plan``); ``inputs``: the input wires its manifest records."""

    graph: str
    inputs: list[Any] | None
    result: CompileResult | None = None
    plan: Plan | None = None


class AotCache:
    """The AOT cache of one configuration: look a Dynamo graph up, serve it or trace it."""

    def __init__(self, config: KilnConfig) -> None:
        self.config = config
        self.device = torch.device("cpu")  # the looked-up graph's (set by its key)
        self.client: KilnClient = client_for(config)

    def lookup(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
               ) -> Callable[..., Any] | Pending:
        """The compiled graph, served with no AOT trace; or a :class:`Pending` for the
        traced path. Never raises: a problem means tracing."""
        with trace.span("AOT cache lookup", cat="client", nodes=len(gm.graph.nodes)) as span:
            key, served = None, None
            try:
                with trace.span("AOT cache key", cat="client") as parts:
                    key = self._key(gm, example_inputs, parts)
                served = self._serve(key, gm, example_inputs)
            except NotCacheable as e:  # not keyed, or an entry that says: trace it
                key = None
                self.uncached(e.reason)
                span["reason"] = e.reason
                log.debug("kiln: AOT cache: the graph is traced (%s)", e)
            except Exception as e:  # a bug here must cost the trace, not the graph
                key, served = None, None
                self.failed("lookup", e)
            span["hit"] = served is not None
        if served is not None:
            self.client.counters.add(aot_hits=1)
            flush_trace()
            return served
        self.client.counters.add(aot_traces=1)
        traced = _traced_inputs(gm, example_inputs)
        try:
            return Pending(self, key, traced)
        except Exception as e:
            self.failed("lookup", e)
            return Pending(self, None, traced)

    def _key(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
             part_ms: dict[str, float] | None = None) -> str:
        if not self.config.aot_cache:
            raise NotCacheable("off", "KILN_AOT_CACHE=0")
        if self.config.cudagraphs:
            raise NotCacheable("cudagraphs", "CUDA graphs wrap the compiled graph")
        self.device = graph_device(gm, example_inputs)
        target = target_for(self.device)
        return aot_key(gm, example_inputs, request_options(self.config), target, part_ms).key

    def _serve(self, key: str, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
               ) -> Callable[..., Any] | None:
        with trace.span("AOT cache entry", cat="client", key=key[:16]) as found:
            artifact = self.client.store.get(key, kind="aot")
            found["hit"] = artifact is not None
        if artifact is None:
            self.client.counters.add(aot_misses=1)
            return None
        try:
            entry = entry_from_artifact(artifact)
        except EntryError as e:
            return self._reject(key, str(e))
        if not entry.serve:
            raise NotCacheable(entry.reason, "AOTAutograd made a graph the cache cannot serve")
        if entry.num_inputs != len(example_inputs):
            return self._reject(key, f"{entry.num_inputs} inputs, not {len(example_inputs)}")
        result = self._find(key, "graph", entry.graph, entry.regions, entry.num_inputs,
                            len(entry.constants))
        if result is None:
            return None
        if entry.symbolic:  # compared as the request named them (symbols by appearance)
            wires = request_wires([traced_value(n)
                                   for n in gm.graph.find_nodes(op="placeholder")])
        else:
            wires = _input_wires(example_inputs)
        if result.inputs != wires:
            return self._reject(key, f"its graph {entry.graph[:16]} takes other inputs")
        if entry.training is None:
            return self._load(key, entry, result, example_inputs)
        grads = [isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs]
        if grads != list(entry.training.grad_inputs):
            return self._reject(key, "its inputs require grad where these do not")
        plan = entry.training
        count = plan.num_symints + plan.num_saved + len(plan.tangents)
        backward = self._find(key, "backward", entry.backward, entry.backward_regions, count,
                              len(entry.backward_constants))
        if backward is None:
            return None
        if backward.inputs is None or len(backward.inputs) != count:
            return self._reject(key, f"its backward {entry.backward[:16]} takes other inputs")
        return self._load_training(key, entry, result, backward, example_inputs)

    def _find(self, key: str, what: str, graph: str, regions: bool, num_inputs: int,
              num_constants: int) -> _Stored | None:
        """The stored graph an entry names: one compiled graph (``client.lookup``), or,
        where ``regions``, the verified plan stored under its key, checked for a graph
        of ``num_inputs`` inputs and ``num_constants`` constants (its regions are read
        when it loads). None (the entry rejected) when it is not there or not usable."""
        if not regions:
            result = self.client.lookup(graph)
            if result is None:
                self._reject(key, f"its {what} {graph[:16]} is not in the store")
                return None
            return _Stored(graph, result.recorded_inputs, result=result)
        with trace.span("AOT cache region plan", cat="client", key=graph[:16]):
            manifest = self.client.store.get_manifest(graph)
        if manifest is None:
            self._reject(key, f"the region plan of its {what} {graph[:16]} is not in the "
                         "store")
            return None
        try:
            plan = read_plan(manifest, graph, num_inputs, num_constants)
        except ValueError as e:
            self._reject(key, f"the region plan of its {what} {graph[:16]} cannot be used "
                         f"({e})")
            return None
        inputs = manifest.get("inputs")
        return _Stored(graph, inputs if isinstance(inputs, list) else None, plan=plan)

    def _load_one(self, key: str, stored: _Stored, constants: dict[str, torch.Tensor],
                  example_inputs: Sequence[Any]) -> Callable[..., Any] | None:
        if stored.plan is not None:
            return self._load_plan(key, stored.graph, stored.plan, constants, example_inputs)
        result = stored.result
        assert result is not None
        name = result.compiled.name  # as it was called when it was compiled
        try:
            call = load_stored(result, constants, self.device, self.config, name, self.client)
        except LoadFailure as e:
            self._reject(key, f"its graph {result.key.key[:16]} does not load ({e})")
            return None
        self.client.loaded(result, ok=True)
        return call

    def _load_plan(self, key: str, graph: str, plan: Plan,
                   constants: dict[str, torch.Tensor], example_inputs: Sequence[Any]
                   ) -> Callable[..., Any] | None:
        """A regional graph: every region's artifact a verified hit, loaded, stitched."""
        ordered = [constants.get(f"_tensor_constant{i}") for i in range(len(constants))]
        if any(c is None for c in ordered):  # graph_constants' names, in node order
            return self._reject(key, "constants not named as a region plan reads them")
        with trace.span("load region plan", cat="client", key=graph[:16],
                        regions=len(plan.regions)):
            call = load_plan(self.client, plan, ordered,  # type: ignore[arg-type]
                             self.device, f"regions_{graph[:16]}")
        if call is None:
            return self._reject(key, f"a region of graph {graph[:16]} is not in the store "
                                "or does not load")
        self.client.counters.add(aot_region_plans=1)
        return call

    def _load(self, key: str, entry: AotEntry, stored: _Stored,
              example_inputs: Sequence[Any]) -> Callable[..., Any] | None:
        call = self._load_one(key, stored, entry.constants, example_inputs)
        if call is None:
            return None
        return served_graph(call, bool(torch._C._is_any_autocast_enabled()),
                            dynamic=entry.dynamic, aliases=entry.aliases)

    def _load_training(self, key: str, entry: AotEntry, forward: _Stored,
                       backward: _Stored, example_inputs: Sequence[Any]
                       ) -> Callable[..., Any] | None:
        """Both graphs loaded now (cubins load in milliseconds), the backward's failure
        seen before anything runs."""
        assert entry.training is not None
        fw = self._load_one(key, forward, entry.constants, example_inputs)
        bw = fw and self._load_one(key, backward, entry.backward_constants, example_inputs)
        if fw is None or bw is None:
            return None
        served = served_training(fw, bw, entry.training,
                                 bool(torch._C._is_any_autocast_enabled()))
        return _marking_dynamic(served, entry.dynamic) if entry.dynamic else served

    def _reject(self, key: str, why: str) -> Callable[..., Any] | None:
        self.client.counters.add(aot_rejected=1)
        log.warning("kiln: AOT cache entry %s rejected (%s); tracing the graph", key[:16], why)
        return None

    def failed(self, step: str, error: Exception) -> None:
        """An error of the cache itself: the graph is traced, the entry not written."""
        self.uncached("error")
        log.warning("kiln: AOT cache %s failed (%s: %s); the graph is traced", step,
                    type(error).__name__, error, exc_info=log.isEnabledFor(logging.DEBUG))

    def uncached(self, reason: str) -> None:
        self.client.counters.add(aot_uncached=1, **{f"aot_uncached_{reason}": 1})

    def publish(self, artifact: Artifact) -> None:
        if not self.client.store.can_publish:  # a reader: builders publish entries
            return
        with trace.span("AOT cache publish", cat="client",
                        serve=artifact.manifest.get("serve")):
            published = self.client.store.publish(artifact)
        self.client.counters.add(aot_publishes=int(published))


def _traced_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
                   ) -> Sequence[Any]:
    """Dynamo's inputs as it traced them: its fake tensors where a size is symbolic (the
    example inputs are the real tensors, whose sizes are this call's), else the inputs."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if len(placeholders) != len(example_inputs):
        return example_inputs
    traced = []
    for node, x in zip(placeholders, example_inputs):
        val = traced_value(node)
        symbolic = isinstance(val, torch.SymInt) or (
            isinstance(val, torch.Tensor) and not is_static(_layout(val)))
        traced.append(val if symbolic else x)
    return traced


def request_wires(values: Sequence[Any]) -> list[Any] | None:
    """Dynamo's traced inputs as a request names them (``make_request``: symbols
    ``s0, s1, ...`` by first appearance), comparable across processes; None where one
    has no such form."""
    symbols = SymbolTable()
    try:
        return [symint_meta(v, symbols).to_wire() if isinstance(v, torch.SymInt)
                else TensorMeta.from_tensor(v, symbols).to_wire() for v in values]
    except Exception:  # an input with no request form: never equal to a stored graph's
        return None


def _input_wires(inputs: Sequence[Any]) -> list[Any]:
    """What a graph depends on about its inputs, to compare the inputs of AOTAutograd's
    graph with Dynamo's: ``TensorMeta`` wires of tensors with static sizes (as requests
    record them); sizes as Dynamo's expressions for the others (and SymInt inputs),
    which compare equal only under the same shape environment's symbols."""
    return [_input_wire(x) for x in inputs]


def _layout(x: torch.Tensor) -> tuple[Any, ...]:
    """Sizes, strides and storage offset: ints, or SymInts where Dynamo traced symbols."""
    return (*x.shape, *x.stride(), x.storage_offset())


def _input_wire(x: Any) -> Any:
    if isinstance(x, torch.SymInt):
        return ["symint", str(x.node.expr)]
    if not isinstance(x, torch.Tensor):
        return None
    sizes = _layout(x)
    if is_static(sizes):
        return TensorMeta.from_tensor(x).to_wire()
    return ["symbolic", [str(v) for v in sizes], str(x.dtype), x.device.type]


def served_graph(call: Callable[[list[Any]], Any], disable_amp: bool,
                 dynamic: DynamicOutputs = (), aliases: Aliases = ()) -> Callable[..., Any]:
    """What AOTAutograd's runtime does around a trivial inference graph: grad off (its
    extern calls must not record autograd), autocast off when it was on at trace time
    (the graph is already cast), the inputs passed as one list, the outputs that alias
    an input made views of it again (``aliases``, as AOTAutograd's runtime does) and the
    symbolic dimensions of ``dynamic`` outputs marked on them. A CUDA-graph runner, or a
    ``SwappableGraph`` around one (``served``), replays a recording before any of that: a
    replay runs no op.

    Not wrapped in ``torch._dynamo.disable``: the entry is only ever the backend's answer
    to Dynamo, which wraps what a backend returns in its own ``disable`` (``OutputGraph``,
    torch 2.11 and 2.13), after unwrapping any ``disable`` already around it; a layer here
    was dropped there at once and only cost a wrapper at compile time."""
    def forward(*args: Any) -> Any:
        grad = torch.is_grad_enabled()
        if grad:
            torch._C._set_grad_enabled(False)
        try:
            if disable_amp:
                with torch._C._DisableAutocast():
                    return call(list(args))
            return call(list(args))
        finally:
            if grad:
                torch._C._set_grad_enabled(True)

    served = getattr(call, "served", None)  # a CUDA-graph runner replays without the above
    entry = served(forward) if callable(served) else forward
    if aliases:
        entry = _aliasing_inputs(entry, aliases)
    if dynamic:
        entry = _marking_dynamic(entry, dynamic)
    return entry


def _aliasing_inputs(entry: Callable[..., Any], aliases: Aliases) -> Callable[..., Any]:
    """Each aliasing output as AOTAutograd's runtime returns it: the input itself, or a
    view of the input with the compiled output's sizes, strides and offset (what
    ``gen_alias_from_base`` falls back to), detached (no aliasing output requires grad)."""
    def forward(*args: Any) -> Any:
        out = list(entry(*args))
        for i, base, is_input in aliases:
            if i >= len(out):
                raise RuntimeError(f"kiln: a served graph gave {len(out)} outputs, its AOT "
                                   f"cache entry names output {i} as an alias of an input")
            x, got = args[base], out[i]
            if not is_input:
                x = x.as_strided(got.size(), got.stride(), got.storage_offset())
            out[i] = x.detach() if x.requires_grad else x
        return out

    return forward


# The attribute through which AOTAutograd's runtime tells Dynamo an output's dynamic dims.
_DYNAMIC_DIMS = "_dynamo_propagated_dynamic_indices"


def _marking_dynamic(entry: Callable[..., Any], dynamic: DynamicOutputs) -> Callable[..., Any]:
    def forward(*args: Any) -> Any:
        out = entry(*args)
        for i, dims in dynamic:
            t = out[i]
            setattr(t, _DYNAMIC_DIMS, set(dims) | getattr(t, _DYNAMIC_DIMS, set()))
        return out

    return forward
