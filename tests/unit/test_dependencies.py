"""read_writes: MemoryDep indices and sizes, StarDeps of extern kernels, WeakDeps that order
a mutation after the readers of its target, and reads through views of buffers."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sympy
import torch

from kiln.compiler.decompositions import trace_aten
from kiln.compiler.dependencies import MemoryDep, StarDep, WeakDep, canonical_vars, normalize_dep
from kiln.compiler.driver import ScheduledGraph, lower_and_schedule
from kiln.compiler.scheduler import BaseSchedulerNode, ExternKernelSchedulerNode

c0, c1, c2 = canonical_vars(3)


def compile_fn(fn: Callable[..., Any], *args: torch.Tensor) -> ScheduledGraph:
    return lower_and_schedule(trace_aten(fn, list(args)), list(args))


def rand(*shape: int) -> torch.Tensor:
    return torch.randn(*shape)


def inner_nodes(sg: ScheduledGraph) -> dict[str, BaseSchedulerNode]:
    return {n.get_name(): n for node in sg.scheduler.nodes for n in node.get_nodes()}


def deps(node: BaseSchedulerNode, kind: str) -> set[tuple[str, Any, tuple[int, ...]]]:
    """(name, index, size) of each MemoryDep read or written."""
    rw = node.read_writes.reads if kind == "reads" else node.read_writes.writes
    out = set()
    for d in rw:
        assert isinstance(d, MemoryDep), d
        out.add((d.name, d.index, tuple(int(s) for s in d.size)))
    return out


def test_seed_memory_deps() -> None:
    def fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        return ((a + b) * c.relu()).sum(dim=-1)

    sg = compile_fn(fn, rand(64, 128), rand(64, 128), rand(64, 128))
    node = inner_nodes(sg)["buf0"]
    # Reads walk the whole (64 x 128) space, row-major; the write is one per row.
    row_major = 128 * c0 + c1
    assert deps(node, "reads") == {("arg0_1", row_major, (64, 128)),
                                   ("arg1_1", row_major, (64, 128)),
                                   ("arg2_1", row_major, (64, 128))}
    assert deps(node, "writes") == {("buf0", c0, (64,))}


def test_broadcast_transposed_and_sliced_reads() -> None:
    def fn(x: torch.Tensor, bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x + bias + y.t()[:, 4:132]

    sg = compile_fn(fn, rand(64, 128), rand(128), rand(132, 64))
    node = inner_nodes(sg)["buf0"]
    assert deps(node, "reads") == {
        ("arg0_1", 128 * c0 + c1, (64, 128)),
        ("arg1_1", c1, (64, 128)),          # the bias does not depend on the row
        ("arg2_1", c0 + 64 * c1 + 256, (64, 128)),  # y[4 + c1, c0]: stride 64, offset 4*64
    }
    assert deps(node, "writes") == {("buf0", 128 * c0 + c1, (64, 128))}


def test_reduction_over_leading_dim_reads_by_column() -> None:
    sg = compile_fn(lambda x: x.exp().sum(0), rand(64, 128))
    node = inner_nodes(sg)["buf0"]
    # Output index c0 (the column), reduction index c1 (the row).
    assert deps(node, "reads") == {("arg0_1", c0 + 128 * c1, (128, 64))}
    assert deps(node, "writes") == {("buf0", c0, (128,))}


def test_normalize_dep_merges_contiguous_loops_and_drops_size_one() -> None:
    row_major = MemoryDep("buf0", 128 * c0 + c1, (c0, c1), (sympy.Integer(64),
                                                             sympy.Integer(128)))
    flat = MemoryDep("buf0", c0, (c0,), (sympy.Integer(8192),))
    assert normalize_dep(row_major) == normalize_dep(flat)
    with_unit = MemoryDep("buf0", 128 * c0 + c2, (c0, c1, c2),
                          (sympy.Integer(64), sympy.Integer(1), sympy.Integer(128)))
    assert normalize_dep(with_unit) == normalize_dep(flat)
    # A transposed walk, and a broadcast (a loop the index ignores), stay unmerged.
    transposed = MemoryDep("buf0", c0 + 64 * c1, (c0, c1), (sympy.Integer(64),
                                                            sympy.Integer(128)))
    assert normalize_dep(transposed).size == (64, 128)
    broadcast = MemoryDep("buf0", c0, (c0, c1), (sympy.Integer(64), sympy.Integer(128)))
    assert normalize_dep(broadcast) == broadcast
    # The index is the size-1 loop alone (linalg.cond's graph): it becomes the constant 0.
    unit_only = MemoryDep("buf0", c1, (c0, c1), (sympy.Integer(2), sympy.Integer(1)))
    assert normalize_dep(unit_only).index == 0
    assert normalize_dep(unit_only).size == (2,)


def test_extern_kernel_reads_and_writes_are_star_deps() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x.relu() @ w) + 1

    sg = compile_fn(fn, rand(64, 128), rand(128, 32))
    nodes = inner_nodes(sg)
    mm = nodes["buf1"]
    assert isinstance(mm, ExternKernelSchedulerNode)
    assert mm.read_writes.reads == {StarDep("buf0"), StarDep("arg1_1")}
    assert mm.read_writes.writes == {StarDep("buf1")}
    # The epilogue reads the mm's output element by element.
    assert deps(nodes["buf2"], "reads") == {("buf1", 32 * c0 + c1, (64, 32))}


def test_mutation_is_ordered_after_earlier_reader_by_weak_dep() -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s = x.sum(-1)
        x.copy_(y * 2)
        return s

    sg = compile_fn(fn, rand(64, 128), rand(64, 128))
    nodes = inner_nodes(sg)
    reader, mutation = nodes["buf0"], nodes["buf1"]
    assert reader.read_writes.read_names() == {"arg0_1"}
    assert mutation.node.get_mutation_names() == ["arg0_1"]  # type: ignore[attr-defined]
    assert WeakDep("buf0", mutating_buf="buf1") in mutation.unmet_dependencies
    order = [n.get_name() for n in sg.scheduler.nodes]
    assert order.index("buf0") < order.index("buf1")
    # A WeakDep orders only: the reader's buffer is not kept alive by it.
    assert "buf0" not in mutation.used_buffer_names()


def test_weak_dep_order_holds_against_original_order() -> None:
    # Swap the two nodes' original positions: the topological sort must restore
    # reader-before-mutation from the WeakDep alone.
    def fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        s = x.sum(-1)
        x.copy_(y * 2)
        return s

    sg = compile_fn(fn, rand(64, 128), rand(64, 128))
    sched = sg.scheduler
    nodes = inner_nodes(sg)
    nodes["buf0"].min_order, nodes["buf1"].min_order = 1, 0
    nodes["buf0"].max_order, nodes["buf1"].max_order = 1, 0
    sched.topological_sort()
    assert [n.get_name() for n in sched.nodes] == ["buf0", "buf1"]


def test_mutation_does_not_fuse_with_a_transposed_reader_of_its_target() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        z = x + x.t()
        x.copy_(x * 2)
        return z

    sg = compile_fn(fn, rand(64, 64))
    nodes = inner_nodes(sg)
    mutation = next(n for n in nodes.values()
                    if n.node.get_mutation_names() == ["arg0_1"])  # type: ignore[attr-defined]
    transposed_reader = nodes["buf0"]
    assert ("arg0_1", c0 + 64 * c1, (64, 64)) in deps(transposed_reader, "reads")
    # Fused, element (i, j) would overwrite x[i, j] before element (j, i) reads it.
    kernel = next(n for n in sg.scheduler.nodes if transposed_reader in n.get_nodes())
    assert mutation not in kernel.get_nodes()
    weak = next(d for d in mutation.unmet_dependencies
                if isinstance(d, WeakDep) and d.name == "buf0")
    assert not sg.scheduler.fusable_weak_dep(weak, kernel, mutation)


def test_mutation_fuses_with_an_in_place_reader_of_its_target() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        s = x.sum(-1)
        x.copy_(x * 2)
        return s

    sg = compile_fn(fn, rand(64, 64))
    # The reader reads x[i, j] in the very iteration that writes x[i, j]: one kernel.
    assert len(sg.scheduler.nodes) == 1
    names = [n.get_name() for n in sg.scheduler.nodes[0].get_nodes()]
    mutation = sg.graph.mutated_inputs["arg0_1"]
    assert names.index("buf0") < names.index(mutation)


def test_weak_dep_does_not_keep_a_dead_reader_alive() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        x.sum()  # dead: its value is never used
        x.copy_(x * 2)
        return x * 3

    sg = compile_fn(fn, rand(64, 64))
    assert "buf0" not in inner_nodes(sg)


def test_view_read_keeps_its_base_alive_until_the_reader() -> None:
    def fn(x: torch.Tensor, w: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor) -> Any:
        y = x @ w                     # buf0
        z = y.t()[2:10] * 2           # reads buf0 through a transpose and a slice
        u = y.t() @ w3                # an extern kernel reading a strided view of buf0
        return z, x @ w2, u

    sg = compile_fn(fn, rand(64, 128), rand(128, 128), rand(128, 32), rand(64, 16))
    nodes = inner_nodes(sg)
    order = [n.get_name() for n in sg.scheduler.nodes]
    assert order == ["buf0", "buf1", "buf2", "buf3"]
    view_mm, pointwise = nodes["buf1"], nodes["buf3"]
    assert StarDep("buf0") in view_mm.read_writes.reads
    assert deps(pointwise, "reads") == {("buf0", c0 + 128 * c1 + 2, (8, 64))}
    where_last = [n.get_name() for n in sg.scheduler.nodes if "buf0" in n.last_usage]
    assert where_last == ["buf3"]
