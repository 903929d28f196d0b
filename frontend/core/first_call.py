"""The first call of a loaded graph as one span of the timeline, with sub-spans saying
where its time goes: each library call (``first <op>``: cuDNN attention, cuBLAS, cuDNN
convolutions, ...) and each cubin loaded on its first launch (``load cubin``, from the
static launcher). Only while a timeline records (``KILN_TRACE``, ``KILN_DEBUG``): then a
dispatch mode sees the call's ATen ops; otherwise the call runs as it is."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.compiler import trace
from kiln.frontend.core.warmup import WARM_OPS

# Every overload of those ops (the wrapper writes into its buffers: ``mm.out``).
LIBRARY_OPS = frozenset(op.overloadpacket for op in WARM_OPS)


class LibraryCallSpans(TorchDispatchMode):
    """One span per library call (:data:`LIBRARY_OPS`) in the block,
    named ``first <op>``, with its tensor arguments' shapes and dtypes."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.overloadpacket not in LIBRARY_OPS:
            return func(*args, **kwargs)
        name = str(func.__name__).removesuffix(".default")
        shapes = [f"{tuple(a.shape)}:{str(a.dtype).removeprefix('torch.')}"
                  for a in args if isinstance(a, torch.Tensor)]
        with trace.span(f"first {name}", cat="client", op=name, shapes=shapes):
            return func(*args, **kwargs)


def traced_first_call(call: Callable[[list[Any]], Any], args: list[Any], key: str) -> Any:
    """``call(args)`` inside the span "first call of a graph" (and its sub-spans when a
    timeline records)."""
    with trace.span("first call of a graph", cat="client", key=key[:16]):
        if not trace.recording():
            return call(args)
        with LibraryCallSpans():
            return call(args)


class FirstCallSpan:
    """A loaded graph whose first call shows on the timeline (a graph that is not a
    ``SwappableGraph``, loaded while a timeline records); later calls go straight on."""

    def __init__(self, call: Callable[[list[Any]], Any], key: str) -> None:
        self._boxed_call = True  # on the instance: see SwappableGraph
        self.call, self.key, self.called = call, key, False

    def __getattr__(self, name: str) -> Any:
        """The wrapped callable's attributes (a CUDA-graph runner's ``served``)."""
        if name == "call":
            raise AttributeError(name)
        return getattr(self.call, name)

    def __call__(self, args: list[Any]) -> Any:
        if self.called:
            return self.call(args)
        self.called = True
        return traced_first_call(self.call, args, self.key)
