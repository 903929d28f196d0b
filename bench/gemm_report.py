"""Max-autotune's GEMM choices in the graphs Kiln compiles in this process, one line per
problem (``compiler.select_algorithm.describe_choice``): what won, the library call's and
the best template's times. gpu_bench.py prints them under its table."""

from __future__ import annotations

import threading
from typing import Any

_lines: dict[str, str] = {}
_lock = threading.Lock()
_watching = False


def watch() -> None:
    """Note the choices of every graph compiled from now on (once per process)."""
    global _watching
    from kiln.frontend.core import compile as kiln_compile

    if not _watching:
        kiln_compile.observers.append(_note)
        _watching = True


def take() -> list[str]:
    """The lines noted since the last call."""
    with _lock:
        lines = list(_lines.values())
        _lines.clear()
    return lines


def _note(name: str, result: Any) -> None:
    from kiln.compiler.ir.template import GemmProblem
    from kiln.compiler.select_algorithm import describe_choice

    try:  # a diagnostic: whatever it meets, the compile it watches goes on
        choices = result.compiled.stats.get("gemm_choices") or {}
        lines = {key: describe_choice(GemmProblem.from_dict(record["problem"]), record)
                 for key, record in choices.items()}
    except Exception as e:  # noqa: BLE001
        lines = {name: f"(choices of graph {name} not described: {type(e).__name__}: {e})"}
    with _lock:
        _lines.update(lines)
