"""The scheduler: one node per buffer, dependencies from ``read_writes``, greedy fusion.

Fusion is gated by the backend's ``can_fuse`` (legality of one kernel for both nodes),
ranked by ``score_fusion_memory`` (bytes the merge saves) and refused by
``will_fusion_create_cycle`` (a path from one node to the other through a third).
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Iterable, Sequence
from typing import Any

import sympy
import torch

from .dependencies import (
    Dep,
    MemoryDep,
    ReadWrites,
    StarDep,
    WeakDep,
    extract_read_writes,
    normalize_dep,
)
from .ir.extern import ExternKernel, FallbackKernel, MultiOutput
from .ir.layout import Layout
from .ir.nodes import Buffer, ComputedBuffer, ReinterpretView, Scatter, TemplateBuffer
from .ir.sym import Expr, prod
from .virtualized import V

log = logging.getLogger("kiln.scheduler")

# Fusion stops after this many rounds or when a round fuses nothing.
MAX_FUSION_ROUNDS = 10
# Only nodes this close in the original order are considered for fusion together.
FUSION_WINDOW = 64
# A kernel holds at most this many nodes.
MAX_FUSION_SIZE = 64
# Independent one-element kernels batched into one kernel: at most this many.
MAX_SCALAR_BATCH = 32


class BaseSchedulerNode:
    """A unit of scheduling: one buffer's computation, or several fused ones."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.read_writes = ReadWrites(frozenset(), frozenset())
        self.unmet_dependencies: set[Dep] = set()
        self.ancestors: set[str] = set()
        self.last_usage: set[str] = set()
        self.min_order = self.max_order = 0

    def get_name(self) -> str:
        raise NotImplementedError

    def get_names(self) -> set[str]:
        return {self.get_name()}

    def get_nodes(self) -> Sequence[BaseSchedulerNode]:
        return [self]

    def get_buffer_names(self) -> set[str]:
        return self.get_names()

    def is_reduction(self) -> bool:
        return False

    def is_extern(self) -> bool:
        return False

    def is_template(self) -> bool:
        return False

    def is_nop(self) -> bool:
        return False

    def get_device(self) -> torch.device:
        raise NotImplementedError

    @property
    def group(self) -> tuple[Expr, Expr]:
        """(numel, rnumel) of the iteration space: the backend's fusion key."""
        return (sympy.Integer(1), sympy.Integer(1))

    def used_buffer_names(self) -> set[str]:
        names = {d.name for d in self.read_writes.reads if not isinstance(d, WeakDep)}
        return names | self.read_writes.write_names()

    def debug_str(self) -> str:
        rw = self.read_writes
        lines = [f"{self.get_name()}: {type(self).__name__}"]
        lines.append(f"  reads:  {sorted(map(_dep_str, rw.reads))}")
        lines.append(f"  writes: {sorted(map(_dep_str, rw.writes))}")
        if self.last_usage:
            lines.append(f"  last_usage: {sorted(self.last_usage)}")
        return "\n".join(lines)


def _dep_str(dep: Dep) -> str:
    if isinstance(dep, MemoryDep):
        return f"MemoryDep({dep.name}, {dep.index}, {list(dep.size)})"
    return f"{type(dep).__name__}({dep.name})"


@functools.lru_cache(maxsize=1 << 14)
def _accesses(read_writes: ReadWrites) -> dict[tuple[str, Expr], int]:
    """Each normalized memory access of a node, with its largest size in elements (the
    node's read_writes are frozen: fusion scores every candidate pair from this cache)."""
    out: dict[tuple[str, Expr], int] = {}
    for dep in read_writes.reads | read_writes.writes:
        if isinstance(dep, MemoryDep):
            d = normalize_dep(dep)
            numel = int(d.numel()) if d.numel().is_Integer else 1
            out[(d.name, d.index)] = max(out.get((d.name, d.index), 0), numel)
    return out


class SchedulerNode(BaseSchedulerNode):
    """A ComputedBuffer (or TemplateBuffer): a loop body the backend turns into a kernel."""

    def __init__(self, scheduler: Scheduler, node: ComputedBuffer | TemplateBuffer) -> None:
        super().__init__(scheduler)
        self.node = node
        self.read_writes = self._compute_read_writes()

    def _compute_read_writes(self) -> ReadWrites:
        node = self.node
        if isinstance(node, TemplateBuffer):
            # Templates declare their inputs (read whole); they write every element of
            # their output once, which is what lets a pointwise epilogue fuse into them.
            reads: set[Dep] = {StarDep(x.get_name()) for x in node.inputs
                               if isinstance(x, (Buffer, ReinterpretView))}
            name, indexer = node.get_name(), node.get_layout().make_indexer()
            writes = extract_read_writes(lambda idx: V.ops.store(name, indexer(idx), None),
                                         node.get_size()).writes
            return ReadWrites(frozenset(reads), writes)
        data = node.data
        rw = extract_read_writes(node.store_body(), data.get_size(), data.get_reduction_size())
        # A scatter into a buffer the graph computed runs after all of that buffer is
        # written, and never in the same kernel (its writes land anywhere in it).
        targets = {t for t in node.get_mutation_names() if t in V.graph.name_to_buffer}
        return rw.with_read({StarDep(t) for t in targets}) if targets else rw

    def get_name(self) -> str:
        return self.node.get_name()

    def is_reduction(self) -> bool:
        return isinstance(self.node, ComputedBuffer) and self.node.is_reduction()

    def is_template(self) -> bool:
        return isinstance(self.node, TemplateBuffer)

    def get_device(self) -> torch.device:
        return self.node.get_device()

    def get_ranges(self) -> tuple[tuple[Expr, ...], tuple[Expr, ...]]:
        if isinstance(self.node, ComputedBuffer):
            return self.node.data.get_size(), self.node.data.get_reduction_size()
        return self.node.get_size(), ()

    @functools.cached_property
    def group(self) -> tuple[Expr, Expr]:
        """(numel, rnumel): fixed for a node (fusion asks it of every candidate pair)."""
        ranges, rranges = self.get_ranges()
        return prod(ranges), prod(rranges)


class ExternKernelSchedulerNode(BaseSchedulerNode):
    """An extern or fallback kernel: its own call in the wrapper, never fused."""

    def __init__(self, scheduler: Scheduler, node: ExternKernel) -> None:
        super().__init__(scheduler)
        self.node = node
        reads: set[Dep] = {StarDep(n) for n in node.input_names()}
        writes: set[Dep] = {StarDep(node.get_name())}
        self.read_writes = ReadWrites(frozenset(reads), frozenset(writes),
                                      op_names=(node.kernel_name(),))

    def get_name(self) -> str:
        return self.node.get_name()

    def get_buffer_names(self) -> set[str]:
        # A multi-output fallback allocates its outputs, which other nodes read by name.
        outputs = getattr(self.node, "outputs", [])
        return {self.get_name()} | {out.get_name() for out in outputs}

    def is_extern(self) -> bool:
        return True

    def get_device(self) -> torch.device:
        return self.node.get_device()


class NopKernelSchedulerNode(BaseSchedulerNode):
    """A buffer that needs no kernel (it has no elements)."""

    def __init__(self, scheduler: Scheduler, node: Buffer) -> None:
        super().__init__(scheduler)
        self.node = node
        self.read_writes = ReadWrites(frozenset(), frozenset({StarDep(node.get_name())}))

    def get_name(self) -> str:
        return self.node.get_name()

    def is_nop(self) -> bool:
        return True

    def get_device(self) -> torch.device:
        return self.node.get_device()


class FusedSchedulerNode(BaseSchedulerNode):
    """Several nodes that one kernel computes, in dependency order."""

    def __init__(self, scheduler: Scheduler, snodes: list[BaseSchedulerNode]) -> None:
        super().__init__(scheduler)
        self.snodes = snodes
        rw = snodes[0].read_writes
        for n in snodes[1:]:
            rw = rw.merge(n.read_writes)
        self.read_writes = rw
        names = self.get_names()
        self.unmet_dependencies = {d for n in snodes for d in n.unmet_dependencies
                                   if d.name not in names}
        self.ancestors = set().union(*(n.ancestors for n in snodes)) - names
        self.min_order = min(n.min_order for n in snodes)
        self.max_order = max(n.max_order for n in snodes)

    @classmethod
    def fuse(cls, node1: BaseSchedulerNode, node2: BaseSchedulerNode) -> FusedSchedulerNode:
        nodes = list(itertools.chain(node1.get_nodes(), node2.get_nodes()))
        nodes.sort(key=lambda n: n.min_order)
        return cls(node1.scheduler, nodes)

    def get_name(self) -> str:
        return "_".join(n.get_name() for n in self.snodes)

    def get_names(self) -> set[str]:
        return set().union(*(n.get_names() for n in self.snodes))

    def get_nodes(self) -> Sequence[BaseSchedulerNode]:
        return self.snodes

    def used_buffer_names(self) -> set[str]:
        return set().union(*(n.used_buffer_names() for n in self.snodes))

    def is_reduction(self) -> bool:
        return any(n.is_reduction() for n in self.snodes)

    def get_device(self) -> torch.device:
        return self.snodes[0].get_device()

    @property
    def group(self) -> tuple[Expr, Expr]:
        for n in self.snodes:
            if n.is_reduction():
                return n.group
        return self.snodes[0].group

    def get_buffer_names(self) -> set[str]:
        return set().union(*(n.get_buffer_names() for n in self.snodes))

    def is_template(self) -> bool:
        return self.snodes[0].is_template()

    def debug_str(self) -> str:
        inner = "\n".join("  " + line for n in self.snodes for line in n.debug_str().split("\n"))
        head = f"{self.get_name()}: FusedSchedulerNode"
        if self.last_usage:
            head += f"\n  last_usage: {sorted(self.last_usage)}"
        return f"{head}\n{inner}"


class RowColumnSchedulerNode(FusedSchedulerNode):
    """A row reduction over ``[M, N]`` (``row_group``) whose kernel also computes the
    first stage of split column reductions over the same rows (``column_names``): one
    program per part of the rows, looping over them, so both read the rows once
    (``codegen/triton/row_column.py``)."""

    def __init__(self, scheduler: Scheduler, snodes: list[BaseSchedulerNode],
                 row_group: tuple[Expr, Expr], parts: int, column_names: set[str]) -> None:
        super().__init__(scheduler, snodes)
        self.row_group = row_group
        self.parts = parts
        self.column_names = column_names

    @property
    def group(self) -> tuple[Expr, Expr]:
        return self.row_group

    def row_nodes(self) -> list[BaseSchedulerNode]:
        return [n for n in self.snodes if n.get_name() not in self.column_names]


def compatible_access(write: MemoryDep, read: MemoryDep) -> bool:
    """True when ``read`` touches, at each iteration, the element ``write`` made there.

    Equal after normalization; or a reduction's output read across its whole row: the
    read iterates the write's loops and then more loops that the index does not use.
    """
    w, r = normalize_dep(write), normalize_dep(read)
    if w.index == r.index and w.size == r.size:
        return True
    n = len(w.size)
    if r.size[:n] != w.size:
        return False
    extra = set(r.var_names[n:])
    return r.index.subs(dict(zip(r.var_names[:n], w.var_names[:n]))) == w.index and not (
        r.index.free_symbols & extra)


def has_scatter(node: BaseSchedulerNode) -> bool:
    """True when ``node`` (or a node fused into it) is a Scatter: stores to indirect indices."""
    return any(isinstance(getattr(getattr(n, "node", None), "data", None), Scatter)
               for n in node.get_nodes())


class Scheduler:
    """Build scheduler nodes for ``V.graph.buffers``, fuse them, and order them."""

    def __init__(self, buffers: list[Buffer], backend: Any) -> None:
        self.backend = backend
        self.nodes: list[BaseSchedulerNode] = [self.create_node(b) for b in buffers
                                               if not isinstance(b, MultiOutput)
                                               or b.parent is None]
        self.name_to_node: dict[str, BaseSchedulerNode] = {}
        for order, n in enumerate(self.nodes):
            n.min_order = n.max_order = order
            self.name_to_node[n.get_name()] = n
        for b in buffers:  # outputs of a multi-output fallback come from the parent's node
            if isinstance(b, MultiOutput) and b.parent is not None:
                parent = self.name_to_node[b.parent.get_name()]
                self.name_to_node[b.get_name()] = parent
                self._add_multi_output(parent, b)
        self.compute_dependencies()
        self.dead_node_elimination()
        self.compute_ancestors()
        self.fusions: list[tuple[str, str]] = []
        self.current: dict[str, BaseSchedulerNode] = {}  # buffer name -> node holding it now
        self._index_current()

    def create_node(self, buf: Buffer) -> BaseSchedulerNode:
        if isinstance(buf, ExternKernel):
            return ExternKernelSchedulerNode(self, buf)
        if isinstance(buf, (ComputedBuffer, TemplateBuffer)):
            if isinstance(buf.layout, Layout) and any(s == 0 for s in buf.get_size()):
                return NopKernelSchedulerNode(self, buf)
            return SchedulerNode(self, buf)
        raise TypeError(f"cannot schedule {buf!r}")

    def _add_multi_output(self, parent: BaseSchedulerNode, out: MultiOutput) -> None:
        rw = parent.read_writes
        parent.read_writes = ReadWrites(rw.reads, rw.writes | {StarDep(out.get_name())},
                                        rw.index_exprs, rw.op_names)

    def writer_of(self, name: str) -> BaseSchedulerNode | None:
        return self.name_to_node.get(name)

    def compute_dependencies(self) -> None:
        """Unmet dependencies from reads; mutations wait for earlier readers (WeakDep)."""
        readers: dict[str, list[BaseSchedulerNode]] = {}
        for node in self.nodes:
            deps: set[Dep] = set()
            for dep in node.read_writes.reads:
                if self.writer_of(dep.name) is not None:
                    deps.add(dep)
                readers.setdefault(dep.name, []).append(node)
            for mutated in self._mutations(node):
                for reader in readers.get(mutated, []):
                    if reader is not node:
                        deps.add(WeakDep(reader.get_name(), node.get_name()))
            node.unmet_dependencies = deps

    def _mutations(self, node: BaseSchedulerNode) -> list[str]:
        buf = getattr(node, "node", None)
        return buf.get_mutation_names() if isinstance(buf, Buffer) else []

    def dependency_names(self, node: BaseSchedulerNode) -> set[str]:
        """Names of the (original) nodes that ``node`` waits for, its own excluded."""
        names = set()
        for dep in node.unmet_dependencies:
            writer = self.writer_of(dep.name)
            if writer is not None and writer.get_name() not in node.get_names():
                names.add(writer.get_name())
        return names

    def dead_node_elimination(self) -> None:
        """Drop nodes whose buffers nobody reads, that are not outputs and mutate nothing.

        A WeakDep only orders a mutation after a reader; it does not keep the reader alive.
        """
        keep_names = set(V.graph.get_output_names())
        changed = True
        while changed:
            used = set(keep_names)
            for n in self.nodes:
                used |= {d.name for d in n.unmet_dependencies if not isinstance(d, WeakDep)}
            alive = [n for n in self.nodes if n.get_buffer_names() & used
                     or self._mutations(n) or self._has_effects(n)]
            changed = len(alive) != len(self.nodes)
            self.nodes = alive
        alive_names = {name for n in self.nodes for name in n.get_names()}
        for n in self.nodes:
            n.unmet_dependencies = {d for d in n.unmet_dependencies
                                    if not isinstance(d, WeakDep) or d.name in alive_names}

    def _has_effects(self, node: BaseSchedulerNode) -> bool:
        buf = getattr(node, "node", None)
        return isinstance(buf, FallbackKernel) and (bool(buf.mutated_inputs)
                                                    or buf.has_side_effects)

    def compute_ancestors(self) -> None:
        for node in self.nodes:
            anc: set[str] = set()
            for dep_name in self.dependency_names(node):
                anc.add(dep_name)
                anc |= self.name_to_node[dep_name].ancestors
            node.ancestors = anc

    # -- fusion -------------------------------------------------------------------------

    def fuse_nodes(self) -> None:
        for _ in range(MAX_FUSION_ROUNDS):
            before = len(self.nodes)
            self.fuse_nodes_once()
            if len(self.nodes) == before:
                break
        self.batch_scalar_kernels()
        self.topological_sort()

    def batch_scalar_kernels(self) -> None:
        """One-element pointwise kernels that neither depends on, in graph order, as one
        kernel per ``MAX_SCALAR_BATCH``: they share no access, so fusion by score never
        joins them, and each costs a launch for one element. A compiled optimizer step has
        one per parameter (``steps + 1``: 202 launches of BERT's AdamW step)."""
        self._index_current()
        batch: BaseSchedulerNode | None = None
        for node in sorted(self.nodes, key=lambda n: n.min_order):
            if not self._lone_scalar(node):
                continue
            if batch is None or len(batch.get_nodes()) + len(node.get_nodes()) > \
                    MAX_SCALAR_BATCH or batch.get_device() != node.get_device() or \
                    batch.get_names() & self.dependency_names(node) or \
                    node.get_names() & self.dependency_names(batch) or \
                    self.will_fusion_create_cycle(batch, node):
                batch = node
                continue
            batch = self._apply_fusion(batch, node, FusedSchedulerNode.fuse(batch, node))

    def _lone_scalar(self, node: BaseSchedulerNode) -> bool:
        if node.is_extern() or node.is_nop() or node.is_template() or node.is_reduction():
            return False
        if isinstance(node, RowColumnSchedulerNode) or has_scatter(node):
            return False
        numel, rnumel = node.group
        return bool(numel == 1 and rnumel == 1)

    def _index_current(self) -> None:
        self.current = {name: n for n in self.nodes for name in n.get_names()}

    def fuse_nodes_once(self) -> None:
        self._index_current()
        fused_into = self.current
        for node1, node2 in self.get_possible_fusions():
            node1 = fused_into[next(iter(node1.get_names()))]
            node2 = fused_into[next(iter(node2.get_names()))]
            if node1 is node2:
                continue
            if not self.can_fuse(node1, node2) or self.will_fusion_create_cycle(node1, node2):
                continue
            self._apply_fusion(node1, node2, self.fuse_pair(node1, node2))

    def _apply_fusion(self, node1: BaseSchedulerNode, node2: BaseSchedulerNode,
                      fused: FusedSchedulerNode) -> FusedSchedulerNode:
        """``fused`` takes node1's place in the order and both nodes' names."""
        self.fusions.append((node1.get_name(), node2.get_name()))
        for name in fused.get_names():
            self.current[name] = fused
        self.nodes = [fused if n is node1 else n for n in self.nodes if n is not node2]
        self._refresh_ancestors(fused, node1, node2)
        return fused

    def fuse_pair(self, node1: BaseSchedulerNode, node2: BaseSchedulerNode
                  ) -> FusedSchedulerNode:
        """One node for both; a row-column kernel stays one (and a column stage joins
        a row reduction as one, see the backend's ``row_column_plan``)."""
        plan = self.backend.row_column_plan(node1, node2)
        if plan is None:
            kept = [n for n in (node1, node2) if isinstance(n, RowColumnSchedulerNode)]
            if kept:
                plan = (kept[0].row_group, kept[0].parts,
                        set().union(*(n.column_names for n in kept)))
        fused = FusedSchedulerNode.fuse(node1, node2)
        if plan is None:
            return fused
        return RowColumnSchedulerNode(self, list(fused.snodes), *plan)

    def _refresh_ancestors(self, fused: FusedSchedulerNode, node1: BaseSchedulerNode,
                           node2: BaseSchedulerNode) -> None:
        """Every descendant of the fused node gets its names and ancestors, adding only
        what it lacks: a descendant of a node already holds that node's ancestors (the
        sets stay transitively closed), so a descendant of node1 lacks at most the fused
        ancestors node1 did not have (in a vertical fusion, the few nodes between the
        two). Adding the whole set to every descendant, as before, made this quadratic
        in the graph's length; the sets it leaves are the same."""
        names = fused.get_names()
        names1, names2 = node1.get_names(), node2.get_names()
        gain1 = fused.ancestors - node1.ancestors  # what a descendant of node1 lacks
        gain2 = fused.ancestors - node2.ancestors
        gains = {(True, False): gain1, (False, True): gain2,
                 (True, True): gain1 - node2.ancestors}
        for n in self.nodes:
            below = (not n.ancestors.isdisjoint(names1), not n.ancestors.isdisjoint(names2))
            if n is fused or below == (False, False):
                continue
            n.ancestors |= names
            n.ancestors |= gains[below]
            n.ancestors -= n.get_names()

    def get_possible_fusions(self) -> list[tuple[BaseSchedulerNode, BaseSchedulerNode]]:
        """Pairs of nodes touching a common buffer, best score first."""
        by_buffer: dict[str, list[BaseSchedulerNode]] = {}
        for n in self.nodes:
            for name in n.used_buffer_names():
                by_buffer.setdefault(name, []).append(n)
        pairs: dict[tuple[int, int], tuple[BaseSchedulerNode, BaseSchedulerNode]] = {}
        for users in [*by_buffer.values(), *self._sibling_groups()]:
            users = sorted(users, key=lambda n: n.min_order)
            for i, a in enumerate(users):
                for b in users[i + 1:i + 1 + FUSION_WINDOW]:
                    pairs[(id(a), id(b))] = (a, b)
        def rank(pair: tuple[BaseSchedulerNode, BaseSchedulerNode]) -> tuple[int, ...]:
            memory, proximity = self.score_fusion(*pair)
            return (-memory, -proximity, pair[0].min_order, pair[1].min_order)

        ranked = sorted(pairs.values(), key=rank)
        return ranked

    def score_fusion(self, node1: BaseSchedulerNode, node2: BaseSchedulerNode
                     ) -> tuple[int, int]:
        """(bytes saved, closeness in the original order): higher is better."""
        return (self.score_fusion_memory(node1, node2),
                -abs(node2.min_order - node1.max_order))

    def score_fusion_memory(self, node1: BaseSchedulerNode, node2: BaseSchedulerNode) -> int:
        """Elements of memory traffic the fusion saves: accesses the two nodes share."""
        deps1 = _accesses(node1.read_writes)
        deps2 = _accesses(node2.read_writes)
        common = deps1.keys() & deps2.keys()
        # Per shared access, the larger of its sizes (a reduction's output is written once per
        # row and read once per element by an epilogue): a max, so set order never matters.
        return sum(max(deps1[key], deps2[key]) for key in common)

    def can_fuse(self, node1: BaseSchedulerNode, node2: BaseSchedulerNode) -> bool:
        if node1 is node2:
            return False
        for n in (node1, node2):
            if n.is_extern() or n.is_nop():
                return False
        if node1.get_device() != node2.get_device():
            return False
        if len(node1.get_nodes()) + len(node2.get_nodes()) > MAX_FUSION_SIZE:
            return False
        # A scatter's atomic stores stay out of reduction loops.
        if (has_scatter(node1) and node2.is_reduction()) or (
                has_scatter(node2) and node1.is_reduction()):
            return False
        if node1.is_template() or node2.is_template():
            # A template's epilogue stores plainly: no scatter's atomic stores in it.
            if has_scatter(node1) or has_scatter(node2):
                return False
            return self.can_fuse_epilogue(node1, node2)
        if not self.backend.row_column_allows(node1, node2):
            return False
        if self.backend.row_column_plan(node1, node2) is not None:
            return True  # a row reduction and a column stage: one pass over the rows
        # A fusion that shares no access (same buffer, same element per iteration) saves no
        # memory traffic: it is not profitable, and the two loops may walk memory in
        # different orders (a row-wise loop next to a column reduction or a transpose).
        if self.score_fusion_memory(node1, node2) == 0:
            return self.sibling_reductions(node1, node2) and \
                self.backend.can_fuse_siblings(node1, node2)
        # Vertical when one reads what the other writes; which one is the producer is a matter
        # of dependencies, not of min_order (a fused consumer may start before its producer).
        if node2.get_names() & self.dependency_names(node1):
            node1, node2 = node2, node1
        elif node2.min_order < node1.min_order and not (
                node1.get_names() & self.dependency_names(node2)):
            node1, node2 = node2, node1
        if node1.get_names() & self.dependency_names(node2):
            return self.can_fuse_vertical(node1, node2) and self.backend.can_fuse_vertical(
                node1, node2)
        return self.backend.can_fuse_horizontal(node1, node2)

    def _sibling_groups(self) -> list[list[BaseSchedulerNode]]:
        """Reductions grouped by the one node whose outputs are all they read
        (candidates for ``sibling_reductions``)."""
        groups: dict[int, list[BaseSchedulerNode]] = {}
        for n in self.nodes:
            if not n.is_reduction():
                continue
            writers = {id(self.current.get(name)) for name in n.read_writes.read_names()}
            if len(writers) == 1 and id(None) not in writers:
                groups.setdefault(writers.pop(), []).append(n)
        return [g for g in groups.values() if len(g) > 1]

    def sibling_reductions(self, node1: BaseSchedulerNode, node2: BaseSchedulerNode
                           ) -> bool:
        """Independent reductions over one space that read only what one other kernel
        wrote (the second stages of a layer norm's weight and bias gradients, whose
        partials one kernel made): one launch for both, the same traffic."""
        if not (node1.is_reduction() and node2.is_reduction()) or node1.group != node2.group:
            return False
        if node1.get_names() & self.dependency_names(node2) or \
                node2.get_names() & self.dependency_names(node1):
            return False
        reads = node1.read_writes.read_names() | node2.read_writes.read_names()
        writers = {id(self.current.get(name)) for name in reads}
        return len(writers) == 1 and id(None) not in writers

    def can_fuse_epilogue(self, node1: BaseSchedulerNode, node2: BaseSchedulerNode) -> bool:
        """A template takes pointwise consumers of its output into its store: over the
        same elements, reading its output where it wrote it, writing none of its inputs."""
        template, other = (node1, node2) if node1.is_template() else (node2, node1)
        if other.is_template() or other.is_reduction():
            return False
        if not template.get_names() & self.dependency_names(other):
            return False
        if template.group != other.group or self.score_fusion_memory(template, other) == 0:
            return False
        inputs = {d.name for d in template.get_nodes()[0].read_writes.reads}
        written = other.read_writes.write_names() | {
            target for n in other.get_nodes() for target in self._mutations(n)}
        if written & inputs:  # other tiles may still be reading what it overwrites
            return False
        return self.can_fuse_vertical(template, other) and self.backend.can_fuse_vertical(
            template, other)

    def can_fuse_vertical(self, node1: BaseSchedulerNode, node2: BaseSchedulerNode) -> bool:
        """Every read in node2 of node1's buffers touches the element node1 wrote there."""
        writes = {d.name: d for n in node1.get_nodes() for d in n.read_writes.writes}
        for dep in node2.unmet_dependencies:
            if dep.name not in writes:
                continue
            write = writes[dep.name]
            if isinstance(dep, WeakDep):
                if not self.fusable_weak_dep(dep, node1, node2):
                    return False
                continue
            if not isinstance(dep, MemoryDep) or not isinstance(write, MemoryDep):
                return False
            if dep.is_indirect() or not compatible_access(write, dep):
                return False
        return True

    def fusable_weak_dep(self, dep: WeakDep, node1: BaseSchedulerNode,
                         node2: BaseSchedulerNode) -> bool:
        """A mutation fuses with an earlier reader of its target only when it is in place:
        at every iteration the reader reads the very element the mutation then writes.
        Otherwise one iteration would overwrite what a later one still has to read."""
        mutating = self.writer_of(dep.mutating_buf)
        targets = self._mutations(mutating) if mutating is not None else []
        mutation_writes = [d for n in node2.get_nodes() for d in n.read_writes.writes
                           if d.name == dep.mutating_buf]
        if len(targets) != 1 or len(mutation_writes) != 1:
            return False
        write = mutation_writes[0]
        if not isinstance(write, MemoryDep) or write.is_indirect():
            return False
        w = normalize_dep(write)
        for n in node1.get_nodes():
            for read in n.read_writes.reads:
                if read.name != targets[0]:
                    continue
                if not isinstance(read, MemoryDep) or read.is_indirect():
                    return False
                r = normalize_dep(read)
                if (r.index, r.size) != (w.index, w.size):
                    return False
        return True

    def will_fusion_create_cycle(self, node1: BaseSchedulerNode,
                                 node2: BaseSchedulerNode) -> bool:
        """A path node1 -> X -> node2 (or back) through a node outside the pair."""
        names = node1.get_names() | node2.get_names()
        for a, b in ((node1, node2), (node2, node1)):
            for anc in b.ancestors - names:
                other = self.current.get(anc)
                if other is not None and other.ancestors & a.get_names():
                    return True
        return False

    def topological_sort(self) -> None:
        """Order fused nodes so each comes after what it depends on (stable by order)."""
        remaining = sorted(self.nodes, key=lambda n: n.min_order)
        owner = {name: n for n in remaining for name in n.get_names()}
        done: set[int] = set()
        result: list[BaseSchedulerNode] = []
        while remaining:
            for n in remaining:
                deps = {id(owner[d]) for d in self.dependency_names(n) if d in owner}
                if all(d in done or d == id(n) for d in deps):
                    result.append(n)
                    done.add(id(n))
                    remaining.remove(n)
                    break
            else:
                raise RuntimeError("dependency cycle among scheduler nodes")
        self.nodes = result

    def kernel_count(self) -> int:
        return sum(1 for n in self.nodes if not n.is_nop())

    def debug_str(self, nodes: Iterable[BaseSchedulerNode] | None = None) -> str:
        return "\n".join(n.debug_str() for n in (nodes or self.nodes))
