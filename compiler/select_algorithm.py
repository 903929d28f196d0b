"""Algorithm selection for matmuls (max-autotune): the choices, their key, and the rule
that picks a winner from measured times. No GPU, Ray or store here: the farm compiles
the candidates, times them on GPU workers and caches the records (``workers/select.py``).

A *choice key* is sha256 over the problem (op, sizes, dtypes, strides, TF32), the GPU
target and the compiler's versions: a second graph, model or process that poses the same
problem on the same GPU finds the record and benchmarks nothing.

A *choice record* is ``{"kind": "extern"}`` or ``{"kind": "template", "config": {...}}``
plus the timings that decided it (``"timings"``: one entry per candidate).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from .ir.template import EXTERN, TEMPLATE, GemmProblem
from .versions import versions

CHOICE_SCHEMA = 1


def choice_key(problem: GemmProblem, target: dict[str, Any]) -> str:
    """The key of ``problem``'s choice on ``target`` (prefixed, so it never looks like a
    graph key in the store)."""
    target_part = {k: target.get(k) for k in ("kind", "backend", "arch", "warp_size", "isa")}
    parts = ["gemm-choice", CHOICE_SCHEMA, problem.to_dict(), target_part, versions()]
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return "choice-" + hashlib.sha256(blob).hexdigest()


@dataclass(frozen=True)
class Candidate:
    """One way to compute a problem: the extern library call, or a template config."""

    kind: str
    config: dict[str, Any] | None = None

    def record(self) -> dict[str, Any]:
        if self.kind == EXTERN:
            return {"kind": EXTERN}
        return {"kind": TEMPLATE, "config": dict(self.config or {})}


# A large fp32 product in IEEE precision (TF32 not allowed) on Hopper: the library call,
# with no template compiled or timed. Both run it on the FMA units, and cuBLAS's SGEMM beat
# every Triton config on the H200 (Inductor's max-autotune of gpu_bench's fp32 MLP,
# 2026-12-02, five problems of 2^34 multiply-adds: the best Triton configs at 47-90% of
# cuBLAS's speed; Kiln's MLP, after timing its 30 fp32 configs, ran in the same GPU time
# as Inductor's all-cuBLAS one: 3.536 / 3.541 ms). "Large": at 90% of SGEMM's speed (25
# TMAC/s) a template loses more from 2^30 multiply-adds on than a fused epilogue saves it
# (a launch, about 5 us), and from K = 512 on more than the product's round trip through
# memory. Smaller problems are timed as before.
LIBRARY_ONLY_MIN_ARCH = 90
LIBRARY_ONLY_MIN_MACS = 2**30
LIBRARY_ONLY_MIN_K = 512


def library_only(problem: GemmProblem, target: dict[str, Any]) -> bool:
    """Whether ``problem`` on ``target`` goes to the library call without a benchmark."""
    p = problem
    return (p.dtype == "float32" and not p.allow_tf32 and target.get("kind") == "cuda"
            and int(target.get("arch", 0)) >= LIBRARY_ONLY_MIN_ARCH
            and p.batch * p.m * p.n * p.k >= LIBRARY_ONLY_MIN_MACS
            and p.k >= LIBRARY_ONLY_MIN_K)


def library_record() -> dict[str, Any]:
    """The choice of a ``library_only`` problem (decided by rule: nothing was timed)."""
    return {"kind": EXTERN, "timings": [], "library_only": True}


def candidates(problem: GemmProblem, target: dict[str, Any] | None = None
               ) -> list[Candidate]:
    """The extern call first (the default's choice), then every template config (those
    that fit ``target``'s shared memory, where it is given; none where the library call
    wins by rule, ``library_only``)."""
    from .codegen.triton.templates import gemm_configs

    if target is not None and library_only(problem, target):
        return [Candidate(EXTERN)]
    return [Candidate(EXTERN)] + [Candidate(TEMPLATE, c)
                                  for c in gemm_configs(problem, target)]


def pick_winner(problem: GemmProblem, timed: list[tuple[Candidate, float]],
                round_trip_ms: float = 0.0) -> dict[str, Any]:
    """The record of the fastest candidate.

    Where pointwise work follows the product (``problem.epilogue``), a template stores
    it fused while the extern call writes the product and an epilogue kernel reads it
    back: the extern's time is charged ``round_trip_ms``, that round trip as measured.
    Ties keep the earlier candidate (the extern call); a candidate that failed (inf or
    NaN) never wins, and if none ran the extern call is chosen.
    """
    def cost(item: tuple[Candidate, float]) -> float:
        cand, ms = item
        if not math.isfinite(ms):
            return math.inf
        return ms + (round_trip_ms if cand.kind == EXTERN and problem.epilogue else 0.0)

    finite = [item for item in timed if math.isfinite(cost(item))]
    best = min(finite, key=cost)[0] if finite else Candidate(EXTERN)
    return {**best.record(), "round_trip_ms": round_trip_ms,
            "timings": [{**c.record(), "ms": ms if math.isfinite(ms) else None}
                        for c, ms in timed]}


def check_record(record: Any) -> dict[str, Any]:
    """A choice record read from outside (store, farm): its shape checked before use."""
    if not isinstance(record, dict) or record.get("kind") not in (EXTERN, TEMPLATE):
        raise ValueError(f"not a choice record: {record!r:.200}")
    if record["kind"] == TEMPLATE:
        config = record.get("config")
        needed = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
        if not isinstance(config, dict) or any(
                not isinstance(config.get(k), int) or not 0 < config[k] <= 1024
                for k in needed):
            raise ValueError(f"bad template config in a choice record: {config!r:.200}")
        checked = {k: int(config[k]) for k in needed}
        tma, sms = config.get("TMA", 0), config.get("NUM_SMS", 0)
        if tma not in (0, 1) or not isinstance(sms, int) or not 0 <= sms <= 1024 or \
                (sms and not tma):
            raise ValueError(f"bad TMA / NUM_SMS in a choice record: {tma!r:.20} {sms!r:.20}")
        checked.update({"TMA": 1} if tma else {})
        checked.update({"NUM_SMS": sms} if sms else {})
        return {"kind": TEMPLATE, "config": checked, **_evidence(record)}
    return {"kind": EXTERN, **_evidence(record)}


def _evidence(record: dict[str, Any]) -> dict[str, Any]:
    """The timings a record keeps, as plain data (they are only reported, never run)."""
    timings = record.get("timings", [])
    round_trip = record.get("round_trip_ms", 0.0)
    return {"timings": timings if isinstance(timings, list) else [],
            "round_trip_ms": float(round_trip) if isinstance(round_trip, (int, float)) else 0.0}


def describe_choice(problem: GemmProblem, record: dict[str, Any]) -> str:
    """One line for a person: the problem, the winner, and what it beat, e.g.
    ``mm 4096x4096x1024 float32 (a, b^T) +epilogue: extern 0.671 ms; best template
    0.812 ms (128x128x32 s3 w8); round trip 0.031 ms``."""
    p = problem
    size = f"{p.batch}x{p.m}x{p.n}x{p.k}" if p.op == "bmm" else f"{p.m}x{p.n}x{p.k}"
    layout = ", ".join(name + ("^T" if stride[2] != 1 else "")
                       for name, stride in (("a", p.a_stride), ("b", p.b_stride)))
    flags = (" tf32" if p.allow_tf32 else "") + (" +epilogue" if p.epilogue else "")
    timings = [t for t in record.get("timings", []) if isinstance(t, dict)]
    extern = [t["ms"] for t in timings if t.get("kind") == EXTERN and t.get("ms") is not None]
    templates = sorted(((t["ms"], t.get("config") or {}) for t in timings
                        if t.get("kind") == TEMPLATE and t.get("ms") is not None),
                       key=lambda item: item[0])
    won = record.get("kind", "?")
    if won == TEMPLATE:
        won = f"template {_tile(record.get('config') or {})}"
    parts = [f"{p.op} {size} {p.dtype} ({layout}){flags}: chose {won}"]
    if extern:
        parts.append(f"extern {extern[0]:.3f} ms")
    if templates:
        parts.append(f"best template {templates[0][0]:.3f} ms ({_tile(templates[0][1])}) "
                     f"of {len(templates)}")
    if record.get("round_trip_ms"):
        parts.append(f"round trip {float(record['round_trip_ms']):.3f} ms")
    if record.get("library_only"):
        parts.append("library only (fp32 IEEE: no template is compiled or timed)")
    elif not timings:
        parts.append("not benchmarked")
    return "; ".join(parts)


def _tile(config: dict[str, Any]) -> str:
    tile = "x".join(str(config.get(k, "?")) for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
    extra = " tma" if config.get("TMA") else ""
    extra += " persistent" if config.get("NUM_SMS") else ""
    return f"{tile} s{config.get('num_stages', '?')} w{config.get('num_warps', '?')}{extra}"
