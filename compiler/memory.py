"""Buffer lifetimes: last uses, buffers that never leave a kernel, reuse, peak memory."""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from .dependencies import MemoryDep
from .ir.extern import ExternKernel, FallbackKernel, MultiOutput
from .ir.layout import Layout, MutationLayout
from .ir.nodes import Buffer, ComputedBuffer, InputBuffer, TemplateBuffer
from .ir.sym import Expr
from .scheduler import BaseSchedulerNode, Scheduler
from .virtualized import V


@dataclass
class MemoryPlan:
    """What the wrapper needs to allocate, reuse and free buffers."""

    removed_buffers: set[str] = field(default_factory=set)
    reuse: dict[str, str] = field(default_factory=dict)  # new buffer -> buffer it takes over
    inplace: dict[str, str] = field(default_factory=dict)  # new buffer -> input it overwrites
    allocations: dict[str, int] = field(default_factory=dict)  # buffer -> bytes it holds
    peak_bytes: int = 0
    lifetimes: dict[str, tuple[int, int]] = field(default_factory=dict)  # buf -> (def, last)


def storage_bytes(buf: Buffer) -> Expr:
    """Bytes of a buffer's storage: a sympy expression over the size symbols."""
    layout = buf.layout
    if not isinstance(layout, Layout):
        return sympy.Integer(0)
    return sympy.expand(layout.storage_size() * layout.dtype.itemsize)


def buffer_bytes(buf: Buffer) -> int:
    """Bytes of a buffer's storage (at the size hints, for a graph with dynamic shapes)."""
    return V.graph.sizevars.size_hint(storage_bytes(buf))


# Ops that return their input although their schema does not say so: waiting for a
# functional collective (tensor-parallel graphs) hands back the collective's own output.
RETURNS_ITS_INPUT = frozenset({"_c10d_functional::wait_tensor"})


def fallback_aliases(buffers: list[Buffer]) -> dict[str, set[str]]:
    """Buffers that may share storage with an input of theirs: a fallback whose op returns
    a view of an argument (``squeeze_``, ``view_as_real``, ``select`` on complex values)
    keeps that input's storage alive as long as the result lives."""
    aliases: dict[str, set[str]] = {}
    for buf in buffers:
        if not isinstance(buf, FallbackKernel) or buf.op_overload is None:
            continue
        schema = buf.op_overload._schema
        if schema.name not in RETURNS_ITS_INPUT and not any(
                r.alias_info is not None for r in schema.returns):
            continue
        sources = set(buf.input_names())
        for name in [buf.get_name()] + [o.get_name() for o in buf.outputs]:
            aliases[name] = sources
    return aliases


def _with_aliases(names: set[str], aliases: dict[str, set[str]]) -> set[str]:
    out, todo = set(names), list(names)
    while todo:
        for source in aliases.get(todo.pop(), ()):
            if source not in out:
                out.add(source)
                todo.append(source)
    return out


def compute_last_usage(nodes: list[BaseSchedulerNode], outputs: set[str],
                       aliases: dict[str, set[str]] | None = None) -> None:
    """Walk back from the outputs: a node's last_usage is what no later node uses.

    A use of a buffer that aliases another (``fallback_aliases``) uses that one too.
    Inside a fused node a second pass, starting empty, gives each inner node the buffers
    whose last use within the kernel is there (so the kernel can drop them early).
    """
    aliases = aliases or {}
    future_used = _with_aliases(set(outputs), aliases)
    for node in reversed(nodes):
        used = _with_aliases(node.used_buffer_names(), aliases)
        node.last_usage = used - future_used
        future_used |= used
        inner = node.get_nodes()
        if len(inner) > 1 or inner[0] is not node:
            future_inner: set[str] = set()
            for sub in reversed(inner):
                sub_used = sub.used_buffer_names()
                sub.last_usage = sub_used - future_inner
                future_inner |= sub_used


def extend_alias_lifetimes(nodes: list[BaseSchedulerNode], outputs: set[str]) -> None:
    """A scatter's result aliases the buffer it writes in place: that storage lives until
    the alias's last use (forever, if the alias is an output), not its own last use."""
    step_of = {name: i for i, node in enumerate(nodes) for name in node.last_usage}
    for buf in V.graph.buffers:
        layout = buf.layout
        if not isinstance(layout, MutationLayout) or layout.target not in V.graph.name_to_buffer:
            continue
        alias, target = buf.get_name(), layout.target
        if target not in step_of:
            continue
        nodes[step_of[target]].last_usage.discard(target)
        if alias in outputs or alias not in step_of:
            outputs.add(target)  # never freed nor reused
            continue
        nodes[step_of[alias]].last_usage.add(target)
        step_of[target] = step_of[alias]


def find_removed_buffers(scheduler: Scheduler, outputs: set[str]) -> set[str]:
    """Buffers written and read only inside one fused kernel: they live in registers."""
    users: dict[str, set[int]] = {}
    for i, node in enumerate(scheduler.nodes):
        for name in node.used_buffer_names():
            users.setdefault(name, set()).add(i)
    removed = set()
    for i, node in enumerate(scheduler.nodes):
        if len(node.get_nodes()) < 2:
            continue
        for sub in node.get_nodes():
            buf = getattr(sub, "node", None)
            if not isinstance(buf, (ComputedBuffer, TemplateBuffer)) or isinstance(
                    buf.layout, MutationLayout):
                continue
            name = buf.get_name()
            if name in outputs or users.get(name, set()) != {i}:
                continue
            if any(name in n.read_writes.read_names() for n in node.get_nodes()):
                removed.add(name)
    return removed


def plan_memory(scheduler: Scheduler, stored: set[str] | None = None) -> MemoryPlan:
    """Last uses, in-kernel buffers, storage reuse and the peak-memory estimate.

    ``stored`` names buffers that must be allocated even where they could stay in a
    kernel's registers (a code generator that cannot forward them re-plans with them).
    """
    graph = V.graph
    outputs = set(graph.get_output_names())
    nodes = scheduler.nodes
    aliases = fallback_aliases(graph.buffers)
    compute_last_usage(nodes, outputs, aliases)
    outputs = _with_aliases(outputs, aliases)  # storage an output views is never reused
    extend_alias_lifetimes(nodes, outputs)
    removed = find_removed_buffers(scheduler, outputs) - (stored or set())
    plan = MemoryPlan(removed_buffers=removed)
    free_pool: list[str] = []
    live = peak = 0
    for step, node in enumerate(nodes):
        for name in sorted(node.get_buffer_names() - plan.removed_buffers):
            buf = graph.name_to_buffer.get(name)
            if buf is None or not _allocates(buf) or name in aliases:
                continue  # a fallback's view of its input holds no storage of its own
            plan.lifetimes[name] = (step, step)
            donor = _take_reusable(free_pool, buf, graph) if _takes_donor(buf) else None
            if donor is not None:
                plan.reuse[name] = donor
            # A reused storage was counted free when its first owner died; it is live again.
            live += buffer_bytes(buf)
            plan.allocations[name] = buffer_bytes(buf)
        peak = max(peak, live)
        for name in sorted(node.last_usage):
            if name in plan.lifetimes:
                plan.lifetimes[name] = (plan.lifetimes[name][0], step)
            if name in outputs or name in plan.removed_buffers:
                continue
            buf = graph.name_to_buffer.get(name)
            if buf is None or not _allocates(buf) or name in aliases:
                continue  # freeing a view frees nothing: its source enters the pool
            if isinstance(buf, (FallbackKernel, MultiOutput)):
                continue  # storage an ATen op chose: its size is the op's, not the meta's
            free_pool.append(name)
        live -= sum(plan.allocations.get(n, 0) for n in node.last_usage if n not in outputs)
    for name, (start, _) in list(plan.lifetimes.items()):
        if name in outputs:
            plan.lifetimes[name] = (start, len(nodes))
    plan.peak_bytes = peak
    return plan


def _takes_donor(buf: Buffer) -> bool:
    """Whether the wrapper allocates ``buf``'s storage itself, so that it can hand it a
    freed buffer's instead: a kernel's output, or a library call with an ``out=`` variant.
    A library call without one returns storage of its own; a donor planned for it would
    be kept alive (never freed, never taken) until the graph returns."""
    if isinstance(buf, (ComputedBuffer, TemplateBuffer)):
        return True
    return (isinstance(buf, ExternKernel) and not isinstance(buf, (FallbackKernel, MultiOutput))
            and getattr(buf, "out_variant", None) is not None)


def _allocates(buf: Buffer) -> bool:
    if isinstance(buf, InputBuffer) or isinstance(buf.layout, MutationLayout):
        return False
    return isinstance(buf.layout, Layout)


def plan_inplace(plan: MemoryPlan, scheduler: Scheduler) -> None:
    """Let kernels write outputs over inputs that die there (``plan.inplace``).

    A pass after ``plan_memory`` that a backend opts into: on CPU a fresh allocation of a
    large buffer costs page faults on every call, which writing in place avoids. Only
    fresh allocations change, and only donors that no later buffer takes over.
    """
    outputs = set(V.graph.get_output_names())
    taken = set(plan.reuse.values())
    # Storage a fallback's view shares: a kernel reading the view reads it at other indices.
    viewed = set().union(*fallback_aliases(V.graph.buffers).values())
    for node in scheduler.nodes:
        if node.is_extern() or node.is_nop():
            continue
        for name in sorted(node.get_buffer_names() - plan.removed_buffers):
            buf = V.graph.name_to_buffer.get(name)
            if name not in plan.allocations or name in plan.reuse or buf is None:
                continue
            donor = _take_inplace(node, name, buf, plan, outputs | taken | viewed)
            if donor is not None:
                plan.inplace[name] = donor


def _take_inplace(node: BaseSchedulerNode, name: str, buf: Buffer, plan: MemoryPlan,
                  excluded: set[str]) -> str | None:
    """An input that dies at ``node`` and that ``node`` may overwrite with ``name``: same
    storage shape, read by no other part of the kernel, and read only at the element
    that ``name`` writes (so each element is read before it is overwritten). Writing in
    place spares a fresh allocation, which on CPU costs page faults for large buffers."""
    writers = [sub for sub in node.get_nodes() if sub.get_name() == name]
    if len(writers) != 1 or not isinstance(buf.layout, Layout):
        return None
    writer = writers[0]
    written = [d for d in writer.read_writes.writes if isinstance(d, MemoryDep)]
    if len(written) != 1:
        return None
    for dep in writer.read_writes.reads:
        cand = dep.name
        if (cand not in node.last_usage or cand in excluded or cand in plan.removed_buffers
                or cand in plan.inplace.values() or cand == name):
            continue
        other = V.graph.name_to_buffer.get(cand)
        if not _fresh(other) or not _same_storage(other, buf):
            continue
        reads = [d for sub in node.get_nodes() for d in sub.read_writes.reads
                 if d.name == cand]
        if all(isinstance(d, MemoryDep) and d in writer.read_writes.reads and
               (d.index, d.size) == (written[0].index, written[0].size) for d in reads):
            return cand
    return None


def _fresh(buf: Buffer | None) -> bool:
    """A buffer whose storage nothing else shares: a kernel's output, or a library call's
    (a fallback op may return a view of its input)."""
    if buf is None or not _allocates(buf):
        return False
    return isinstance(buf, (ComputedBuffer, TemplateBuffer)) or (
        isinstance(buf, ExternKernel) and not isinstance(buf, (FallbackKernel, MultiOutput)))


def _same_storage(a: Buffer, b: Buffer) -> bool:
    la, lb = a.get_layout(), b.get_layout()
    return (la.device.type, la.dtype, la.size, la.stride, la.offset) == (
        lb.device.type, lb.dtype, lb.size, lb.stride, lb.offset)


def _take_reusable(pool: list[str], buf: Buffer, graph: object) -> str | None:
    """A freed buffer with the same device, dtype and storage size, if there is one
    (sizes provably equal for every admitted size, in a graph with dynamic shapes): of the
    two freed last, the one with ``buf``'s own shape and strides if either has them (no
    view made per call), else the one freed last. A donor stays alive from its last use
    until it is taken, so taking the oldest, as before, kept about L/2 of a deep model's
    freed buffers alive at layer L whenever a layer frees more buffers of a size than it
    allocates (HF ViT on the H100: six attention-score buffers of 114 MB, a peak of 2 GB
    against Inductor's 0.3)."""
    want = (buf.get_device().type, buf.get_dtype())
    nbytes = storage_bytes(buf)
    named = graph.name_to_buffer  # type: ignore[attr-defined]
    recent: list[int] = []
    for i in reversed(range(len(pool))):
        other = named[pool[i]]
        if (other.get_device().type, other.get_dtype()) == want and \
                V.graph.sizevars.statically_known_equals(storage_bytes(other), nbytes):
            recent.append(i)
            if len(recent) == 2:
                break
    if not recent:
        return None
    same = [i for i in recent if _same_storage(named[pool[i]], buf)]
    return pool.pop((same or recent)[0])


def describe(plan: MemoryPlan, nodes: list[BaseSchedulerNode]) -> str:
    lines = [f"peak memory estimate: {plan.peak_bytes} bytes"]
    for node in nodes:
        lines.append(f"{node.get_name()}: last_usage={sorted(node.last_usage)}")
    for new, old in plan.reuse.items():
        lines.append(f"{new} reuses {old}")
    for new, old in plan.inplace.items():
        lines.append(f"{new} is written in place of {old}")
    if plan.removed_buffers:
        lines.append(f"in-kernel only (never allocated): {sorted(plan.removed_buffers)}")
    return "\n".join(lines)

