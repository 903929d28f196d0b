"""A training graph served by the AOT cache: Kiln's own runtime around a compiled forward
and backward, doing what AOTAutograd's runtime does for the simple ones, and nothing else.

A training graph is simple when its ``ViewAndMutationMeta`` says: no input mutation (data
or metadata), every user output a plain tensor that aliases nothing (no input, no
intermediate), no intermediate bases, no effect tokens, no subclasses, no RNG state, no
grad-mode change, no saved opaque objects or tensors saved without a version check, no
dynamic saved tensors; and its forward takes Dynamo's inputs in order. Everything else
is traced, with the reason counted (``aot_uncached_<reason>``).

Its runtime (``served_training``), learnt from AOTAutograd's (torch/_functorch/
_aot_autograd/runtime_wrappers.py), written for these graphs only:

    call      non-leaf inputs that require grad but get no gradient from the backward
              are detached; grad on,
              view replay on; one ``autograd.Function`` applied
    forward   (autocast off where it was on at trace time) the compiled forward, whose
              outputs are [user outputs, saved tensors, saved symints] (the partitioner's
              layout); the saved ones kept on ``ctx`` (views detached), outputs that do
              not require grad marked non-differentiable (their gradients not made)
    backward  [saved symints, saved tensors, tangents] for the compiled backward: one
              tangent per output whose gradient the backward takes, in its order,
              restrided to the layout it was traced with (or made contiguous in the
              traced memory format); autograd made None gradients zeros already. One
              gradient per input (None where none is needed). A backward that records
              a graph (``create_graph``) works once; a second backward through it
              raises, as AOTAutograd's does.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

# Memory formats a tangent may be coerced to, by the names entries carry.
MEMORY_FORMATS: dict[str, torch.memory_format] = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
    "preserve_format": torch.preserve_format,
}
_FORMAT_NAMES = {v: k for k, v in MEMORY_FORMATS.items()}


@dataclass(frozen=True)
class TangentLayout:
    """The gradient of user output ``output`` as the traced backward takes it: restrided
    to ``sizes``/``strides``, or (``memory_format``) made contiguous in that format."""

    output: int
    sizes: tuple[int, ...] | None = None
    strides: tuple[int, ...] | None = None
    memory_format: str | None = None


@dataclass(frozen=True)
class TrainingPlan:
    """What the runtime needs besides the two compiled graphs (see the module docstring)."""

    num_outputs: int
    num_saved: int
    num_symints: int
    grad_inputs: tuple[bool, ...]
    detach_inputs: tuple[int, ...]
    nondiff_outputs: tuple[int, ...]
    tangents: tuple[TangentLayout, ...]
    # Inputs the compiled forward writes itself (BatchNorm's running statistics in train
    # mode), whose version counters the runtime bumps after it (in_graph_mutations).
    mutated_inputs: tuple[int, ...] = ()
    # Saved tensors with symbolic dimensions (a graph with symbolic sizes): the runtime
    # marks those dimensions on them, as AOTAutograd's runtime does (compiled autograd
    # then treats them as dynamic).
    dynamic_saved: tuple[tuple[int, frozenset[int]], ...] = ()


@dataclass(frozen=True)
class ForwardFacts:
    """What the forward graph and its metadata say, until the backward graph comes: the
    plan but for its ``detach_inputs`` (the backward decides them, from these inputs
    requiring grad that are not leaves)."""

    plan: TrainingPlan
    non_leaf_grad: tuple[bool, ...]


def mutates_inputs(meta: Any) -> bool:
    """Whether AOTAutograd's metadata says the graph mutates an input (data, metadata,
    storage), read with defaults that say it does."""
    return any(getattr(i, "mutates_data", True) or getattr(i, "mutates_metadata", True)
               or getattr(i, "mutates_storage_metadata", False)
               or getattr(i, "mutation_inductor_storage_resize", False)
               for i in getattr(meta, "input_info", [None]))


def in_graph_mutations(meta: Any) -> tuple[int, ...] | None:
    """The inputs a training graph mutates, where every mutation is one AOTAutograd keeps
    in the compiled graph (data only, of an input that does not require grad: BatchNorm's
    running statistics), so that its runtime only bumps their version counters (those
    autograd sees) after the forward; None where any mutation is another kind (the
    runtime copies it back, or replays metadata). Read with defaults that refuse."""
    from torch._functorch._aot_autograd.schemas import MutationType

    mutated = []
    for i, info in enumerate(getattr(meta, "input_info", [None])):
        if not getattr(info, "mutates_data", True) and not getattr(info, "mutates_metadata", True) \
                and not getattr(info, "mutates_storage_metadata", True) \
                and not getattr(info, "mutation_inductor_storage_resize", True):
            continue
        if getattr(info, "mutation_type", None) is not MutationType.MUTATED_IN_GRAPH \
                or getattr(info, "mutates_metadata", True) \
                or getattr(info, "mutates_storage_metadata", True) \
                or getattr(info, "requires_grad", True):
            return None
        if not getattr(info, "mutations_hidden_from_autograd", False):
            mutated.append(i)
    if not getattr(meta, "keep_input_mutations", False) and mutated:
        return None
    return tuple(mutated)


def runtime_problem(meta: Any, subclass_fields: Sequence[str]) -> str | None:
    """What AOTAutograd's runtime does around any graph besides calling it, past input
    mutation and outputs (each caller checks those its own way): intermediate bases or
    effect tokens, a subclass in ``subclass_fields``, RNG state, a grad-mode change. A
    reason counter, or None; attributes are read with defaults that refuse."""
    if getattr(meta, "num_intermediate_bases", 1) or getattr(meta, "tokens", None) \
            or getattr(meta, "num_backward_tokens", 0):
        return "intermediate_bases_or_effects"
    if any(type(m).__name__ == "SubclassCreationMeta" for name in subclass_fields
           for m in getattr(meta, name, None) or []):
        return "subclass"
    if getattr(meta, "is_rng_op_functionalized", False) \
            or getattr(meta, "num_graphsafe_rng_states", 0) \
            or getattr(meta, "num_outputs_rng_offset", 0):
        return "rng_state"
    if getattr(meta, "grad_enabled_mutation", None) is not None:
        return "grad_mode_change"
    return None


def training_problem(meta: Any) -> str | None:
    """Why AOTAutograd's runtime would do more around this training graph than
    ``served_training`` does (a reason counter), or None. Attributes are read with
    defaults that refuse."""
    if meta is None:
        return "no_metadata"
    from torch._functorch._aot_autograd.schemas import OutputType

    if in_graph_mutations(meta) is None:
        return "input_mutation"
    if any(getattr(o, "output_type", None) is not OutputType.non_alias
           or not _is_tensor_type(getattr(o, "raw_type", None))
           for o in getattr(meta, "output_info", [None])):
        return "output_alias"
    problem = runtime_problem(meta, ("subclass_inp_meta", "subclass_fw_graph_out_meta",
                                     "subclass_tangent_meta"))
    if problem is not None:
        return problem
    if getattr(meta, "num_opaque_objects_saved_for_bw", 0) \
            or getattr(meta, "num_tensors_saved_with_no_vc_check", 0) \
            or getattr(meta, "num_unsafe_view_outputs", 0):
        return "saved_state"
    return None


def _is_tensor_type(t: Any) -> bool:
    """A plain tensor output (seen through functionalization's wrapper while traced);
    a subclass output is refused through its subclass metadata."""
    return isinstance(t, type) and issubclass(t, torch.Tensor)


def forward_facts(meta: Any, graph: torch.fx.GraphModule, num_inputs: int
                  ) -> ForwardFacts | str:
    """The forward's layout from its metadata and graph, or a reason it is not served."""
    problem = training_problem(meta)
    if problem is not None:
        return problem
    outputs = graph.graph.find_nodes(op="output")[0].args[0]
    num_outputs = len(meta.output_info)
    num_symints = meta.num_symints_saved_for_bw
    if type(num_symints) is not int or len(meta.input_info) != num_inputs \
            or not all(type(getattr(i, "is_leaf", None)) is bool for i in meta.input_info):
        return "layout"
    num_saved = len(outputs) - num_outputs - num_symints
    if num_saved < 0 or any(not isinstance(_val(n), torch.Tensor)
                            for n in outputs[:num_outputs + num_saved]):
        return "layout"
    tangent_outputs = [i for i, o in enumerate(meta.output_info)
                       if getattr(o, "requires_grad_for_backward", o.requires_grad)]
    metas = list(getattr(meta, "subclass_tangent_meta", None) or [])
    if len(metas) != len(tangent_outputs):
        return "tangent_meta"
    tangents = []
    for output, m in zip(tangent_outputs, metas):
        layout = _tangent_layout(output, getattr(m, "memory_format", None))
        if layout is None:
            return "tangent_meta"
        tangents.append(layout)
    plan = TrainingPlan(
        num_outputs, num_saved, num_symints,
        tuple(bool(i.requires_grad) for i in meta.input_info), (),
        tuple(i for i, o in enumerate(meta.output_info) if not o.requires_grad),
        tuple(tangents), in_graph_mutations(meta) or (),
        tuple(sorted((int(i), frozenset(int(d) for d in dims)) for i, dims in
                     (getattr(meta, "dynamic_saved_tensors_idxs", None) or {}).items())))
    return ForwardFacts(plan, tuple(bool(i.requires_grad) and not i.is_leaf
                                    for i in meta.input_info))


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else node


def _tangent_layout(output: int, fmt: Any) -> TangentLayout | None:
    if fmt is None:
        return None
    if getattr(fmt, "memory_format", None) is not None:
        name = _FORMAT_NAMES.get(fmt.memory_format)
        return None if name is None else TangentLayout(output, memory_format=name)
    sizes, strides = getattr(fmt, "size", None), getattr(fmt, "stride", None)
    if sizes is None or strides is None or not all(
            type(v) is int for v in (*sizes, *strides)) or len(sizes) != len(strides):
        return None
    return TangentLayout(output, tuple(sizes), tuple(strides))


def plan_with_backward(facts: ForwardFacts, graph: torch.fx.GraphModule
                       ) -> TrainingPlan | str:
    """The whole plan once the backward graph is known, or a reason it is not served:
    its inputs must be [symints, saved tensors, tangents] by count, its outputs one per
    forward input."""
    plan = facts.plan
    placeholders = list(graph.graph.find_nodes(op="placeholder"))
    if len(placeholders) != plan.num_symints + plan.num_saved + len(plan.tangents):
        return "backward_layout"
    outputs = graph.graph.find_nodes(op="output")[0].args[0]
    if len(outputs) != len(plan.grad_inputs):
        return "backward_layout"
    # As AOTAutograd does: a non-leaf input that gets no gradient is detached (a leaf
    # is not: it still makes the outputs require grad).
    detach = tuple(i for i, o in enumerate(outputs) if o is None and facts.non_leaf_grad[i])
    return replace(plan, detach_inputs=detach)


# ---------------------------------------------------------------------------------------
# The runtime.


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def opaque_to_dynamo(fn: _Fn) -> _Fn:
    """``fn`` run with Dynamo off, for itself and everything it calls, as torch makes its
    own compiled graphs opaque (``torch._dynamo.disable`` around a generated backward,
    torch/_dynamo/backends/common.py). A served graph's forward is called through the
    ``disable`` Dynamo puts around a backend's answer, but its backward is called by
    autograd from whatever frame runs ``loss.backward()``, often one Dynamo is running
    itself (a compiled training step, past its graph break): unwrapped, Dynamo would
    trace Kiln's runtime and the loaded wrapper there, and cut that frame into graphs a
    fresh compile never makes, each a miss."""
    import torch._dynamo

    return torch._dynamo.disable(fn, recursive=True)  # type: ignore[no-any-return]


def _call(fn: Callable[[list[Any]], Any], args: list[Any], disable_amp: bool) -> list[Any]:
    if disable_amp:
        with torch._C._DisableAutocast():
            out = fn(args)
    else:
        out = fn(args)
    return list(out) if isinstance(out, (list, tuple)) else [out]


def _coerce(grad: Any, layout: TangentLayout) -> Any:
    if not isinstance(grad, torch.Tensor):
        return grad
    if layout.memory_format is not None:
        fmt = MEMORY_FORMATS[layout.memory_format]
        return grad if grad.is_contiguous(memory_format=fmt) \
            else grad.contiguous(memory_format=fmt)
    if tuple(grad.shape) == layout.sizes and grad.stride() == layout.strides:
        return grad
    out = torch.empty_strided(layout.sizes, layout.strides,  # type: ignore[arg-type]
                              dtype=grad.dtype, device=grad.device, layout=grad.layout,
                              requires_grad=grad.requires_grad)
    out.copy_(grad)
    return out


class _NoDoubleBackward(torch.autograd.Function):
    """A backward run while recording a graph: its result is usable, a backward through
    it is not (as AOTAutograd's runtime says)."""

    @staticmethod
    def forward(ctx: Any, impl: Callable[[], tuple[Any, ...]], *unused: Any) -> Any:
        return impl()

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        return _refuse_double_backward()


@opaque_to_dynamo
def _refuse_double_backward() -> Any:
    raise RuntimeError("torch.compile with aot_autograd does not currently support "
                       "double backward (a Kiln graph served by the AOT cache)")


def served_training(forward: Callable[[list[Any]], Any],
                    backward: Callable[[list[Any]], Any],
                    plan: TrainingPlan, disable_amp: bool) -> Callable[..., Any]:
    """A Dynamo graph's callable: the compiled ``forward`` and ``backward`` under the
    runtime the module docstring describes."""
    user = slice(0, plan.num_outputs)
    saved = slice(plan.num_outputs, plan.num_outputs + plan.num_saved)
    symints = slice(plan.num_outputs + plan.num_saved,
                    plan.num_outputs + plan.num_saved + plan.num_symints)
    expected = plan.num_outputs + plan.num_saved + plan.num_symints

    @opaque_to_dynamo
    def run_backward(ctx: Any, *grads: Any) -> Any:
        args = [*ctx.kiln_symints, *ctx.saved_tensors,
                *[_coerce(grads[t.output], t) for t in plan.tangents]]
        clear = getattr(ctx, "maybe_clear_saved_tensors", None)
        if callable(clear):
            clear()

        def impl() -> tuple[Any, ...]:
            out = _call(backward, args, disable_amp)
            return tuple(g if need else None for g, need in zip(out, plan.grad_inputs))

        if torch.is_grad_enabled():
            anchor = torch.empty(0, requires_grad=True)
            return _NoDoubleBackward.apply(impl, anchor, *args)
        return impl()

    class KilnServedGraph(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, *args: Any) -> Any:
            outs = _call(forward, list(args), disable_amp)
            if len(outs) != expected:
                raise RuntimeError(f"kiln: a served forward gave {len(outs)} outputs, its "
                                   f"AOT cache entry says {expected}")
            to_save = [x.detach() if x._is_view() else x for x in outs[saved]]
            # as AOTAutograd's runtime marks them (indices checked when the entry loaded)
            for i, dims in plan.dynamic_saved:
                marked: set[int] = getattr(to_save[i], "_dynamo_propagated_dynamic_indices", set())
                to_save[i]._dynamo_propagated_dynamic_indices = set(dims) | marked
            ctx.save_for_backward(*to_save)
            ctx.kiln_symints = outs[symints]
            returns = tuple(outs[user])
            ctx.mark_non_differentiable(*[returns[i] for i in plan.nondiff_outputs])
            ctx._materialize_non_diff_grads = False
            return returns

        backward = staticmethod(run_backward)  # autograd calls it: not Dynamo's wrapper

    @opaque_to_dynamo
    def run(*args: Any) -> list[Any]:
        inputs: Sequence[Any] = args
        if plan.detach_inputs:
            inputs = list(args)
            for i in plan.detach_inputs:
                if isinstance(inputs[i], torch.Tensor):
                    inputs[i] = inputs[i].detach()
        replay = torch._C._is_view_replay_enabled()
        try:
            if not replay:
                torch._C._set_view_replay_enabled(True)
            with torch.enable_grad():
                outs = list(KilnServedGraph.apply(*inputs))
            for i in plan.mutated_inputs:  # written by the compiled forward, not by ATen
                torch.autograd.graph.increment_version(inputs[i])
            return outs
        finally:
            if torch._C._is_view_replay_enabled() != replay:
                torch._C._set_view_replay_enabled(replay)

    return run
