"""The OpInfo CI subset through ``backend="kiln"`` with Triton kernels run by Triton's
interpreter on CPU tensors (``KILN_CPU_BACKEND=triton-interpret``): the same harness as
``tests/cpu/test_opinfo.py``, so the Triton code generator meets the same ops."""

from __future__ import annotations

import pytest
import torch

from tests.opinfo_harness import FAST_OPS, run_op, select_ops

# Ops whose samples are large enough that the interpreter takes minutes: the C++ run
# covers them.
SLOW_UNDER_INTERPRETER = {"nn.functional.linear_cross_entropy", "linalg.inv", "topk"}


@pytest.fixture(autouse=True)
def _triton_interpret(kiln_isolated: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fresh store, in process (tests/conftest.py), CPU graphs on the Triton interpreter."""
    monkeypatch.setenv("KILN_CPU_BACKEND", "triton-interpret")


@pytest.mark.parametrize("op", select_ops([n for n in FAST_OPS
                                           if n not in SLOW_UNDER_INTERPRETER]),
                         ids=lambda op: op.formatted_name)
def test_opinfo_fast_subset_triton_interpreter(op: object) -> None:
    result = run_op(op, "cpu", torch.float32, max_samples=2)
    assert result.status in ("pass", "skipped"), f"{result.op}: {result.status}: " \
        f"{result.detail}"
