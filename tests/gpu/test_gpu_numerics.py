"""The numerics suite on a real GPU: kernels compiled to cubins for the device and
launched from their binaries, against eager on the same device."""

from __future__ import annotations

import pytest
import torch

from kiln.compiler.compiled_graph import load
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from tests.numerics_cases import (
    ALL_CASES,
    Case,
    case_id,
    case_seed,
    expand_cases,
    is_reduction,
    tolerance,
)
from tests.triton_interp.helpers import assert_close_to_eager

CASES = expand_cases(ALL_CASES)


def target() -> dict[str, object]:
    major, minor = torch.cuda.get_device_capability()
    return {"kind": "cuda", "backend": "cuda", "arch": major * 10 + minor, "warp_size": 32}


def run_case(case: Case, dtype: torch.dtype) -> None:
    args = [a.cuda() for a in case.inputs(dtype)]
    gm = trace_aten(case.fn, args)
    compiled = compile_graph(gm, args, {}, name=case.name, target=target())
    assert set(compiled.binaries) == {k.name for k in compiled.kernels}
    outs = load(compiled)([a.clone() for a in args])
    ref = case.fn(*args)
    refs = ref if isinstance(ref, tuple) else (ref,)
    for i, (out, r) in enumerate(zip(outs, refs)):
        def fp64(i: int = i) -> torch.Tensor:
            wide = [a.double() if a.is_floating_point() else a for a in args]
            res = case.fn(*wide)
            return (res if isinstance(res, tuple) else (res,))[i]

        assert_close_to_eager(out, r, fp64, tolerance(dtype, is_reduction(case)))
        assert out.shape == r.shape and out.device == r.device


@pytest.mark.gpu
@pytest.mark.parametrize("item", CASES, ids=[case_id(c) for c in CASES])
def test_case_matches_eager_on_gpu(item: tuple[Case, torch.dtype]) -> None:
    case, dtype = item
    torch.manual_seed(case_seed(case))
    run_case(case, dtype)


@pytest.mark.gpu
def test_binaries_launch_without_jit(monkeypatch: pytest.MonkeyPatch) -> None:
    from kiln.compiler.runtime import triton_launcher

    args = [torch.randn(64, 128, device="cuda") for _ in range(3)]
    fn = lambda a, b, c: ((a + b) * c.relu()).sum(dim=-1)  # noqa: E731
    compiled = compile_graph(trace_aten(fn, args), args, {}, name="seed", target=target())

    def no_import(*a: object, **k: object) -> None:
        raise AssertionError("the hit path imported kernel source")

    monkeypatch.setattr(triton_launcher, "import_source", no_import)
    call = load(compiled)
    torch.testing.assert_close(call(list(args))[0], fn(*args), atol=1e-4, rtol=1e-4)
