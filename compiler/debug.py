"""Readable dumps of the IR and the schedule, and the ``KILN_DEBUG`` folder per graph."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import sympy
import torch

from .ir.extern import ExternKernel
from .ir.nodes import Buffer, ComputedBuffer, Reduction
from .ops_handler import DefaultHandler
from .virtualized import V


class PrintHandler(DefaultHandler[str]):
    """An ops handler that writes each op as a line ``tmpN = op(args)``."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._ids = itertools.count()

    def _emit(self, text: str) -> str:
        name = f"tmp{next(self._ids)}"
        self.lines.append(f"{name} = {text}")
        return name

    def load(self, name: str, index: Any) -> str:
        return self._emit(f"load({name}, {index})")

    def store(self, name: str, index: Any, value: str, mode: str | None = None) -> None:
        self.lines.append(f"store({name}, {index}, {value})")

    def store_reduction(self, name: str, index: Any, value: str) -> None:
        self.lines.append(f"store_reduction({name}, {index}, {value})")

    def reduction(self, dtype: torch.dtype, src_dtype: torch.dtype, reduction_type: str,
                  value: str) -> str:
        return self._emit(f"reduction({reduction_type}, {value}, {dtype})")

    def constant(self, value: Any, dtype: torch.dtype) -> str:
        return self._emit(f"constant({value}, {dtype})")

    def index_expr(self, expr: Any, dtype: torch.dtype) -> str:
        return self._emit(f"index_expr({expr}, {dtype})")

    def to_dtype(self, x: str, dtype: torch.dtype, src_dtype: torch.dtype | None = None) -> str:
        return self._emit(f"to_dtype({x}, {dtype})")

    def to_dtype_bitcast(self, x: str, dtype: torch.dtype, src_dtype: torch.dtype) -> str:
        return self._emit(f"bitcast({x}, {dtype})")

    def indirect_indexing(self, x: str, size: Any, check: bool = True) -> sympy.Symbol:
        return sympy.Symbol(f"indirect({x})")

    def masked(self, mask: str, body: Callable[[], str], other: Any) -> str:
        self.lines.append(f"masked({mask}) {{")
        result = body()
        self.lines.append(f"}} else {other}")
        return self._emit(f"masked_result({result})")

    def where(self, cond: str, a: str, b: str) -> str:
        return self._emit(f"where({cond}, {a}, {b})")

    def getitem(self, x: str, i: int) -> str:
        return self._emit(f"{x}[{i}]")

    def _default(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        return self._emit(f"{name}({', '.join(map(str, args))})")


def buffer_str(buf: Buffer) -> str:
    """One buffer of the IR: its kind, layout, and for a loop its body op by op."""
    head = repr(buf)
    if isinstance(buf, ExternKernel):
        inputs = ", ".join(getattr(x, "name", "?") or "?" for x in buf.inputs)
        return f"{head}\n  kernel={buf.kernel_name()} inputs=[{inputs}]"
    if not isinstance(buf, ComputedBuffer):
        return head
    data = buf.data
    index = [sympy.Symbol(f"d{i}") for i in range(len(data.get_size()))]
    rindex = [sympy.Symbol(f"r{i}") for i in range(len(data.get_reduction_size()))]
    handler = PrintHandler()
    with V.set_ops_handler(handler):
        body = buf.store_body()
        body(index, rindex) if isinstance(data, Reduction) else body(index)
    kind = type(data).__name__
    ranges = f"ranges={list(data.get_size())}"
    if isinstance(data, Reduction):
        ranges += f" reduction_ranges={list(data.get_reduction_size())}"
    return "\n".join([f"{head} = {kind} {ranges}"] + ["  " + ln for ln in handler.lines])


def ir_str(buffers: list[Buffer]) -> str:
    return "\n\n".join(buffer_str(b) for b in buffers)


_graph_counter = itertools.count()


def debug_enabled(options: dict[str, Any] | None = None) -> bool:
    value = (options or {}).get("debug", os.environ.get("KILN_DEBUG", ""))
    return str(value) not in ("", "0", "false", "False")


def debug_dir(name: str, options: dict[str, Any] | None = None) -> Path:
    root = Path((options or {}).get("debug_dir") or os.environ.get("KILN_DEBUG_DIR", "kiln_debug"))
    path = root / f"{name}_{os.getpid()}_{next(_graph_counter)}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def write_debug_file(folder: Path | None, filename: str, text: str | Callable[[], str]
                     ) -> None:
    """Write a debug file; ``text`` may be a function, called only when there is a
    folder (the IR and schedule dumps cost seconds on a large graph)."""
    if folder is not None:
        (folder / filename).write_text((text() if callable(text) else text) + "\n")
