"""Every kernel the numerics suite generates compiles to a cubin for sm_90 on this
machine, which has no GPU: graphs are traced on fake CUDA tensors and their kernels
compiled for an explicit target."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.kernel_compile import compile_kernel
from kiln.compiler.runtime.kernel_files import interpreter_active
from tests.numerics_cases import ALL_CASES, case_id, expand_cases
from tests.targets import SM90

CASES = expand_cases(ALL_CASES)

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


def fake_cuda(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fake CUDA tensors shaped like ``tensors`` (no GPU needed to trace and compile)."""
    with FakeTensorMode():
        return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
                for t in tensors]


def cuda_graph(case, dtype):  # type: ignore[no-untyped-def]
    inputs = case.inputs(dtype)
    args = fake_cuda(inputs)
    try:
        gm = trace_aten(case.fn, args)
    except RuntimeError:  # indexing that make_fx cannot trace on fake CUDA: trace on CPU
        gm = trace_aten(case.fn, inputs)
    return compile_graph(gm, args, {}, name=case.name, compile_kernels=False)


def test_every_suite_kernel_compiles_for_sm90() -> None:
    seen: dict[str, object] = {}
    for case, dtype in CASES:
        compiled = cuda_graph(case, dtype)
        assert compiled.device_type == "cuda", case_id((case, dtype))
        for spec in compiled.kernels:
            seen.setdefault(spec.source, spec)
    assert len(seen) > 100
    for spec in seen.values():
        binary = compile_kernel(spec, dict(spec.configs[0]), SM90)  # type: ignore[arg-type]
        assert binary.binary[:4] == b"\x7fELF", spec.name  # type: ignore[attr-defined]
        assert binary.metadata["target"]["arch"] == 90
        assert binary.metadata["name"] == spec.name  # type: ignore[attr-defined]


def test_in_process_compile_gives_one_binary_per_kernel() -> None:
    case = next(c for c in ALL_CASES if c.name == "layer_norm")
    args = fake_cuda(case.inputs(torch.float16))
    gm = trace_aten(case.fn, args)
    compiled = compile_graph(gm, args, {}, name="ln", target=SM90)
    assert set(compiled.binaries) == {k.name for k in compiled.kernels}
    assert all(b.binary for b in compiled.binaries.values())
    assert "align_input(arg0_1)" in compiled.wrapper_source
