"""The model suite's accuracy rule (``bench/suite/accuracy.py``) and its report's
summary (``bench/suite/report.py``), on made-up results with known answers."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from bench.suite.accuracy import same, same_tensor
from bench.suite.report import merge, summarize


def _noisy(fp64: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return (fp64 + scale * torch.randn_like(fp64)).to(dtype)


def test_compiled_as_accurate_as_eager_passes() -> None:
    fp64 = torch.randn(64, 64, dtype=torch.float64)
    ref = _noisy(fp64, 1e-2, torch.float16)
    res = _noisy(fp64, 1e-2, torch.float16)
    assert not torch.allclose(ref, res, atol=1e-3, rtol=1e-3)  # the RMSE rule decides
    assert same_tensor(ref, res, fp64, tol=1e-3).ok


def test_compiled_far_less_accurate_than_eager_fails() -> None:
    fp64 = torch.randn(64, 64, dtype=torch.float64)
    ref = _noisy(fp64, 1e-3, torch.float16)
    res = _noisy(fp64, 1e-2, torch.float16)
    verdict = same_tensor(ref, res, fp64, tol=1e-3)
    assert not verdict.ok and "RMSE" in verdict.why


def test_shapes_dtypes_and_integers_must_match() -> None:
    fp64 = torch.randn(8, 4, dtype=torch.float64)
    ref = fp64.float()
    assert not same_tensor(ref, ref[:4], fp64, 1e-4).ok
    assert not same_tensor(ref, ref.half(), fp64, 1e-4).ok
    ints = torch.randint(0, 9, (16,))
    other = ints.clone()
    other[3] += 1
    assert not same_tensor(ints, other, ints, 1e-4).ok
    verdict = same([ref, ints], [ref, other], [fp64, ints], 1e-4, ["logits", "labels"])
    assert not verdict.ok and verdict.why.startswith("labels")


def _row(model: str, suite: str, kiln_ms: float, inductor_ms: float, ok: bool = True
         ) -> dict[str, object]:
    return {"model": model, "suite": suite, "mode": "inference", "card": "H100",
            "backends": {"eager": {"ok": True, "steady_ms": 10.0},
                         "inductor": {"ok": True, "steady_ms": inductor_ms,
                                      "cold_compile_s": 20.0, "peak_mb": 100.0},
                         "kiln": {"ok": ok, "steady_ms": kiln_ms, "cold_compile_s": 5.0,
                                  "peak_mb": 110.0}}}


def test_report_merges_shards_and_summarizes(tmp_path: Path) -> None:
    shards = []
    for i, rows in enumerate([[_row("a", "hf", 4.0, 8.0), _row("b", "hf", 9.0, 9.0)],
                              [_row("c", "hf", 2.0, 1.0, ok=False),
                               _row("d", "timm", 5.0, 4.0)]]):
        path = tmp_path / f"s{i}.json"
        path.write_text(json.dumps({"card": "H100", "commit": "abc", "mode": "inference",
                                    "rows": rows}))
        shards.append(path)
    result = merge(shards)
    assert result["card"] == "H100" and len(result["rows"]) == 4
    hf, timm = summarize(result)
    assert hf["suite"] == "hf" and hf["rows"] == 3
    assert math.isclose(hf["pass_kiln"], 2 / 3) and hf["pass_inductor"] == 1.0
    # Only rows where both passed count: a (0.5) and b (1.0).
    assert math.isclose(hf["kiln_over_inductor"], math.sqrt(0.5))
    assert math.isclose(hf["speedup_vs_eager"], math.sqrt(2.5 * 10 / 9))
    assert math.isclose(hf["compile_ratio"], 0.25) and math.isclose(hf["memory_ratio"], 1.1)
    assert math.isclose(timm["kiln_over_inductor"], 1.25)


def test_interleave_takes_the_suites_in_turn_and_keeps_each_suites_order() -> None:
    from bench.suite.models import select
    from bench.suite.run import interleaved

    rows = select(None, "inference")
    order = interleaved(rows)
    assert sorted(r.name for r in order) == sorted(r.name for r in rows)
    assert [r.suite for r in order[:3]] == ["hf", "timm", "torchvision"]
    for suite in ("hf", "timm", "torchvision"):
        assert [r for r in order if r.suite == suite] == [r for r in rows if r.suite == suite]
