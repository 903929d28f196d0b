"""Regional compilation, the graph half: a large ATen graph cut into regions.

A cut goes between two nodes where few values are live: a value counts when a node on
the far side uses it; graph inputs (parameters), constants and values only the graph's
output needs do not (every region may read an input; a value for the output is returned by
the region that makes it). In a transformer the fewest live values are between layers,
where one hidden-state tensor flows, so cuts land there and regions are whole layers.

Each region is a graph of its own, canonical: its placeholders are the values it reads,
in the order its nodes first use them, so identical layers give byte-identical requests
(node names never reach a request), hence one key and one compile for all of them.

    plan = split_graph(gm, example_inputs, target_nodes)    Split: regions and outputs
    region.gm, region.example_inputs                        a request's graph and inputs
    region.inputs / split.outputs                           where each value comes from

``compiler.runtime.stitch`` runs the compiled regions in order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SOURCE_KINDS = ("input", "value", "none")


@dataclass(frozen=True)
class Source:
    """Where a value comes from: the graph's input ``index``; output ``output`` of region
    ``index``; or ``none`` (a ``None`` among the graph's outputs)."""

    kind: str
    index: int = 0
    output: int = 0

    def to_wire(self) -> list[Any]:
        return [self.kind, self.index, self.output]

    @staticmethod
    def from_wire(wire: Any) -> Source:
        if not (isinstance(wire, list) and len(wire) == 3 and wire[0] in SOURCE_KINDS
                and all(type(v) is int and v >= 0 for v in wire[1:])):
            raise ValueError(f"bad value source {wire!r:.100}")
        return Source(wire[0], wire[1], wire[2])


@dataclass
class Region:
    """One region: its graph (placeholders in canonical order), example inputs, where
    each input comes from, and the whole graph's constants it reads (by index)."""

    index: int
    gm: torch.fx.GraphModule
    example_inputs: list[Any]
    inputs: tuple[Source, ...]
    constants: tuple[int, ...]
    num_outputs: int
    first_node: str
    last_node: str
    nodes: int

    def describe(self) -> str:
        return (f"region {self.index} ({self.nodes} ATen nodes, {self.first_node} to "
                f"{self.last_node})")


@dataclass
class Split:
    """A graph cut into regions, and where each of the graph's outputs comes from."""

    regions: list[Region]
    outputs: tuple[Source, ...]


def compute_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"]


def live_counts(nodes: list[torch.fx.Node]) -> tuple[list[int], list[bool]]:
    """Per boundary ``p`` (between nodes ``p`` and ``p + 1``): how many values made at or
    before ``p`` are used by a node after it, and whether a cut there is allowed (every
    such value is a tensor: a tuple of a multi-output op, or a size, stays inside)."""
    position = {n: i for i, n in enumerate(nodes)}
    live = [0] * (len(nodes) + 1)
    blocked = [0] * (len(nodes) + 1)
    for node in nodes:
        uses = [position[u] for u in node.users if u in position]
        last = max(uses, default=position[node])
        if last <= position[node]:
            continue
        live[position[node]] += 1
        live[last] -= 1
        if not isinstance(node.meta.get("val"), torch.Tensor):
            blocked[position[node]] += 1
            blocked[last] -= 1
    counts, allowed, running, stop = [], [], 0, 0
    for p in range(len(nodes)):
        running += live[p]
        stop += blocked[p]
        counts.append(running)
        allowed.append(stop == 0)
    return counts, allowed


def choose_cuts(counts: list[int], allowed: list[bool], target: int) -> list[int]:
    """Boundaries to cut at: each region at least ``target`` nodes, ending at the boundary
    with the fewest live values within the next ``target`` nodes (the earliest of those),
    so that a repeated layer structure gives repeated regions. The last region is never
    under half the target (it joins the one before)."""
    n = len(counts)
    cuts: list[int] = []
    start = 0
    while n - start >= target + max(1, target // 2):
        lo, hi = start + target - 1, min(n - 2, start + 2 * target - 1)
        window = [p for p in range(lo, hi + 1) if allowed[p]]
        if not window:  # a long stretch with no allowed cut: take the first after it
            window = [p for p in range(hi + 1, n - 1) if allowed[p]][:1]
            if not window:
                break
        best = min(window, key=lambda p: (counts[p], p))
        if n - 1 - best < max(1, target // 2):
            break
        cuts.append(best)
        start = best + 1
    return cuts


def periodic_cuts(nodes: list[torch.fx.Node], counts: list[int], allowed: list[bool],
                  target: int) -> list[int] | None:
    """Cuts that follow a repeated structure (layers): the graph is first cut at every
    boundary with the fewest live values, into segments; the longest run of segments
    repeating with some period (a unit: a layer) is found by the segments' op sequences;
    regions are then whole numbers of units (about ``target`` nodes), aligned to the run,
    so that every middle region is the same graph. The nodes before the run join the
    first region, those after it the last (each its own region when half a target or
    more). None when nothing repeats twice."""
    n = len(nodes)
    inner = [p for p in range(n - 1) if allowed[p]]
    if not inner:
        return None
    fewest = min(counts[p] for p in inner)
    bounds = [-1] + [p for p in inner if counts[p] == fewest] + [n - 1]
    sigs = [tuple(str(x.target) for x in nodes[a + 1:b + 1]) for a, b in zip(bounds, bounds[1:])]
    found = _longest_repeat(sigs, [b - a for a, b in zip(bounds, bounds[1:])])
    if found is None:
        return None
    first, period, units = found
    unit_nodes = bounds[first + period] - bounds[first]
    per_region = max(1, round(target / max(1, unit_nodes)))
    starts = [first + g * per_region * period for g in range(units // per_region + 1)]
    end = first + units * period  # the segment after the run's last unit
    cut_segments = [i for i in starts[1:] if i < end] + [end]
    if bounds[first] + 1 >= target // 2:
        cut_segments.insert(0, first)
    if n - 1 - bounds[end] < target // 2:
        cut_segments.pop()  # too few nodes after the run: they join the last region
    if cut_segments and cut_segments[-1] == end and units % per_region:
        cut_segments = [i for i in cut_segments if i != starts[-1]]
    cuts = sorted({bounds[i] for i in cut_segments if 0 < i < len(bounds) - 1})
    return cuts or None


def _longest_repeat(sigs: list[tuple[str, ...]], sizes: list[int]
                    ) -> tuple[int, int, int] | None:
    """(first segment, period, units) of the run of segments repeating with a period that
    covers the most nodes (two units at least), or None."""
    best: tuple[int, int, int, int] | None = None  # (covered nodes, first, period, units)
    m = len(sigs)
    for period in range(1, m // 2 + 1):
        run = 0
        for i in range(m - period - 1, -2, -1):  # backwards: run = matches from i + 1 on
            if i >= 0 and sigs[i] == sigs[i + period]:
                run += 1
                continue
            units = (run + period) // period
            if units >= 2:
                start = i + 1
                covered = sum(sizes[start:start + units * period])
                if best is None or covered > best[0]:
                    best = (covered, start, period, units)
            run = 0
    return None if best is None else best[1:]


def graph_constants_order(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, int]:
    """The index of each tensor constant (``get_attr``), in node order: the order in which
    the client hands a graph its constants."""
    order: dict[torch.fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(_attr(gm, node), torch.Tensor):
            order[node] = len(order)
    return order


def _attr(gm: torch.fx.GraphModule, node: torch.fx.Node) -> Any:
    value: Any = gm
    for part in str(node.target).split("."):
        value = getattr(value, part, None)
    return value


def split_graph(gm: torch.fx.GraphModule, example_inputs: list[Any], target: int
                ) -> Split | None:
    """``gm`` cut into regions of about ``target`` nodes, or None when it cannot be cut
    (fewer than two regions' worth of nodes, no allowed boundary, an output that is
    neither a tensor nor None)."""
    nodes = compute_nodes(gm)
    if not _outputs_splittable(gm):
        return None
    counts, allowed = live_counts(nodes)
    cuts = periodic_cuts(nodes, counts, allowed, max(1, target)) or \
        choose_cuts(counts, allowed, max(1, target))
    if not cuts:
        return None
    return _Builder(gm, example_inputs, nodes, cuts).build()


def _output_args(gm: torch.fx.GraphModule) -> list[Any]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    arg = out.args[0]
    return list(arg) if isinstance(arg, (list, tuple)) else [arg]


def _outputs_splittable(gm: torch.fx.GraphModule) -> bool:
    for arg in _output_args(gm):
        if arg is None:
            continue
        if not isinstance(arg, torch.fx.Node) or arg.op == "get_attr":
            return False
        if arg.op == "call_function" and not isinstance(arg.meta.get("val"), torch.Tensor):
            return False
    return True


class _Builder:
    """Makes each region's graph: placeholders for what it reads, copies of its nodes,
    an output tuple of what later regions or the graph's output need."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: list[Any],
                 nodes: list[torch.fx.Node], cuts: list[int]) -> None:
        self.gm = gm
        self.example_inputs = example_inputs
        bounds = [0] + [c + 1 for c in cuts] + [len(nodes)]
        self.spans = [nodes[a:b] for a, b in zip(bounds, bounds[1:])]
        self.region_of = {n: r for r, span in enumerate(self.spans) for n in span}
        self.placeholders = {n: i for i, n in
                             enumerate(gm.graph.find_nodes(op="placeholder"))}
        self.constants = graph_constants_order(gm)
        self.output_slot: dict[torch.fx.Node, int] = {}

    def build(self) -> Split:
        regions = [self._region(r, span) for r, span in enumerate(self.spans)]
        outputs = tuple(self._source(a) if a is not None else Source("none")
                        for a in _output_args(self.gm))
        return Split(regions, outputs)

    def _source(self, node: torch.fx.Node) -> Source:
        if node in self.placeholders:
            return Source("input", self.placeholders[node])
        return Source("value", self.region_of[node], self.output_slot[node])

    def _reads(self, span: list[torch.fx.Node]) -> list[torch.fx.Node]:
        inside = set(span)
        reads: dict[torch.fx.Node, None] = {}
        for node in span:
            for arg in node.all_input_nodes:
                if arg not in inside:
                    reads.setdefault(arg, None)
        return list(reads)

    def _exports(self, r: int, span: list[torch.fx.Node]) -> list[torch.fx.Node]:
        return [n for n in span if any(u.op == "output" or self.region_of.get(u, r) != r
                                       for u in n.users)]

    def _region(self, r: int, span: list[torch.fx.Node]) -> Region:
        graph, root = torch.fx.Graph(), torch.nn.Module()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        inputs: list[Source] = []
        examples: list[Any] = []
        constants: list[int] = []
        for node in self._reads(span):
            if node.op == "get_attr":
                name = f"_region_constant{len(constants)}"
                setattr(root, name, _attr(self.gm, node))
                env[node] = graph.get_attr(name)
                constants.append(self.constants[node])
                continue
            env[node] = graph.placeholder(f"in{len(inputs)}")
            source = self._source(node)
            inputs.append(source)
            examples.append(self.example_inputs[source.index] if source.kind == "input"
                            else node.meta["val"])
            env[node].meta["val"] = node.meta.get("val")
        for node in span:
            env[node] = graph.node_copy(node, lambda n: env[n])
        exports = self._exports(r, span)
        for k, node in enumerate(exports):
            self.output_slot[node] = k
        graph.output(tuple(env[n] for n in exports))
        return Region(r, torch.fx.GraphModule(root, graph), examples, tuple(inputs),
                      tuple(constants), len(exports), span[0].name, span[-1].name, len(span))
