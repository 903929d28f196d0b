"""bench/coldstart.py's --budget: rows that would not fit are not started (and said so),
a warm row whose cold row did not pass is not run, the results file holds every row as it
comes, and skipped rows do not fail the run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import coldstart  # noqa: E402


def test_a_spent_budget_skips_rows_and_their_warm_rows(tmp_path: Path) -> None:
    results = tmp_path / "r.json"
    results.write_text(json.dumps([{"model": "earlier", "mode": "kiln_warm", "ok": True}]))
    args = coldstart.parse_args(["--budget", "0.001", "--results", str(results),
                                 "--workdir", str(tmp_path / "w"), "--device", "cpu"])
    bench = coldstart.Bench(args)
    bench.run_mode("gpt2", "kiln_warm")  # primes kiln_inprocess first
    bench.run_farm(["gpt2"], 16, tag="_w16")
    rows = {(r["model"], r["mode"]): r for r in bench.rows}
    assert list(rows) == [("gpt2", "kiln_inprocess"), ("gpt2", "kiln_warm"),
                          ("gpt2", "kiln_farm_w16")]
    assert all(r["skipped"] and not r["ok"] for r in rows.values())
    assert "--budget" in rows[("gpt2", "kiln_inprocess")]["problem"]
    assert "kiln_inprocess row did not pass" in rows[("gpt2", "kiln_warm")]["problem"]
    saved = json.loads(results.read_text())
    assert len(saved) == 4 and saved[0]["model"] == "earlier"  # appended, row by row
    table = coldstart.table(saved)
    assert table.count(" skip ") == 3


def test_no_budget_never_skips(tmp_path: Path) -> None:
    args = coldstart.parse_args(["--workdir", str(tmp_path / "w"), "--device", "cpu"])
    bench = coldstart.Bench(args)
    assert bench.time_left() is None and not bench.out_of_time("gpt2", "kiln_warm", 1e9)
