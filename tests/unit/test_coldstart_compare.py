"""bench/coldstart_models.compare: a row's numerics failure names the output that failed,
how many of its values are NaN or infinite, and each output's scaled error (the H200's
ResNet-50 training rows said only "scaled error 0.187" for a NaN somewhere, 2026-12-04)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from coldstart_models import compare, max_error  # noqa: E402

TOL = {"atol": 1e-3, "rtol": 1e-3}


def _outputs() -> list[torch.Tensor]:
    torch.manual_seed(3)
    return [torch.randn(()), torch.randn(64, 32), torch.randn(16)]


def test_a_nan_is_named_and_counted() -> None:
    ref = _outputs()
    got = [t.clone() for t in ref]
    got[1][3, 4] = float("nan")
    got[1][5, 6] = float("inf")
    got[1][7, 8] = float("nan")
    got[2] += 0.5 * TOL["atol"] * torch.rand(16)  # within tolerance
    checked = compare(got, ref, TOL, ("loss", "grad fc.weight"))
    assert not checked.ok and math.isinf(checked.worst)
    bad = checked.outputs[1]
    assert (bad.name, bad.nan, bad.inf, bad.values) == ("grad fc.weight", 2, 1, 2048)
    assert bad.worst == 0.0  # the rest equal eager's
    assert checked.outputs[2].name == "output 2" and 0 < checked.outputs[2].worst <= 1
    problem = checked.problem()
    assert problem.startswith("grad fc.weight: 2 NaN and 1 inf of 2048 values"), problem
    assert "(passed) loss: scaled error 0" in problem
    assert max_error(got, ref, TOL) == (False, math.inf)


def test_a_difference_is_named_with_each_outputs_error() -> None:
    ref = _outputs()
    got = [t.clone() for t in ref]
    got[0] = got[0] + 0.1
    checked = compare(got, ref, TOL, ("loss",))
    assert not checked.ok and checked.worst > 1
    assert checked.problem().startswith("loss: scaled error ")
    assert [o.ok for o in checked.outputs] == [False, True, True]


def test_eagers_own_nan_must_be_matched() -> None:
    ref = _outputs()
    ref[1][0, 0] = float("nan")
    same = [t.clone() for t in ref]
    assert compare(same, ref, TOL).ok
    finite_here = [t.clone() for t in ref]
    finite_here[1][0, 0] = 1.0
    assert not compare(finite_here, ref, TOL).ok


def test_shapes_and_counts() -> None:
    ref = _outputs()
    assert not compare(ref[:2], ref, TOL).ok
    assert not compare([ref[0], ref[1].t(), ref[2]], ref, TOL).ok
    assert compare([t.clone() for t in ref], ref, TOL).ok
    assert max_error([t.clone() for t in ref], ref, TOL) == (True, 0.0)
