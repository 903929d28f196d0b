"""Kiln's accuracy check for the suite, after the rule torch's own benchmark harness uses
(``torch/_dynamo/utils.py``'s ``same``, called from ``benchmarks/dynamo/common.py``).

A compiled result ``res`` passes against the eager result ``ref`` in the same dtype if
they are close within ``tol``; failing that, if its distance from a float64 eager run
(``fp64``) is at most ``multiplier`` times eager's own distance from it (plus ``tol / 10``):
the compiled model may differ from eager, but not be less accurate than eager. The
multiplier is 3 for half-precision results and small tensors (where noise dominates), 2
otherwise. Integer and bool results must match exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    why: str = ""


def tolerance(dtype: torch.dtype, train: bool) -> float:
    """Training under autocast (and its gradients) gets torch's AMP tolerance."""
    return 1e-2 if train else (1e-3 if dtype in HALF else 1e-4)


def _rmse(a: torch.Tensor, b: torch.Tensor) -> float:
    return math.sqrt(float(torch.mean(torch.square(a.double() - b.double()))))


def _multiplier(res: torch.Tensor, fp64: torch.Tensor, tol: float) -> float:
    if res.dtype in HALF or fp64.numel() < 1000 or tol >= 2e-2:
        return 3.0
    if res.ndim == 4 and res.shape[-1] == res.shape[-2] == 1:  # 1x1 maps: noise again
        return 3.0
    return 2.0


def same_tensor(ref: torch.Tensor, res: torch.Tensor, fp64: torch.Tensor,
                tol: float) -> Verdict:
    """One result against eager's (``ref``) and float64 eager's (``fp64``)."""
    if ref.shape != res.shape:
        return Verdict(False, f"shape {tuple(res.shape)}, eager {tuple(ref.shape)}")
    if ref.dtype != res.dtype:
        return Verdict(False, f"dtype {res.dtype}, eager {ref.dtype}")
    ref, res, fp64 = ref.detach().cpu(), res.detach().cpu(), fp64.detach().cpu()
    if not ref.is_floating_point():
        equal = torch.equal(ref, res)
        return Verdict(equal, "" if equal else "integer results differ")
    if torch.allclose(ref, res, atol=tol, rtol=tol, equal_nan=True):
        return Verdict(True)
    ref_err, res_err = _rmse(fp64, ref), _rmse(fp64, res)
    limit = _multiplier(res, fp64, tol) * ref_err + tol / 10.0
    if res_err <= limit or (math.isnan(ref_err) and math.isnan(res_err)):
        return Verdict(True)
    return Verdict(False, f"RMSE vs float64 {res_err:.3g}, eager's {ref_err:.3g} "
                          f"(limit {limit:.3g}), shape {tuple(res.shape)}")


def same(ref: list[torch.Tensor], res: list[torch.Tensor], fp64: list[torch.Tensor],
         tol: float, labels: list[str] | None = None) -> Verdict:
    """Every result in turn; the verdict names the first that fails."""
    if not len(ref) == len(res) == len(fp64):
        return Verdict(False, f"{len(res)} results, eager {len(ref)}, float64 {len(fp64)}")
    for i, (a, b, c) in enumerate(zip(ref, res, fp64)):
        verdict = same_tensor(a, b, c, tol)
        if not verdict.ok:
            where = labels[i] if labels else f"result {i}"
            return Verdict(False, f"{where}: {verdict.why}")
    return Verdict(True)
