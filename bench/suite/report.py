"""Merge the suite's shard JSONs (``bench/suite/run.py --json``) into one result file
naming its card and commit, print the summary per suite and mode, and plot every row's
Kiln/Inductor ratio.

    python3 bench/suite/report.py /tmp/out/s*.json            # -> bench/results/...
    python3 bench/suite/report.py a.json b.json --out r.json  # a chosen path

The result goes to ``bench/results/suite-<date>-<card>.json`` unless ``--out`` says
otherwise; the plot (``.png``, the same name) is written next to it when matplotlib is
installed. Per suite and mode the summary gives the pass rate (eager, Inductor, Kiln),
geomean speed-ups (eager's time over Kiln's, and Kiln's time over Inductor's: below 1.0
Kiln is faster), cold-compile and peak-memory ratios (Kiln over Inductor).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def merge(paths: list[Path]) -> dict[str, Any]:
    """Every shard's rows in one result; the card and commit must agree across shards."""
    shards = [json.loads(p.read_text()) for p in paths]
    cards = {s.get("card") for s in shards if s.get("card")}
    commits = {s.get("commit") for s in shards}
    if len(cards) > 1:
        raise SystemExit(f"shards ran on different cards: {sorted(cards)}")
    rows = [r for s in shards for r in s["rows"]]
    return {"card": next(iter(cards), None) or shards[0].get("device", "cpu"),
            "commits": sorted(c for c in commits if c), "shards": [str(p) for p in paths],
            "modes": sorted({r.get("mode", s.get("mode")) for s in shards
                             for r in s["rows"]}),
            "date": datetime.date.today().isoformat(), "rows": rows,
            "gpu_shared": any(s.get("gpu_shared") for s in shards)}


def geomean(values: list[float]) -> float | None:
    vals = [v for v in values if v and v > 0 and math.isfinite(v)]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else None


def ratio(row: dict[str, Any], key: str, num: str, den: str) -> float | None:
    b = row.get("backends", {})
    a, c = b.get(num, {}).get(key), b.get(den, {}).get(key)
    if not b.get(num, {}).get("ok") or not b.get(den, {}).get("ok") or not a or not c:
        return None
    return float(a) / float(c)


def passed(row: dict[str, Any], backend: str) -> bool:
    return "error" not in row and bool(row.get("backends", {}).get(backend, {}).get("ok"))


def summarize(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One line per (suite, mode)."""
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for row in result["rows"]:
        groups.setdefault((row.get("suite", "?"), row.get("mode", "?")), []).append(row)
    lines = []
    for (suite, mode), rows in sorted(groups.items()):
        n = len(rows)
        line: dict[str, Any] = {"suite": suite, "mode": mode, "rows": n}
        for backend in ("eager", "inductor", "kiln"):
            ran = [r for r in rows if backend in r.get("backends", {}) or "error" in r]
            ran_any = any(backend in r.get("backends", {}) for r in rows)
            line[f"pass_{backend}"] = (sum(passed(r, backend) for r in ran) / len(ran)
                                       if ran_any else None)
        line["speedup_vs_eager"] = geomean(
            [1 / x for r in rows if (x := ratio(r, "steady_ms", "kiln", "eager"))])
        line["kiln_over_inductor"] = geomean(
            [x for r in rows if (x := ratio(r, "steady_ms", "kiln", "inductor"))])
        line["compile_ratio"] = geomean(
            [x for r in rows if (x := ratio(r, "cold_compile_s", "kiln", "inductor"))])
        line["memory_ratio"] = geomean(
            [x for r in rows if (x := ratio(r, "peak_mb", "kiln", "inductor"))])
        lines.append(line)
    return lines


def table(lines: list[dict[str, Any]]) -> str:
    def f(v: Any, pct: bool = False) -> str:
        if v is None:
            return "-"
        return f"{v:.0%}" if pct else f"{v:.2f}"
    out = ["| suite | mode | rows | pass eager / Inductor / Kiln | Kiln speed-up vs eager "
           "| Kiln/Inductor time | compile Kiln/Inductor | memory Kiln/Inductor |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for ln in lines:
        out.append(f"| {ln['suite']} | {ln['mode']} | {ln['rows']} | "
                   f"{f(ln['pass_eager'], True)} / {f(ln['pass_inductor'], True)} / "
                   f"{f(ln['pass_kiln'], True)} | {f(ln['speedup_vs_eager'])} | "
                   f"{f(ln['kiln_over_inductor'])} | {f(ln['compile_ratio'])} | "
                   f"{f(ln['memory_ratio'])} |")
    return "\n".join(out)


def plot(result: dict[str, Any], path: Path) -> bool:
    """Every row's Kiln/Inductor time, sorted, with the 1.0 line; False without
    matplotlib or without a row that both passed."""
    points = sorted((x, f"{r['model']} ({r.get('mode', '?')[:5]})") for r in result["rows"]
                    if (x := ratio(r, "steady_ms", "kiln", "inductor")))
    if not points:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(max(8, len(points) * 0.22), 5))
    values = [p[0] for p in points]
    ax.bar(range(len(points)), values,
           color=["tab:green" if v <= 1.0 else "tab:red" for v in values])
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(range(len(points)), [p[1] for p in points], rotation=90, fontsize=6)
    ax.set_ylabel("Kiln / Inductor steady-state time")
    ax.set_title(f"Kiln model suite, {result['card']}, {', '.join(result['commits'])}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def default_out(result: dict[str, Any]) -> Path:
    card = re.sub(r"[^A-Za-z0-9]+", "-", str(result["card"])).strip("-").lower()
    return ROOT / "bench" / "results" / f"suite-{result['date']}-{card}.json"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shards", nargs="+", type=Path)
    p.add_argument("--out", type=Path, help="result JSON (default under bench/results/)")
    args = p.parse_args(argv)
    result = merge(args.shards)
    result["summary"] = summarize(result)
    out = args.out or default_out(result)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(table(result["summary"]))
    failing = [(r["model"], r.get("mode")) for r in result["rows"] if not passed(r, "kiln")]
    if failing:
        print(f"Kiln fails {len(failing)} rows: {failing}")
    png = out.with_suffix(".png")
    print(f"wrote {out}" + (f" and {png}" if plot(result, png) else " (no plot)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
