"""Graph inputs that are objects the graph only passes along (a tensor-parallel graph's
device mesh): taken out of the compiled graph and put back around it
(frontend/core/opaque.py)."""

from __future__ import annotations

import pytest
import torch

from kiln.frontend.core.opaque import without_opaque_inputs


class Mesh:
    """Stands in for a device mesh: an object with no tensor type."""


def _graph(reads_object: bool) -> torch.fx.GraphModule:
    g = torch.fx.Graph()
    x, mesh, y = g.placeholder("x"), g.placeholder("mesh"), g.placeholder("y")
    s = g.call_function(torch.ops.aten.add.Tensor, (x, y))
    if reads_object:
        s = g.call_function(torch.ops.aten.mul.Tensor, (s, mesh))
    g.output((s, mesh, y))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_a_passed_along_object_leaves_the_graph_and_comes_back_in_its_output_slot() -> None:
    mesh, x, y = Mesh(), torch.randn(3), torch.randn(3)
    stripped = without_opaque_inputs(_graph(False), [x, mesh, y])
    assert stripped is not None
    gm, inputs, where = stripped
    assert [n.name for n in gm.graph.find_nodes(op="placeholder")] == ["x", "y"]
    assert len(inputs) == 2 and inputs[0] is x and inputs[1] is y
    seen: list[list[torch.Tensor]] = []

    def compiled(args: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(list(args))
        return gm(*args)

    args = [x, mesh, y]
    out = where.wrap(compiled)(args)
    assert args == []  # the boxed convention: the inputs were handed over
    assert seen[0][0] is x and seen[0][1] is y
    assert out[1] is mesh and out[2] is y
    torch.testing.assert_close(out[0], x + y)


def test_an_object_an_op_reads_is_named() -> None:
    with pytest.raises(ValueError, match="input 1 .*Mesh.* read by aten.mul"):
        without_opaque_inputs(_graph(True), [torch.randn(3), Mesh(), torch.randn(3)])


def test_tensors_and_sizes_only_is_left_alone() -> None:
    assert without_opaque_inputs(_graph(False), [torch.randn(3), 2, torch.randn(3)]) is None
