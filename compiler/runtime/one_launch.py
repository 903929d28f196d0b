"""A CUDA-graph recording that holds one kernel launch, served by launching the kernel.

For a graph of a single kernel a CUDA graph replay costs more than the launch it
replays (the H200 host: a one-node graph's replay adds about 6 µs of launch latency over
an empty call). While ``cudagraphs.CudaGraphRunner`` records a call, ``watched_call``
watches the wrapper: its kernels' launches (each kernel of the wrapper's namespace
stood in for by a spy that forwards) and the ops it dispatches. When the call was one
launch of one kernel, no op ran but allocations, every pointer argument is one of the
call's inputs, one of its outputs' storage or a constant of the graph, and no output
shares storage with an input, the runner serves later calls with :class:`OneLaunch`:
that kernel launched with the call's inputs in place and the recording's outputs (the
static output pool the graph writes: outputs are overwritten by the next call, as after
a replay), whatever the inputs' addresses. Inputs not aligned to 16 bytes (which the
wrapper would copy first), and inputs inside the outputs' memory (a call fed the previous
call's output: the kernel would read what it writes), take the runner's other paths.

A loaded ``StaticCudaKernel`` is launched through torch's launcher's C entry with all but
the argument tuple and the stream bound once (``launch(args, stream())``: C calls only);
any other launcher through its ``run``.
"""

from __future__ import annotations

import bisect
import functools
import operator
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Ops a one-launch call may dispatch: its outputs' allocations.
_ALLOCATIONS = frozenset({"aten::empty_strided", "aten::empty.memory_format",
                          "aten::empty_strided.default"})
# The file name ``compiled_graph.load`` gives a wrapper's code: only such calls are watched
# (their kernels are the launchers of their own namespace).
WRAPPER_FILE = "<kiln wrapper"
ALIGNMENT = 16  # what the wrapper's input alignment test asks (``align_input``)

# ``OneLaunch.launch(args, stream)`` and what gives the stream.
Launch = Callable[[tuple[Any, ...], Any], None]


@dataclass(frozen=True)
class OneLaunch:
    """The launch that serves a call: ``launch(arguments(inputs, addresses), stream())``.

    ``by_address``: the kernel takes the inputs' addresses (torch's launcher: given a
    tensor, it would call its ``data_ptr`` and ask the driver about the address, per
    argument and launch); the tail's tensors are then addresses too (``keep`` holds
    them). Otherwise it takes the tensors."""

    kernel: str
    launch: Launch
    stream: Callable[[], Any]
    tail: tuple[Any, ...]  # after the inputs: outputs, constants, scalars, scratch
    pick: Callable[[tuple[Any, ...]], tuple[Any, ...]] | None  # None: inputs + tail
    outputs: Any
    # ``1 in map(inside, addresses)``: an input starts inside the outputs' memory (the
    # span of their storages: a call fed the previous call's output, ``y = f(y)``); the
    # kernel would read what it writes, so that call takes the runner's other paths.
    inside: Callable[[int], int]
    by_address: bool = False
    keep: tuple[torch.Tensor, ...] = ()  # what the tail's addresses point into

    def arguments(self, inputs: tuple[Any, ...], addresses: tuple[int, ...]
                  ) -> tuple[Any, ...]:
        both = (addresses if self.by_address else inputs) + self.tail
        return both if self.pick is None else self.pick(both)

    def serves(self, addresses: Sequence[int]) -> bool:
        """Whether a call whose inputs are at ``addresses`` can be served: aligned, and
        none in the outputs' memory (C calls only)."""
        return aligned(addresses) and 1 not in map(self.inside, addresses)

    def __call__(self, inputs: Sequence[Any], addresses: tuple[int, ...]) -> Any:
        """Launch over ``inputs`` at ``addresses`` (``serves`` them); the outputs."""
        self.launch(self.arguments(tuple(inputs), addresses), self.stream())
        return self.outputs


_DATA_PTR = torch.Tensor.data_ptr


def aligned(addresses: Sequence[int]) -> bool:
    """Every input address is on a 16-byte boundary (C calls only)."""
    return not functools.reduce(operator.or_, addresses, 0) % ALIGNMENT


class _Ops(TorchDispatchMode):
    """Notes the ops the wrapper dispatches under it, other than allocations (not those
    of a launcher's own, while ``in_kernel``: Triton's interpreter copies its tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.other: list[str] = []
        self.in_kernel = False

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        if not self.in_kernel and func.name() not in _ALLOCATIONS:
            self.other.append(func.name())
        return func(*args, **(kwargs or {}))


class _Spy:
    """Stands in for one kernel of a wrapper's namespace: notes each launch, forwards."""

    def __init__(self, kernel: Any, launches: list[tuple[Any, tuple[Any, ...]]],
                 ops: _Ops) -> None:
        self.kernel, self.launches, self.ops = kernel, launches, ops

    def run(self, *args: Any) -> None:
        self.launches.append((self.kernel, args))
        self.ops.in_kernel = True
        try:
            self.kernel.run(*args)
        finally:
            self.ops.in_kernel = False


def _is_kernel(value: Any) -> bool:
    return callable(getattr(value, "run", None)) and not isinstance(
        value, (types.ModuleType, type, types.FunctionType, torch.Tensor))


def watched_call(call: Callable[[list[Any]], Any], inputs: list[Any]
                 ) -> tuple[Any, OneLaunch | str]:
    """``call(inputs)``'s outputs, and the launch that can serve later calls (see the
    module docstring) or why there is none."""
    code = getattr(call, "__code__", None)
    if code is None or not code.co_filename.startswith(WRAPPER_FILE):
        return call(list(inputs)), "it is not a Kiln wrapper's call"
    namespace = call.__globals__  # type: ignore[attr-defined]
    kernels = {name: v for name, v in namespace.items() if _is_kernel(v)}
    launches: list[tuple[Any, tuple[Any, ...]]] = []
    ops = _Ops()
    namespace.update({name: _Spy(v, launches, ops) for name, v in kernels.items()})
    try:
        with ops:
            outputs = call(list(inputs))
    finally:
        namespace.update(kernels)
    if ops.other:
        return outputs, f"it runs {ops.other[0]}"
    if len(launches) != 1:
        return outputs, f"it launches {len(launches)} kernels"
    constants = [v for v in namespace.values() if isinstance(v, torch.Tensor)]
    try:
        return outputs, one_launch(*launches[0], inputs, outputs, constants)
    except Exception as e:  # noqa: BLE001 - the recording still serves: it replays
        return outputs, f"its launch could not be bound ({type(e).__name__}: {e})"


def _storage(x: torch.Tensor) -> int:
    return x.untyped_storage().data_ptr()


def one_launch(kernel: Any, args: tuple[Any, ...], inputs: Sequence[Any], outputs: Any,
               constants: Sequence[torch.Tensor] = ()) -> OneLaunch | str:
    """The launch of ``kernel`` that computes ``outputs`` from any ``inputs`` like these,
    or why ``args`` do not allow it."""
    outs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    if not all(isinstance(x, torch.Tensor) for x in (*inputs, *outs)):
        return "an input or output is not a tensor"
    if len({id(x) for x in inputs}) != len(inputs):
        return "an input is passed twice"
    in_storage = {_storage(x) for x in inputs}
    out_storage = {_storage(x) for x in outs}
    if in_storage & out_storage:
        return "an output shares storage with an input"
    fixed_ok = {id(c) for c in constants}
    position = {id(x): i for i, x in enumerate(inputs)}
    tail: list[Any] = []
    order: list[int] = []
    for i, arg in enumerate(args):
        if id(arg) in position:
            order.append(position[id(arg)])
            continue
        if isinstance(arg, torch.Tensor) and _storage(arg) not in out_storage \
                and id(arg) not in fixed_ok:
            return f"argument {i} of kernel {_name(kernel)} is a buffer of its own"
        order.append(len(inputs) + len(tail))
        tail.append(arg)
    launch, stream, extra, by_address = _launcher(kernel)
    for arg in extra:  # (a static kernel's scratch slots: its ``run`` adds them)
        order.append(len(inputs) + len(tail))
        tail.append(arg)
    identity = order == list(range(len(inputs) + len(tail)))
    pick = None if identity else _picker(order)
    inside = _inside(outs)
    if not by_address:
        return OneLaunch(_name(kernel), launch, stream, tuple(tail), pick, outputs, inside)
    keep = tuple(a for a in tail if isinstance(a, torch.Tensor))
    addresses = tuple(_DATA_PTR(a) if isinstance(a, torch.Tensor) else a for a in tail)
    return OneLaunch(_name(kernel), launch, stream, addresses, pick, outputs, inside, True,
                     keep)


def _inside(outputs: Sequence[torch.Tensor]) -> Callable[[int], int]:
    """``inside(address)``: 1 where ``address`` lies in the span of ``outputs``'
    storages, else 0 or 2 (a C call: ``bisect`` over the span's two ends)."""
    starts = [_storage(x) for x in outputs]
    ends = [_storage(x) + x.untyped_storage().nbytes() for x in outputs]
    return functools.partial(bisect.bisect_right, (min(starts), max(ends)))


def _picker(order: list[int]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    if len(order) == 1:
        at = order[0]
        return lambda both: (both[at],)
    return operator.itemgetter(*order)


def _name(kernel: Any) -> str:
    spec = getattr(kernel, "spec", None)
    return str(getattr(kernel, "name", None) or getattr(spec, "name", None)
               or type(kernel).__name__)


_no_stream = type(None)  # (a C call that gives None)


def _launcher(kernel: Any) -> tuple[Launch, Callable[[], Any], tuple[Any, ...], bool]:
    """``(launch, stream, extra, by_address)``: torch's launcher's C entry with the
    kernel bound where ``kernel`` is a loaded static kernel with a fixed grid (``extra``:
    its scratch arguments; it takes addresses), else its ``run`` (it takes tensors)."""
    from .static_launcher import StaticCudaKernel

    if isinstance(kernel, StaticCudaKernel) and kernel.function is not None \
            and kernel.xnumel_at is None and kernel._instead is None:
        gx, gy, gz = kernel.grid
        launch = functools.partial(kernel.impl._launch_kernel, kernel.function, gx, gy, gz,
                                   kernel.num_warps, kernel.shared, kernel.arg_tys)
        device = kernel._stream_device
        stream = kernel.stream if device is None else functools.partial(
            torch._C._cuda_getCurrentRawStream, device)
        assert stream is not None
        return launch, stream, kernel.scratch, True
    run = kernel.run
    return (lambda args, stream: run(*args)), _no_stream, (), False
