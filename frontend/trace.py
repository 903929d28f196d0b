"""The compile timeline: Chrome/Perfetto trace files, and ``kiln trace summary``.

``KILN_TRACE=path`` turns recording on in the client (``compiler.trace`` spans); the farm
records the spans of each request it is asked to trace and sends them back with the
result, so one file shows the client (Dynamo and AOT trace, serialize, hash, store
lookup, fetch, load per kernel), the coordinator (queueing, fan-out, publish), the compile
worker's passes, every kernel compile with its worker process and every autotune
benchmark with its GPU. The file is rewritten after each graph (open it in Perfetto or
``chrome://tracing``); with ``KILN_DEBUG`` each graph's folder gets its own ``trace.json``.

The summary's critical path walks back from the last span to finish: at each point, the
leaf span (one with no span nested in it) that ended last before it, in any process; a
gap between two such leaves is the own time of the innermost span around it (Dynamo's
tracing, AOTAutograd's). Time on that chain is where the wall clock went; "top stages"
sums each span name's own time (its duration less its nested spans), which is where the
CPU went.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.compiler import trace

TRACE_ENV = "KILN_TRACE"
# Spans that wait on other processes' work (the client on the farm, the coordinator on
# its workers): on the critical path, the work inside them counts, not the wait.
WAITING_CATEGORIES = frozenset({"client", "farm", "kiln"})
_write_lock = threading.Lock()
_flush_at_exit = False


def trace_path() -> str | None:
    return os.environ.get(TRACE_ENV) or None


def start_recording(debug: bool = False) -> bool:
    """Turn recording on where ``KILN_TRACE`` (or a debug folder) asks; True if on."""
    global _flush_at_exit
    if trace_path() or debug:
        trace.enable()
        trace.set_process_name("client")
        if not _flush_at_exit:  # spans that end after the last graph (Dynamo's, AOT's)
            _flush_at_exit = True
            atexit.register(flush)
    return trace.recording()


def chrome_trace(events: list[trace.Event]) -> dict[str, Any]:
    """A Chrome trace object: the events, and a name per process from their ``args``."""
    names: dict[int, str] = {}
    for event in events:
        label = (event.get("args") or {}).get("process")
        if label and event.get("pid") not in names:
            names[int(event["pid"])] = str(label)
    meta = [{"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
             "args": {"name": f"{label} ({pid})"}} for pid, label in sorted(names.items())]
    ordered = sorted(events, key=lambda e: (float(e.get("ts", 0)), -float(e.get("dur", 0))))
    return {"traceEvents": meta + ordered, "displayTimeUnit": "ms"}


def write_trace(path: str | Path, events: list[trace.Event] | None = None) -> Path:
    """Write ``events`` (default: all this process recorded) atomically to ``path``."""
    path = Path(path)
    body = json.dumps(chrome_trace(trace.events() if events is None else events))
    with _write_lock:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(body)
        os.replace(tmp, path)
    return path


def flush() -> None:
    """Rewrite the ``KILN_TRACE`` file with everything recorded so far."""
    path = trace_path()
    if path and trace.recording():
        write_trace(path)


# ---------------------------------------------------------------------------------------
# Reading a trace back: the critical path and the top stages.


@dataclass(frozen=True)
class Span:
    name: str
    start: float  # microseconds
    end: float
    pid: int
    tid: int
    process: str
    cat: str = ""
    gpu: str = ""  # the GPU autotuner a benchmark ran on ("" for every other span)
    background: bool = False  # work after the first output (autotuning), not on its path

    @property
    def dur(self) -> float:
        return self.end - self.start


def load_spans(path: str | Path) -> list[Span]:
    """The complete events of a trace file; ``ValueError`` naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read trace {path}: {e}") from e
    raw = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(raw, list):
        raise ValueError(f"trace {path} has no traceEvents list")
    return spans_from_events(raw, str(path))


def spans_from_events(raw: list[Any], where: str = "events") -> list[Span]:
    """The complete (``ph: "X"``) events of a list, as spans."""
    spans = []
    for event in raw:
        if not isinstance(event, dict) or event.get("ph") != "X":
            continue
        try:
            start, dur = float(event["ts"]), float(event.get("dur", 0.0))
            args = event.get("args") or {}
            spans.append(Span(str(event["name"]), start, start + dur, int(event.get("pid", 0)),
                              int(event.get("tid", 0)), str(args.get("process", "")),
                              str(event.get("cat", "")), _gpu_of(event, args),
                              bool(args.get("background"))))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"trace {where}: bad event {event!r}: {e}") from e
    return spans


def _gpu_of(event: dict[str, Any], args: dict[str, Any]) -> str:
    gpu = args.get("gpu")
    return "" if gpu is None or event.get("cat") != "autotune" else str(gpu)


def gpu_usage(spans: list[Span]) -> dict[str, Any]:
    """How the GPUs were used: per GPU the benchmarks it ran and its busy milliseconds,
    and the wall time from the first benchmark's start to the last one's end."""
    runs = [s for s in spans if s.gpu and s.gpu != "local"]
    if not runs:
        return {"gpus": [], "wall_ms": 0.0, "busy_ms": 0.0}
    per: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for s in runs:
        per[s.gpu][0] += s.dur / 1000.0
        per[s.gpu][1] += 1
    rows = [{"gpu": g, "busy_ms": v[0], "jobs": int(v[1])}
            for g, v in sorted(per.items(), key=lambda kv: (len(kv[0]), kv[0]))]
    wall = (max(s.end for s in runs) - min(s.start for s in runs)) / 1000.0
    return {"gpus": rows, "wall_ms": wall, "busy_ms": sum(r["busy_ms"] for r in rows)}


def _children(spans: list[Span]) -> dict[int, list[int]]:
    """Indices of the spans nested directly in each span of the same thread."""
    by_thread: dict[tuple[int, int], list[int]] = defaultdict(list)
    for i, s in enumerate(spans):
        by_thread[(s.pid, s.tid)].append(i)
    children: dict[int, list[int]] = defaultdict(list)
    for indices in by_thread.values():
        stack: list[int] = []
        for i in sorted(indices, key=lambda j: (spans[j].start, -spans[j].dur)):
            while stack and spans[stack[-1]].end < spans[i].end:
                stack.pop()
            if stack:
                children[stack[-1]].append(i)
            stack.append(i)
    return children


def self_times(spans: list[Span]) -> list[float]:
    children = _children(spans)
    return [s.dur - sum(spans[c].dur for c in children.get(i, [])) for i, s in enumerate(spans)]


def foreground(spans: list[Span]) -> list[Span]:
    """The spans of the way to the first output: not background work (autotuning that
    runs after it, ``compiler.trace.background``), nor nested in it in its thread."""
    children = _children(spans)
    behind: set[int] = set()
    todo = [i for i, s in enumerate(spans) if s.background]
    while todo:
        i = todo.pop()
        if i not in behind:
            behind.add(i)
            todo += children.get(i, [])
    return [s for i, s in enumerate(spans) if i not in behind]


def critical_path(spans: list[Span]) -> list[Span]:
    """Leaf spans on the chain that ends with the last span to finish (earliest first).
    A leaf has no span nested in it in its thread and, if it is a span that waits
    (client or farm), none of another process inside it either. Background work is
    left out first (``foreground``): the path is the first output's."""
    spans = foreground(spans)
    children = _children(spans)

    def waits_on_others(w: Span) -> bool:
        return w.cat in WAITING_CATEGORIES and any(
            s.pid != w.pid and w.start <= s.start and s.end <= w.end for s in spans)

    leaves = sorted((s for i, s in enumerate(spans)
                     if not children.get(i) and not waits_on_others(s)), key=lambda s: s.end)
    if not leaves:
        return []
    path: list[Span] = []
    t = max(s.end for s in spans)
    eps = 1.0  # a microsecond of slack between spans recorded by two clocks
    while True:
        before = [s for s in leaves if s.end <= t + eps and s not in path]
        if not before:
            break
        last = max(before, key=lambda s: (s.end, s.dur))
        path.append(last)
        t = last.start
    return path[::-1]


def _gap_owners(spans: list[Span], start: float, end: float) -> list[tuple[str, float]]:
    """A gap of the critical path cut where spans begin or end, each piece the own time
    of the innermost span around it (or idle): (stage, ms) pieces."""
    cuts = sorted({start, end, *(t for s in spans for t in (s.start, s.end)
                                 if start < t < end)})
    pieces: list[tuple[str, float]] = []
    for a, b in zip(cuts, cuts[1:]):
        mid = (a + b) / 2
        around = [s for s in spans if s.start <= mid <= s.end]
        name = f"{min(around, key=lambda s: s.dur).name} (own time)" if around else "idle"
        if pieces and pieces[-1][0] == name:
            pieces[-1] = (name, pieces[-1][1] + (b - a) / 1000.0)
        else:
            pieces.append((name, (b - a) / 1000.0))
    return pieces


def path_stages(spans: list[Span]) -> list[tuple[str, float]]:
    """The critical path as (stage, ms) steps covering the whole wall time: its leaf
    spans, and between them the own time of the span that encloses the gap."""
    spans = foreground(spans)
    path = critical_path(spans)
    steps: list[tuple[str, float]] = []
    t = min(s.start for s in spans)
    for s in path:
        if s.start - t > 1.0:
            steps += _gap_owners(spans, t, s.start)
        steps.append((s.name, max(0.0, s.end - max(s.start, t)) / 1000.0))
        t = max(t, s.end)
    end = max(s.end for s in spans)
    if end - t > 1.0:  # after the last leaf: the own time of what encloses it
        steps += _gap_owners(spans, t, end)
    return steps


def _table(rows: dict[str, list[float]]) -> list[dict[str, Any]]:
    return sorted(({"stage": k, "ms": v[0], "count": int(v[1])} for k, v in rows.items()),
                  key=lambda r: -r["ms"])


def summarize(spans: list[Span], top: int = 15) -> dict[str, Any]:
    """Wall time, the critical path merged by stage, and the top stages by own time."""
    ahead = foreground(spans)
    if not ahead:
        return {"wall_ms": 0.0, "critical_path": [], "top_stages": [], "processes": 0,
                "gpu_usage": gpu_usage([]), "background_ms": 0.0}
    wall = (max(s.end for s in ahead) - min(s.start for s in ahead)) / 1000.0
    # The tuner's own spans (one per graph it tunes), not what nests in them.
    background_ms = sum(s.dur for s in spans if s.background and s.cat == "background") / 1e3
    on_path: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for name, ms in path_stages(spans):
        on_path[name][0] += ms
        on_path[name][1] += 1
    own: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for s, t in zip(spans, self_times(spans)):
        own[s.name][0] += t / 1000.0
        own[s.name][1] += 1
    return {"wall_ms": wall, "critical_path": _table(on_path),
            "top_stages": _table(own)[:top], "processes": len({s.pid for s in spans}),
            "gpu_usage": gpu_usage(spans), "background_ms": background_ms,
            "first_calls": first_call_stages(spans), "warm_up": warm_up_overlap(spans),
            "claims": claim_waits(spans)}


def claim_waits(spans: list[Span]) -> dict[str, float]:
    """Who compiled and who waited (``artifact_store.claims``): graphs compiled here,
    and waits on another process's claim (a ``claim wait`` span names the holder)."""
    waits = [s for s in spans if s.name == "claim wait"]
    return {"compiled_here": sum(1 for s in spans if s.name == "local compile"),
            "waits": len(waits), "waited_ms": sum(s.dur for s in waits) / 1000.0}


COMPILE_WAITS = ("farm compile (client waits)", "local compile")


def warm_up_overlap(spans: list[Span]) -> dict[str, float]:
    """The first-call warm-ups (``frontend.core.warmup``): their calls, time, and how much of
    it ran beside a compile of this process (a farm wait or a local compile)."""
    warm = [s for s in spans if s.name == "first-call warm-up"]
    waits = [s for s in spans if s.name in COMPILE_WAITS]
    beside = sum(max(0.0, min(w.end, c.end) - max(w.start, c.start))
                 for w in warm for c in waits if c.pid == w.pid)
    return {"calls": len(warm), "ms": sum(s.dur for s in warm) / 1000.0,
            "beside_compile_ms": min(beside, sum(s.dur for s in warm)) / 1000.0}


def first_call_stages(spans: list[Span]) -> list[dict[str, Any]]:
    """Where the first calls of graphs spent their time: the own time of every span
    nested in a "first call of a graph" span (library calls, cubin loads), and of the
    calls themselves (kernels launched, Python)."""
    children, own = _children(spans), self_times(spans)
    rows: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for i, s in enumerate(spans):
        if s.name != "first call of a graph":
            continue
        todo = [i]
        while todo:
            j = todo.pop()
            todo += children.get(j, [])
            row = rows[spans[j].name + (" (own time)" if j == i else "")]
            row[0] += own[j] / 1000.0
            row[1] += 1
    return _table(rows)


def format_summary(summary: dict[str, Any]) -> str:
    lines = [f"wall {summary['wall_ms']:.1f} ms to the first output, over "
             f"{summary['processes']} process(es); background work (autotuning) "
             f"{summary.get('background_ms', 0.0):.1f} ms",
             "", "critical path of the first output (stage, ms on the path, steps):"]
    for row in summary["critical_path"]:
        lines.append(f"  {row['stage']:<44} {row['ms']:>10.1f} {row['count']:>6}")
    lines += ["", "top stages by own time (stage, ms, spans):"]
    for row in summary["top_stages"]:
        lines.append(f"  {row['stage']:<44} {row['ms']:>10.1f} {row['count']:>6}")
    warm = summary.get("warm_up") or {}
    if warm.get("calls"):
        lines += ["", f"first-call warm-up: {warm['calls']} calls, {warm['ms']:.1f} ms, "
                  f"{warm['beside_compile_ms']:.1f} ms of it beside a compile"]
    claims = summary.get("claims") or {}
    if claims.get("waits"):
        lines += ["", f"claims: {claims['compiled_here']} graphs compiled here, "
                  f"{claims['waits']} waits on another process's claim "
                  f"({claims['waited_ms']:.1f} ms)"]
    if summary.get("first_calls"):
        lines += ["", "first calls of graphs (stage, own ms, spans):"]
        for row in summary["first_calls"]:
            lines.append(f"  {row['stage']:<44} {row['ms']:>10.1f} {row['count']:>6}")
    usage = summary.get("gpu_usage") or {}
    if usage.get("gpus"):
        lines += ["", f"GPU autotuners (benchmarks over {usage['wall_ms']:.1f} ms; "
                  "GPU, busy ms, share of that time, benchmarks):"]
        for row in usage["gpus"]:
            share = row["busy_ms"] / usage["wall_ms"] if usage["wall_ms"] else 0.0
            lines.append(f"  GPU {row['gpu']:<32} {row['busy_ms']:>10.1f} {share:>6.0%} "
                         f"{row['jobs']:>6}")
    return "\n".join(lines)


def cmd_trace(args: Any) -> int:
    """``kiln trace summary PATH [--json]``."""
    try:
        summary = summarize(load_spans(args.path), top=args.top)
    except ValueError as e:
        print(f"kiln trace: {e}", flush=True)
        return 1
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


def add_trace_parser(sub: Any) -> None:
    """The ``trace`` subcommand (cli.py's only hook)."""
    parser = sub.add_parser("trace", help="read a compile timeline (KILN_TRACE)")
    actions = parser.add_subparsers(dest="trace_command", required=True)
    summary = actions.add_parser("summary", help="critical path and top stages")
    summary.add_argument("path")
    summary.add_argument("--json", action="store_true")
    summary.add_argument("--top", type=int, default=15)
    summary.set_defaults(func=cmd_trace)
