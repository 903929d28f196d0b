"""The differential fuzzer (``tests/fuzz_graphs.py``): random graphs of pointwise ops,
reductions, views, broadcasts, indexing and matmuls through Kiln's C++ backend against
eager. CI runs a fixed budget of seeds; ``KILN_FUZZ_GRAPHS=2000`` runs more, from
``KILN_FUZZ_SEED`` (default 0); ``KILN_FUZZ_LOG=path`` records each seed as it is checked.
A failure prints its shrunk reproduction."""

from __future__ import annotations

import os

import pytest
import torch

from tests.fuzz_graphs import (
    Failure,
    Input,
    Node,
    Program,
    check_program,
    fuzz,
    prune,
    random_program,
    shrink,
)

CI_GRAPHS = 40


def test_random_graphs_match_eager() -> None:
    count = int(os.environ.get("KILN_FUZZ_GRAPHS", CI_GRAPHS))
    first = int(os.environ.get("KILN_FUZZ_SEED", 0))
    failures = fuzz(range(first, first + count))
    assert not failures, f"{len(failures)} of {count} graphs failed:\n\n" + "\n\n".join(
        f.report() for f in failures)


# Graphs the fuzzer found failing, shrunk; each was a bug, fixed.
FOUND = {
    # matmul(1-D, 2-D) traces to mm + squeeze_ (a FallbackKernel whose result is a view
    # of the mm's buffer): the memory plan handed the mm's storage to abs's output while
    # the squeezed view (an output) still lived in it.
    "vector_matrix_then_reuse": Program(
        (Input((5,)), Input((5, 3))),
        (Node("torch.matmul({0}, {1})", (0, 1)), Node("torch.abs({0})", (2,))), (2, 3)),
    # Seed 236: the same mm + squeeze_, at size 1. The view and the mm's buffer both died
    # at tanh and both entered the free pool, so two later outputs were given one storage.
    "view_and_source_freed_together": Program(
        (Input((1,)), Input((1, 1))),
        (Node("torch.matmul({0}, {1})", (0, 1)), Node("torch.tanh({0})", (2,)),
         Node("torch.log(torch.abs({0}) + 1.0)", (0,)), Node("({0} * {1})", (0, 0))),
        (3, 4, 5)),
    # Seed 983: tanh computed inside logsumexp's first loop (atan2 reads it) and stored as
    # an output after the loops: the C++ kernel read it back from the first loop's row
    # buffer at ``r0``, which does not exist there (g++ refused the kernel).
    "row_value_read_after_the_loops": Program(
        (Input((5, 1, 5, 4)),),
        (Node("torch.tanh({0})", (0,)), Node("{0}.permute([1, 0, 2, 3])", (1,)),
         Node("torch.atan2({0}, {1})", (0, 2)),
         Node("torch.logsumexp({0}, 0, keepdim=False)", (3,))),
        (0, 2, 3, 4)),
}


@pytest.mark.parametrize("name", FOUND)
def test_graphs_the_fuzzer_found(name: str) -> None:
    for seed in range(3):
        failure = check_program(FOUND[name], seed)
        assert failure is None, failure.report()


def test_programs_are_reproducible_and_cover_every_kind() -> None:
    sources = [random_program(seed).source() for seed in range(200)]
    assert sources == [random_program(seed).source() for seed in range(200)]
    text = "\n".join(sources)
    for needle in ("torch.matmul", "torch.index_select", "torch.gather", ".flip(", ".sum(",
                   ".permute(", ".expand(", "torch.cat", "torch.maximum", ".diagonal("):
        assert needle in text, needle


def test_shrink_finds_the_minimal_failing_graph() -> None:
    """A checker that fails any graph with a ``torch.atan2`` node: shrinking a bigger
    failing graph keeps only that node (and what it needs)."""
    program = Program(
        inputs=(Input((4, 5)), Input((5,))),
        nodes=(Node("torch.sin({0})", (0,)), Node("({0} + {1})", (2, 1)),
               Node("{0}.sum(1, keepdim=False)", (3,)), Node("torch.atan2({0}, {1})", (3, 2)),
               Node("torch.relu({0})", (5,)), Node("({0} * {1})", (6, 3))),
        outputs=(4, 7))

    def check(p: Program, seed: int) -> Failure | None:
        p.function()(*p.make_inputs(seed))  # every candidate is a valid program
        bad = any("atan2" in n.template for n in p.nodes)
        return Failure("mismatch", "atan2 is wrong", p, seed) if bad else None

    found = check(program, 0)
    assert found is not None
    small = shrink(found, check)
    assert [n.template for n in small.program.nodes] == ["torch.atan2({0}, {1})"]
    assert small.shrunk_from == 6 and small.program.source() == (
        "def fn(x0):\n    v0 = torch.atan2(x0, x0)\n    return (v0, )")
    assert "torch.atan2" in small.report() and "shrunk from 6" in small.report()


def test_a_real_mismatch_is_caught_and_shrunk(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break one lowering (sigmoid computes tanh): the fuzzer's checker reports it and
    the shrunk program still contains sigmoid."""
    from kiln.compiler.lowering import lowerings
    from kiln.compiler.lowering.registry import make_pointwise
    from kiln.compiler.virtualized import ops

    monkeypatch.setitem(lowerings, torch.ops.aten.sigmoid.default,
                        make_pointwise(lambda x: ops.tanh(x)))
    program = Program(
        inputs=(Input((3, 4)),),
        nodes=(Node("torch.cos({0})", (0,)), Node("torch.sigmoid({0})", (1,)),
               Node("{0}.amax(0, keepdim=True)", (2,)), Node("torch.exp(torch.tanh({0}))", (0,))),
        outputs=(3, 4))
    found = check_program(program, 7)
    assert found is not None and found.kind == "mismatch"
    small = shrink(found)
    assert any("sigmoid" in n.template for n in small.program.nodes)
    assert len(small.program.nodes) <= 2 and "exp" not in small.program.source()


def test_prune_drops_what_no_output_reads() -> None:
    p = Program((Input((2,)), Input((3,))),
                (Node("torch.sin({0})", (1,)), Node("torch.cos({0})", (0,))), (2,))
    assert prune(p).source() == "def fn(x0):\n    v0 = torch.sin(x0)\n    return (v0, )"
