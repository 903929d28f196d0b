"""Per-op fallback: an op Kiln cannot lower runs eagerly inside the compiled graph (a
``FallbackKernel`` in the wrapper) and the rest of the graph stays compiled. Each case
is one category OpInfo found running whole graphs eagerly: complex values, tensor
constants, the ``with_effects`` higher-order op, ops with no meta kernel, a lowering that
raises. Every test compiles with ``backend="kiln"``, fails on ``KilnFallbackWarning`` and
compares with eager."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from kiln import KilnFallbackWarning
from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.compiled_graph import load as load_graph

aten = torch.ops.aten


@pytest.fixture(autouse=True)
def _isolated(kiln_isolated: None) -> None:
    """Every test compiles in this process against a fresh store."""


@pytest.fixture
def compiled_graphs() -> Iterator[list[CompiledGraph]]:
    """The graphs Kiln compiles during the test, in order."""
    from kiln.frontend.core import compile as kiln_compile

    seen: list[CompiledGraph] = []

    def observe(name: str, result: Any) -> None:
        seen.append(result.compiled)

    kiln_compile.observers.append(observe)
    yield seen
    kiln_compile.observers.remove(observe)


def run_compiled(fn: Callable[..., Any], *args: torch.Tensor) -> Any:
    """``fn`` compiled by Kiln and run; a whole-graph eager fallback fails the test."""
    compiled = torch.compile(fn, backend="kiln", dynamic=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        return compiled(*args)


def fallback_ops(graph: CompiledGraph) -> list[str]:
    """The ATen ops the wrapper calls eagerly (``torch.ops.<ns>.<op>.<overload>(``)."""
    import re

    return re.findall(r"= torch\.ops\.([\w.]+)\(", graph.wrapper_source)


def test_complex_ops_fall_back_and_the_rest_compiles(
        compiled_graphs: list[CompiledGraph]) -> None:
    def fn(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.complex(x, y) * torch.complex(y, x)
        return torch.view_as_real(z).sum(-1), (x.sin() + y).relu()

    x, y = torch.randn(8, 16), torch.randn(8, 16)
    got = run_compiled(fn, x, y)
    want = fn(x, y)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    (graph,) = compiled_graphs
    eager = fallback_ops(graph)
    assert "aten.complex.default" in eager and "aten.mul.Tensor" in eager, eager
    # The real part (sin, add, relu, and the sum over view_as_real's output) is kernels.
    assert len(graph.kernels) >= 1 and all(k.backend == "cpp" for k in graph.kernels)
    assert "aten.sin.default" not in eager and "aten.relu.default" not in eager


def test_complex_inputs_and_outputs(compiled_graphs: list[CompiledGraph]) -> None:
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * b + a).conj_physical()

    a = torch.randn(5, 7, dtype=torch.complex64)
    b = torch.randn(5, 7, dtype=torch.complex64)
    torch.testing.assert_close(run_compiled(fn, a, b), fn(a, b), rtol=1e-5, atol=1e-5)
    assert compiled_graphs and not compiled_graphs[0].kernels


def test_masked_sum_with_a_tensor_constant(compiled_graphs: list[CompiledGraph]) -> None:
    from torch.masked import _ops as masked

    def fn(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return masked.sum(x, 1, mask=mask) * 2

    x, mask = torch.randn(6, 9), torch.rand(6, 9) > 0.4
    torch.testing.assert_close(run_compiled(fn, x, mask), fn(x, mask), rtol=1e-5, atol=1e-5)
    assert any(g.constant_names for g in compiled_graphs)


def test_with_effects_keeps_the_error_check() -> None:
    """linalg.inv checks for a singular matrix under with_effects: the compiled graph keeps
    that check (it is not dead code) and raises as eager does."""
    fn = torch.linalg.inv
    x = torch.randn(4, 4) + 4 * torch.eye(4)
    torch.testing.assert_close(run_compiled(fn, x), fn(x), rtol=1e-4, atol=1e-5)
    singular = torch.ones(4, 4)
    with pytest.raises(torch.linalg.LinAlgError):
        fn(singular)
    with pytest.raises(torch.linalg.LinAlgError):
        run_compiled(fn, singular)


@pytest.mark.parametrize("which", ["geqrf", "histogram"])
def test_op_with_no_meta_kernel_is_a_fallback_kernel(
        which: str, compiled_graphs: list[CompiledGraph]) -> None:
    def geqrf(x: torch.Tensor) -> Any:
        a, tau = torch.geqrf(x.exp())
        return a + 1, tau

    def histogram(x: torch.Tensor) -> Any:
        hist, edges = torch.histogram(x * 2, bins=5)
        return hist + 1, edges

    fn = geqrf if which == "geqrf" else histogram
    x = torch.randn(6, 4)
    for g, w in zip(run_compiled(fn, x), fn(x)):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    eager = [op for g in compiled_graphs for op in fallback_ops(g)]
    assert any(op.startswith(f"aten.{which}") for op in eager), eager
    assert any(g.kernels for g in compiled_graphs)  # exp / mul and the +1 are kernels


def test_a_failing_lowering_becomes_a_fallback_kernel(
        monkeypatch: pytest.MonkeyPatch, compiled_graphs: list[CompiledGraph],
        caplog: pytest.LogCaptureFixture) -> None:
    from kiln.compiler.lowering import lowerings

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise IndexError("a bug in the lowering")

    monkeypatch.setitem(lowerings, aten.cos.default, broken)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return x.cos().sum(0) + x.sin().sum(0)

    x = torch.randn(16, 8)
    with caplog.at_level("WARNING", logger="kiln.graph"):
        torch.testing.assert_close(run_compiled(fn, x), fn(x), rtol=1e-5, atol=1e-5)
    assert "IndexError: a bug in the lowering" in caplog.text and "aten.cos" in caplog.text
    (graph,) = compiled_graphs
    assert fallback_ops(graph) == ["aten.cos.default"]
    assert graph.kernels


def test_zero_dim_index_select_and_squeeze_dims(check_lowering: Any) -> None:
    x = torch.randn(())
    check_lowering(lambda t, i: torch.index_select(t, 0, i), x, torch.tensor([0]))
    check_lowering(lambda t: aten.squeeze.dims(t, [0]), x)
    check_lowering(lambda t: aten.squeeze.dims(t, [0, -1]), torch.randn(1, 3, 1))


def test_fallback_output_whose_meta_dtype_is_wrong_is_converted(
        compiled_graphs: list[CompiledGraph]) -> None:
    """``_batch_norm_with_update`` on bf16: torch's meta kernel says float32 running
    stats, the CPU kernel returns bf16. The kernel that writes them back into the running
    buffers read bf16 memory as float (garbage running mean); the wrapper now converts a
    fallback output to its planned dtype."""
    def fn(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, mean: torch.Tensor,
           var: torch.Tensor) -> Any:
        return aten._batch_norm_with_update(x, w, b, mean, var, 0.5, 0.6)

    bf = torch.bfloat16
    args = [torch.randn(5, 5, 5, dtype=bf), torch.randn(5, dtype=bf), torch.randn(5, dtype=bf),
            torch.randn(5, dtype=bf), torch.rand(5, dtype=bf) + 0.5]
    mine, ref = [a.clone() for a in args], [a.clone() for a in args]
    got, want = run_compiled(fn, *mine), fn(*ref)
    torch.testing.assert_close(got[0], want[0], rtol=2e-2, atol=2e-2)
    for m, r in zip(mine[3:], ref[3:]):  # the running mean and variance, updated in place
        torch.testing.assert_close(m, r, rtol=2e-2, atol=2e-2)
    (graph,) = compiled_graphs
    assert "aten._batch_norm_with_update_functional.default" in fallback_ops(graph)
    assert "torch.bfloat16)" in graph.wrapper_source  # the planned dtype is checked


def test_the_collectives_output_lives_as_long_as_its_wait() -> None:
    """``wait_tensor`` returns the collective's output, though its schema does not say so:
    that storage is not handed to a later kernel while the wait's result is still read
    (it was: a kernel wrote over the all-reduced values before their last reader)."""
    from kiln.compiler.decompositions import trace_aten
    from kiln.compiler.driver import compile_graph

    c10d = torch.ops._c10d_functional

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = c10d.wait_tensor(c10d.all_reduce(x * 2, "sum", "0"))
        a = y.sin() @ x
        return (a + 1) @ x + y

    args = [torch.randn(16, 16)]
    source = compile_graph(trace_aten(fn, args), args, {}, name="wait").wrapper_source
    reduced = re.search(r"(buf\d+) = torch\.ops\._c10d_functional\.all_reduce", source)
    assert reduced is not None, source
    assert f"= {reduced.group(1)}; del {reduced.group(1)}  # reuse" not in source, source


def test_an_aten_ops_output_is_never_handed_to_a_later_kernel() -> None:
    """The storage an op run as ATen's kernel returns is the op's choice: a tensor the
    meta says is (8, 16384) may come back empty, or as None (cuDNN attention's logsumexp
    in inference on the H100: segformer's wrapper reinterpreted None). Only storage the
    wrapper allocated itself is reused."""
    from kiln.compiler.decompositions import trace_aten
    from kiln.compiler.driver import compile_graph

    def fn(x: torch.Tensor) -> torch.Tensor:
        y = torch.sort(x, 0).values  # run as ATen's kernel
        z = y.sin() @ x
        return (z.cos() @ x).exp()

    args = [torch.randn(16, 16)]
    compiled = compile_graph(trace_aten(fn, args), args, {}, name="donor")
    source = compiled.wrapper_source
    made = re.search(r"(buf\d+) = buf\d+\[0\]", source)  # sort's values
    assert made is not None, source
    assert f"= reinterpret_tensor({made.group(1)}," not in source, source
    assert f"= {made.group(1)}; del {made.group(1)}  # reuse" not in source, source
    torch.testing.assert_close(load_graph(compiled)([a.clone() for a in args])[0], fn(*args),
                               rtol=1e-4, atol=1e-4)
