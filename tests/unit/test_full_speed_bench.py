"""bench/full_speed.py's figures from a loop's calls: steady time per variant, time to
full speed, stalls over 1.5x steady, and the issue's targets against Inductor."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import full_speed  # noqa: E402


def _calls(ms: list[float], tag: str = "a", t0: float = 10.0, step: float = 0.01
           ) -> list[dict[str, object]]:
    return [{"t": t0 + step * (i + 1), "ms": v, "tag": tag} for i, v in enumerate(ms)]


def test_a_loop_that_stalls_after_its_first_output() -> None:
    calls = _calls([40.0, 39.0, 20.0, 3.2, 3.25, 3.0, 3.1, 3.0, 3.2, 3.0, 3.1, 3.0, 3.0])
    f = full_speed.figures(calls, first_output_s=10.0)
    assert f["steady_ms"] == {"a": 3.0}  # the median of the last quarter (3 calls at least)
    assert f["slow_calls"] == 3 and f["last_slow_s"] == pytest.approx(10.03)
    assert f["slowest_ms"] == 40.0 and f["slowest_ratio"] == pytest.approx(40 / 3.0, 1e-3)
    # full speed from the end of the last call before the first run of 5 near steady
    assert f["full_speed_s"] == pytest.approx(10.03)
    assert f["slow_ms_total"] == pytest.approx(40 + 39 + 20 - 3 * 3.0)


def test_a_loop_at_full_speed_from_its_first_output() -> None:
    f = full_speed.figures(_calls([3.0] * 12), first_output_s=7.5)
    assert f["full_speed_s"] == 7.5 and f["slow_calls"] == 0 and f["last_slow_s"] is None


def test_variants_are_measured_against_their_own_steady_time() -> None:
    calls = []
    for i in range(12):  # two sequence lengths, one twice as slow as the other
        calls += [{"t": 1 + i, "ms": 2.0, "tag": "128"}, {"t": 1.5 + i, "ms": 4.0, "tag": "256"}]
    f = full_speed.figures(calls, first_output_s=1.0)
    assert f["steady_ms"] == {"128": 2.0, "256": 4.0} and f["slow_calls"] == 0


def test_targets_compare_full_speed_with_inductors_first_output() -> None:
    rows = [{"model": "vit", "mode": "inductor", "ok": True, "first_output_s": 40.0},
            {"model": "vit", "mode": "kiln_inprocess", "ok": True, "full_speed_s": 12.0,
             "slow_calls": 0},
            {"model": "vit", "mode": "kiln_second", "ok": True, "full_speed_s": 30.0,
             "slow_calls": 2, "client_turns": 0, "kiln": {"hits_autotuned": 3}}]
    checks = {c["mode"]: c for c in full_speed.targets(rows)}
    assert checks["kiln_inprocess"]["full_speed_target"] is True
    assert checks["kiln_inprocess"]["full_speed_vs_inductor_first_output"] == 0.3
    second = checks["kiln_second"]
    assert second["full_speed_target"] is False and second["no_stall"] is False
    assert second["client_benchmarked_nothing"] and second["started_tuned"]
