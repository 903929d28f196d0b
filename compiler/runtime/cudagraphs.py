"""CUDA graphs for loaded wrappers: ``mode="reduce-overhead"`` or option ``cudagraphs``.

One CUDA graph per compiled graph (forward, backward or inference) records every launch
of the wrapper's ``call`` and replays them with one launch:

    calls 1-2  plain launches (warm-up: Triton and the libraries load their kernels);
               the inputs' addresses at call 2 are noted (by then a recorded forward
               returns the tensors its backward reads from its own pool)
    call 3     inputs at the same address as in call 2 (parameters, buffers, tensors a
               recorded forward saved for its backward) are *static*: the graph reads
               them where they are. The others get a buffer of the graph's own (the static
               input pool) that each call copies into. The call is recorded; outputs come
               from the graph's private memory pool (the static output pool).
    later      copy the non-static inputs in (one ``_foreach_copy_`` launch for all of
               them), replay. A static input at a new address (a
               parameter replaced, a batch that happened to reuse its predecessor's
               memory) becomes non-static for good and the graph records again; a
               non-static input at the same address two calls running (a backward's
               saved tensors, once its forward replays from its pool) becomes static and
               the graph records again; after ``MAX_RECORDINGS`` recordings it gives up
               and launches plainly.

Outputs are overwritten by the next replay of the same graph: clone an output that must
outlive the next call (this also holds for tensors a forward saves for its backward:
run each forward's backward before the next forward of the same graph).

Graphs that cannot be captured run with plain launches after one warning: CPU graphs,
CPU tensors or Python numbers among the inputs, symbolic sizes, and any call whose
capture fails (an op that synchronizes with the host, for instance).
"""

from __future__ import annotations

import logging
import operator
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger("kiln.cudagraphs")

# A graph whose static inputs keep moving is recorded at most this many times.
MAX_RECORDINGS = 8
# Calls with plain launches before the first recording.
WARMUP_CALLS = 2

Call = Callable[[list[Any]], Any]


class KilnCudaGraphWarning(UserWarning):
    """A graph asked for CUDA graphs runs with plain kernel launches instead."""


def skip_reason(device_type: str, inputs: Sequence[Any]) -> str | None:
    """Why a graph with these example inputs cannot be recorded; None when it can."""
    if device_type != "cuda":
        return f"it is a {device_type} graph"
    for i, x in enumerate(inputs):
        if isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(
                isinstance(s, torch.SymInt) for s in (*x.shape, *x.stride()))):
            return f"input {i} has dynamic sizes"
        if not isinstance(x, torch.Tensor):
            return f"input {i} is a Python {type(x).__name__}, not a tensor"
        if x.device.type != "cuda":
            return f"input {i} is on {x.device.type}"
    return None


def static_inputs(first: Sequence[Any], second: Sequence[Any]) -> list[bool]:
    """Inputs whose data pointer did not move between two calls: read in place."""
    return [a == b for a, b in zip(first, second)]


def moved_static(recorded: Sequence[Any], now: Sequence[Any], static: Sequence[bool]
                 ) -> list[int]:
    """Static inputs at another address than at recording: the graph must record again,
    with them copied in from now on."""
    return [i for i, (a, b, s) in enumerate(zip(recorded, now, static)) if s and a != b]


def _pointers(inputs: Sequence[Any]) -> list[Any]:
    """Where each input lives (what a recorded graph bakes in). Addresses only: a graph
    with static sizes is guarded on its inputs' strides by Dynamo and AOT autograd (and
    its kernels assume them), and graphs with symbolic sizes are never recorded."""
    return [x.data_ptr() for x in inputs]


def _picker(indices: Sequence[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """``pick(seq)``: the tuple of ``seq``'s items at ``indices`` (one C call per use)."""
    if not indices:
        return lambda seq: ()
    if len(indices) == 1:
        i = indices[0]
        return lambda seq: (seq[i],)
    return operator.itemgetter(*indices)


@dataclass
class _Recording:
    graph: Any
    pointers: list[Any]  # of the inputs the graph reads (static ones: the caller's)
    inputs: list[torch.Tensor]  # what the graph reads: caller's tensors or own buffers
    outputs: Any


@dataclass
class _Plan:
    """What each replay of one recording does, worked out once: which inputs to check,
    which to copy in (one ``_foreach_copy_`` launch) and which to copy back."""

    recording: _Recording
    static_at: tuple[Any, ...]  # the static inputs' addresses at recording
    pick_static: Callable[[Sequence[Any]], tuple[Any, ...]]
    pick_watched: Callable[[Sequence[Any]], tuple[Any, ...]]  # may be promoted
    pick_copied: Callable[[Sequence[Any]], tuple[Any, ...]]
    copy_to: list[torch.Tensor]  # the graph's own buffers of the copied inputs
    copy_back: list[int]  # mutated inputs the graph wrote in its own buffer

    @staticmethod
    def of(rec: _Recording, static: Sequence[bool], demoted: set[int],
           mutated: Sequence[int]) -> _Plan:
        fixed = [i for i, s in enumerate(static) if s]
        copied = [i for i, s in enumerate(static) if not s]
        return _Plan(rec, _picker(fixed)(rec.pointers), _picker(fixed),
                     _picker([i for i in copied if i not in demoted]), _picker(copied),
                     [rec.inputs[i] for i in copied],
                     [i for i in mutated if not static[i]])


@dataclass
class CudaGraphRunner:
    """Wraps a loaded wrapper ``call``; see the module docstring."""

    call: Call
    name: str
    mutated: list[int] = field(default_factory=list)  # inputs the graph writes in place
    calls: int = 0
    recordings: int = 0
    last_pointers: list[Any] = field(default_factory=list)
    static: list[bool] = field(default_factory=list)
    demoted: set[int] = field(default_factory=set)  # moved once: never read in place again
    recording: _Recording | None = None
    plain_reason: str | None = None
    plan: _Plan | None = None

    def __call__(self, args: list[Any]) -> Any:
        inputs = list(args)
        args.clear()
        self.calls += 1
        if self.plain_reason is not None:
            return self.call(inputs)
        now = _pointers(inputs)
        last, self.last_pointers = self.last_pointers, now
        if self.calls <= WARMUP_CALLS:
            return self.call(inputs)
        if not self.static:
            self.static = static_inputs(last, now)
        elif not self._reclassify(last, now):
            return self._replay(inputs)
        return self._record(inputs)

    def _plan(self) -> _Plan:
        plan, rec = self.plan, self.recording
        assert rec is not None
        if plan is None or plan.recording is not rec:
            plan = self.plan = _Plan.of(rec, self.static, self.demoted, self.mutated)
        return plan

    def _reclassify(self, last: list[Any], now: list[Any]) -> bool:
        """Demote static inputs that moved (copied in from now on, for good); promote
        inputs that stayed put for two calls since recording (the outputs of a forward
        recorded after this backward was). True when the graph must record again."""
        plan = self._plan()
        if plan.pick_static(now) == plan.static_at and \
                not any(map(operator.eq, plan.pick_watched(last), plan.pick_watched(now))):
            return False  # the common case, decided in a few C calls
        assert self.recording is not None
        moved = moved_static(self.recording.pointers, now, self.static)
        for i in moved:
            self.static[i] = False
            self.demoted.add(i)
        settled = [i for i, (a, b) in enumerate(zip(last, now))
                   if a == b and not self.static[i] and i not in self.demoted]
        for i in settled:
            self.static[i] = True
        return bool(moved or settled)

    def _record(self, inputs: list[Any]) -> Any:
        if self.recordings >= MAX_RECORDINGS:
            return self._give_up(inputs, f"its static inputs moved {MAX_RECORDINGS} times")
        graph_inputs = [x if s else torch.empty_strided(x.shape, x.stride(), dtype=x.dtype,
                                                        device=x.device)
                        for x, s in zip(inputs, self.static)]
        self._copy_in(inputs, graph_inputs)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                outputs = self.call(list(graph_inputs))
        except Exception as e:  # capture failed: this graph runs plainly from now on
            torch.cuda.synchronize()
            return self._give_up(inputs, f"capture failed: {type(e).__name__}: {e}")
        self.recordings += 1
        self.recording = _Recording(graph, _pointers(graph_inputs), graph_inputs, outputs)
        log.debug("kiln: graph %s recorded (%d)", self.name, self.recordings)
        return self._replay(inputs)

    def _replay(self, inputs: list[Any]) -> Any:
        plan = self._plan()
        rec = plan.recording
        if plan.copy_to:
            torch._foreach_copy_(plan.copy_to, plan.pick_copied(inputs))
        rec.graph.replay()
        if plan.copy_back:  # the graph wrote its own buffer: write the caller's
            torch._foreach_copy_([inputs[i] for i in plan.copy_back],
                                 [rec.inputs[i] for i in plan.copy_back])
        return rec.outputs

    def _copy_in(self, inputs: list[Any], graph_inputs: list[torch.Tensor]) -> None:
        pairs = [(buf, x) for x, buf, s in zip(inputs, graph_inputs, self.static)
                 if not s and x is not buf]
        if pairs:
            torch._foreach_copy_([b for b, _ in pairs], [x for _, x in pairs])

    def _give_up(self, inputs: list[Any], reason: str) -> Any:
        warn_plain(self.name, reason)
        self.plain_reason = reason
        self.recording = None
        return self.call(inputs)


def warn_plain(name: str, reason: str) -> None:
    warnings.warn(f"kiln: graph {name} runs without CUDA graphs ({reason}); its kernels "
                  "are launched one by one", KilnCudaGraphWarning, stacklevel=3)


def cudagraphify(call: Call, device_type: str, example_inputs: Sequence[Any], name: str,
                 mutated: Sequence[int] = ()) -> Call:
    """``call`` recorded into a CUDA graph (see the module docstring), or ``call`` itself
    after one warning when the graph cannot be recorded."""
    reason = skip_reason(device_type, example_inputs)
    if reason is not None:
        warn_plain(name, reason)
        return call
    runner = CudaGraphRunner(call, name, list(mutated))
    runner._boxed_call = True  # type: ignore[attr-defined]
    return runner
