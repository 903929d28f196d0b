"""Dynamically scoped state: ``V.graph``, ``V.ops``, ``V.kernel``.

Each slot is a thread-local stack installed by a ``with`` block, so a loop body written
once (an ``inner_fn`` calling ``ops.add``) produces dependencies under a recording
handler, Triton source under the Triton overrides, C++ under the C++ overrides, and
values under the IR interpreter.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class _NullSlot:
    def __init__(self, name: str) -> None:
        self.name = name

    def __getattr__(self, item: str) -> Any:
        raise RuntimeError(f"V.{self.name} is not set: no {self.name} handler installed")

    def __bool__(self) -> bool:
        return False


class _Slot(threading.local):
    def __init__(self, name: str) -> None:
        self.name = name
        self.stack: list[Any] = []

    def get(self) -> Any:
        return self.stack[-1] if self.stack else _NullSlot(self.name)

    @contextmanager
    def install(self, value: Any) -> Iterator[Any]:
        self.stack.append(value)
        try:
            yield value
        finally:
            self.stack.pop()


_graph = _Slot("graph")
_ops = _Slot("ops")
_kernel = _Slot("kernel")


class _Virtualized:
    """The one holder of the current graph, ops handler and kernel."""

    @property
    def graph(self) -> Any:
        return _graph.get()

    @property
    def ops(self) -> Any:
        return _ops.get()

    @property
    def kernel(self) -> Any:
        return _kernel.get()

    def set_graph_handler(self, graph: Any) -> Any:
        return _graph.install(graph)

    def set_ops_handler(self, handler: Any) -> Any:
        return _ops.install(handler)

    def set_kernel_handler(self, kernel: Any) -> Any:
        return _kernel.install(kernel)

    def has_graph(self) -> bool:
        return bool(_graph.stack)


V = _Virtualized()


class _OpsProxy:
    """``ops.add(a, b)`` forwards to whatever handler ``V.ops`` holds now."""

    def __getattr__(self, name: str) -> Any:
        return getattr(V.ops, name)


ops: Any = _OpsProxy()
