"""Complex-valued ops run eagerly inside the compiled graph, laid out as on their device.

A fallback's output layout comes from its meta kernel, and meta kernels choose strides per
device (cuFFT and MKL lay FFT outputs out differently; CUDA's eigenvectors are
row-major). Run on bare meta tensors, those kernels took every host for CUDA, and under
an outer fake mode (Dynamo's, while the backend compiles) for the CPU: the planned layout
differed from the traced one, and the copy into the traced layout was a kernel over
complex values, which neither code generator can type. On the H200 (torch 2.11) that was
six OpInfo ops running their whole graph eagerly ("KeyError: torch.complex64" in a Triton
signature); here the same graphs are built on fake CUDA tensors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.compiler.compiled_graph import CompiledGraph, load
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.runtime.kernel_files import interpreter_active

fft = torch.fft

# The first OpInfo sample of each op that fell back on the H200 (plus rfftn's second),
# and how many kernels the rest of its graph needs (the zero padding of ``n=10``).
CASES: dict[str, tuple[Callable[..., Any], tuple[int, ...], int]] = {
    "fft": (lambda x: fft.fft(x, n=10, dim=1, norm="ortho"), (5, 6, 7), 1),
    "rfft": (lambda x: fft.rfft(x, n=10, dim=1, norm="ortho"), (5, 6, 7), 1),
    "rfftn": (lambda x: fft.rfftn(x, norm="ortho"), (5, 6, 7), 0),
    "rfftn_s": (lambda x: fft.rfftn(x, s=(3, 10), dim=(1, 2), norm="ortho"), (5, 6, 7), 1),
    "ifft": (lambda x: fft.ifft(x, n=10, dim=1, norm="ortho"), (5, 6, 7), 1),
    "ihfft": (lambda x: fft.ihfft(x, n=10, dim=1, norm="ortho"), (5, 6, 7), 1),
    "eig": (lambda x: list(torch.linalg.eig(x)), (5, 5), 0),
    # A complex intermediate whose real result feeds compiled kernels.
    "rfft_abs": (lambda x: (fft.rfft(x.sin(), dim=0).abs() * 2).sum(1), (6, 5, 4), 2),
}


def _flat(value: Any) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _traced_strides(gm: torch.fx.GraphModule) -> list[tuple[int, ...]]:
    out = next(n for n in gm.graph.nodes if n.op == "output")
    return [tuple(a.meta["val"].stride()) for a in _flat(out.args[0])]


def _check_code(compiled: CompiledGraph, kernels: int) -> None:
    """The complex ops are eager calls, the real rest is kernels, and no output is copied
    into another layout (the fallback's layout is the traced one)."""
    assert len(compiled.kernels) == kernels, [k.name for k in compiled.kernels]
    src = compiled.wrapper_source
    assert "torch.ops.aten._fft_" in src or "torch.ops.aten.linalg_eig" in src, src
    assert "aten.clone" not in src, src


@pytest.mark.parametrize("case", sorted(CASES))
def test_complex_graph_compiles_on_the_cpu_and_matches_eager(case: str) -> None:
    """As a farm worker compiles (no outer fake mode), run, compared with eager."""
    fn, shape, kernels = CASES[case]
    x = torch.randn(shape)
    gm = trace_aten(lambda t: _flat(fn(t)), [x], functionalize=True)
    compiled = compile_graph(gm, [x], {}, name=f"complex_{case}")
    _check_code(compiled, kernels)
    got = load(compiled)([x.clone()])
    want = _flat(fn(x))
    assert len(got) == len(want)
    # The trace's strides (what AOTAutograd promises; torch 2.11's CPU rfft meta differs
    # from its kernel, so not always eager's).
    for g, w, traced in zip(got, want, _traced_strides(gm)):
        assert g.dtype == w.dtype and g.shape == w.shape
        if g.numel() > 1:
            assert g.stride() == traced, (g.stride(), traced, w.stride())
        if case == "eig":  # eigenpairs are unique up to order and phase: check A v = v l
            continue
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    if case == "eig":
        vals, vecs = got
        a = x.to(torch.complex64)
        torch.testing.assert_close(a @ vecs, vecs * vals, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(interpreter_active(), reason="Triton was imported for its interpreter")
@pytest.mark.parametrize("case", sorted(CASES))
def test_complex_graph_compiles_for_cuda_under_an_outer_fake_mode(case: str) -> None:
    """Fake CUDA tensors, compiled inside a FakeTensorMode as the backend is inside
    Dynamo's: no kernel takes a complex buffer, and the fallbacks' layouts are CUDA's."""
    fn, shape, kernels = CASES[case]
    with FakeTensorMode():
        x = torch.empty(shape, device="cuda")
    gm = trace_aten(lambda t: _flat(fn(t)), [x], functionalize=True)
    with FakeTensorMode():
        compiled = compile_graph(gm, [x], {}, name=f"complex_{case}", compile_kernels=False)
    _check_code(compiled, kernels)
    assert all(k.backend == "triton" for k in compiled.kernels)
    if case == "eig":  # CUDA's eigenvectors are row-major (the CPU's column-major)
        assert _traced_strides(gm)[1] == (5, 1)
        assert "as_layout(buf2, (5, 5), (5, 1), torch.complex64)" in compiled.wrapper_source


def test_complex_output_in_another_layout_is_copied_eagerly() -> None:
    """Where the trace lays a complex output out otherwise than its fallback (another
    torch's meta kernel), the wrapper copies it eagerly into the traced layout."""
    x = torch.randn(4, 6, 8)
    gm = trace_aten(lambda t: [fft.fft(t)], [x], functionalize=True)
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    traced = out.meta["val"]
    assert traced.dtype == torch.complex64 and traced.stride() == (48, 8, 1)
    with FakeTensorMode():  # the same values, dimension 1 outermost
        out.meta["val"] = torch.empty(6, 4, 8, dtype=torch.complex64).permute(1, 0, 2)
    compiled = compile_graph(gm, [x], {}, name="complex_relayout")
    assert not compiled.kernels
    assert "torch.ops.aten.clone.default(" in compiled.wrapper_source
    assert "(4, 6, 8), (8, 32, 1), torch.complex64)" in compiled.wrapper_source
    (got,) = load(compiled)([x.clone()])
    assert got.stride() == (8, 32, 1)
    torch.testing.assert_close(got, fft.fft(x), rtol=1e-4, atol=1e-5)
