"""CUDA graphs for loaded wrappers: ``mode="reduce-overhead"`` or option ``cudagraphs``.

One CUDA graph per compiled graph (forward, backward or inference) records every launch
of the wrapper's ``call`` and replays them with one launch:

    calls 1-2  plain launches (warm-up: Triton and the libraries load their kernels);
               the inputs' addresses are noted, and the size of the outputs
    later      a call whose inputs all sit where those of an earlier call (since the
               warm-up) sat is recorded *reading them in place*, keyed by those
               addresses: every later call with the same addresses replays it, with no
               copy and no other host work (a loop over a few preallocated batches, a
               backward whose saved tensors come from a recorded forward's pool). At most
               ``MAX_DIRECT`` such recordings per graph, and no more than
               ``DIRECT_OUTPUT_BYTES`` of outputs among them (each keeps its own).
    otherwise  (addresses not seen before) the copy recording, made on the first such
               call: inputs at the same address as in the previous call (parameters,
               buffers) are *static*: the graph reads them where they are. The others get
               a buffer of the graph's own (the static input pool) that each call copies
               into with one ``_foreach_copy_`` launch before the replay. A static input
               at a new address (a parameter replaced) becomes non-static for good and
               the graph records again; a non-static input at the same address two calls
               running becomes static and the graph records again; after
               ``MAX_RECORDINGS`` recordings it gives up and launches plainly.

The recordings of one graph share one memory pool. Outputs are overwritten by the next
replay of the same graph: clone an output that must outlive the next call (this also
holds for tensors a forward saves for its backward: run each forward's backward before
the next forward of the same graph).

Graphs that cannot be captured run with plain launches after one warning: CPU graphs,
CPU tensors or Python numbers among the inputs, symbolic sizes, and any call whose
capture fails (an op that synchronizes with the host, for instance).
"""

from __future__ import annotations

import logging
import operator
import threading
import types
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
# Address sets a graph reads in place (one recording each), and the bytes of outputs
# those recordings may keep between them.
MAX_DIRECT = 4
DIRECT_OUTPUT_BYTES = 256 << 20
# Address sets remembered (since the warm-up) to spot one that comes back.
MAX_SEEN = 64

Call = Callable[[list[Any]], Any]

# Held while a graph is captured, and by this process's autotuning benchmarks (they run on
# a background thread): a benchmark's allocations and synchronizations during a capture
# invalidate it ("operation failed due to a previous error during capture").
GPU_WORK_LOCK = threading.RLock()


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


_DATA_PTR = torch.Tensor.data_ptr


def _pointers(inputs: Sequence[Any]) -> tuple[int, ...]:
    """Where each input lives (what a recorded graph bakes in). Addresses only: a graph
    with static sizes is guarded on its inputs' sizes, strides and dtypes by Dynamo and
    AOT autograd (and its kernels assume them), and graphs with symbolic sizes are never
    recorded."""
    return tuple(map(_DATA_PTR, inputs))


def output_bytes(outputs: Any) -> int:
    """Bytes of the tensors among a call's outputs (what each recording keeps)."""
    if isinstance(outputs, torch.Tensor):
        return outputs.numel() * outputs.element_size()
    if isinstance(outputs, (list, tuple)):
        return sum(output_bytes(o) for o in outputs)
    return 0


def can_read_in_place(seen: set[tuple[int, ...]], direct: int, now: tuple[int, ...],
                      out_bytes: int) -> bool:
    """Whether a call at addresses ``now`` should get a recording that reads its inputs
    in place: the same addresses came before (``seen``), and another recording (beside
    ``direct`` ones) stays within ``MAX_DIRECT`` and ``DIRECT_OUTPUT_BYTES``. Notes
    ``now`` in ``seen`` (bounded: forgotten all at once past ``MAX_SEEN``)."""
    if now in seen:
        return direct < MAX_DIRECT and (direct + 1) * out_bytes <= DIRECT_OUTPUT_BYTES
    if len(seen) >= MAX_SEEN:
        seen.clear()
    seen.add(now)
    return False


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
    launch: Callable[[], None] = field(init=False)  # the replay, as a C call

    def __post_init__(self) -> None:
        self.launch = replay_of(self.graph)


def replay_of(graph: Any) -> Callable[[], None]:
    """``graph.replay`` bound to torch's C++ method where ``graph`` is a CUDA graph: its
    Python override only checks an input-liveness tracker Kiln never turns on."""
    native = getattr(getattr(torch._C, "_CUDAGraph", None), "replay", None)
    if native is not None and isinstance(graph, torch._C._CUDAGraph) \
            and getattr(graph, "_tracker", None) is None:
        return types.MethodType(native, graph)
    return graph.replay  # type: ignore[no-any-return]


def first_replay(rec: _Recording) -> None:
    """The recording's first replay, right after its capture: a C binding that refuses
    its arguments (a torch whose method differs) raises before any work; the Python
    method is used from then on."""
    try:
        rec.launch()
    except TypeError:
        rec.launch = rec.graph.replay
        rec.launch()


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
    recordings: int = 0  # of the copy recording
    last_pointers: tuple[int, ...] = ()
    static: list[bool] = field(default_factory=list)
    demoted: set[int] = field(default_factory=set)  # moved once: never read in place again
    recording: _Recording | None = None  # the copy recording
    plain_reason: str | None = None
    plan: _Plan | None = None
    direct: dict[tuple[int, ...], _Recording] = field(default_factory=dict)
    seen: set[tuple[int, ...]] = field(default_factory=set)  # address sets since warm-up
    out_bytes: int = 0  # of one call's outputs
    pool: Any = None  # the memory pool of this graph's recordings

    def __call__(self, args: list[Any]) -> Any:
        inputs = list(args)
        args.clear()
        self.calls += 1
        if self.plain_reason is not None:
            return self.call(inputs)
        now = _pointers(inputs)
        rec = self.direct.get(now)
        if rec is not None:  # the hot path: inputs where a recording reads them
            self.last_pointers = now
            rec.launch()
            return rec.outputs
        last, self.last_pointers = self.last_pointers, now
        if self.calls <= WARMUP_CALLS:
            self.seen.add(now)
            out = self.call(inputs)
            self.out_bytes = max(self.out_bytes, output_bytes(out))
            return out
        if can_read_in_place(self.seen, len(self.direct), now, self.out_bytes):
            return self._record_direct(inputs, now)
        if not self.static:
            self.static = static_inputs(last, now)
        elif not self._reclassify(last, now):
            return self._replay(inputs)
        return self._record(inputs)

    def served(self, slow: Callable[..., Any]) -> Callable[..., Any]:
        """``fn(*inputs)`` for a caller that passes the inputs unboxed (``frontend.
        aot_cache.served_graph``): :func:`replaying` this runner."""
        return replaying(types.SimpleNamespace(replayer=self), slow)

    def _plan(self) -> _Plan:
        plan, rec = self.plan, self.recording
        assert rec is not None
        if plan is None or plan.recording is not rec:
            plan = self.plan = _Plan.of(rec, self.static, self.demoted, self.mutated)
        return plan

    def _reclassify(self, last: Sequence[Any], now: Sequence[Any]) -> bool:
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

    def _capture(self, graph_inputs: list[Any]) -> _Recording | str:
        """A recording of one call over ``graph_inputs`` (not run yet), or why none."""
        with GPU_WORK_LOCK:
            torch.cuda.synchronize()
            if self.pool is None:
                self.pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self.pool):
                    outputs = self.call(list(graph_inputs))
            except Exception as e:  # capture failed: this graph runs plainly from now on
                torch.cuda.synchronize()
                return f"capture failed: {type(e).__name__}: {e}"
        return _Recording(graph, list(_pointers(graph_inputs)), graph_inputs, outputs)

    def _record_direct(self, inputs: list[Any], now: tuple[int, ...]) -> Any:
        """Record a graph that reads these inputs where they are, for these addresses."""
        rec = self._capture(inputs)
        if isinstance(rec, str):
            return self._give_up(inputs, rec)
        rec.inputs = []  # the caller's tensors are not kept alive: their addresses are
        self.direct[now] = rec
        log.debug("kiln: graph %s recorded reading %d inputs in place (%d)", self.name,
                  len(inputs), len(self.direct))
        first_replay(rec)
        return rec.outputs

    def _record(self, inputs: list[Any]) -> Any:
        if self.recordings >= MAX_RECORDINGS:
            return self._give_up(inputs, f"its static inputs moved {MAX_RECORDINGS} times")
        graph_inputs = [x if s else torch.empty_strided(x.shape, x.stride(), dtype=x.dtype,
                                                        device=x.device)
                        for x, s in zip(inputs, self.static)]
        self._copy_in(inputs, graph_inputs)
        rec = self._capture(graph_inputs)
        if isinstance(rec, str):
            return self._give_up(inputs, rec)
        self.recordings += 1
        self.recording = rec
        log.debug("kiln: graph %s recorded (%d)", self.name, self.recordings)
        first_replay(rec)  # (with the inputs copied in just before the capture)
        return self._copy_back(inputs, rec)

    def _replay(self, inputs: list[Any]) -> Any:
        plan = self._plan()
        rec = plan.recording
        if plan.copy_to:
            torch._foreach_copy_(plan.copy_to, plan.pick_copied(inputs))
        rec.launch()
        return self._copy_back(inputs, rec)

    def _copy_back(self, inputs: list[Any], rec: _Recording) -> Any:
        plan = self._plan()
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
        self.direct.clear()
        return self.call(inputs)


def replaying(owner: Any, slow: Callable[..., Any]) -> Callable[..., Any]:
    """``fn(*inputs)`` that replays a recording of ``owner.replayer`` (a
    :class:`CudaGraphRunner`, or None) reading these inputs in place, if it has one, and
    goes to ``slow`` otherwise (which calls the runner with the grad and autocast handling
    a plain or recording call needs; a replay runs no op and needs none). The runner is
    read at each call: an owner that switches to a new runner (``frontend.core.hotswap``: tuned
    kernels) or to None is seen by the next call, which never replays a recording of the
    runner it left."""
    data_ptr = _DATA_PTR

    def replay_or_call(*inputs: Any) -> Any:
        runner = owner.replayer
        if runner is not None:
            now = tuple(map(data_ptr, inputs))  # (``_pointers``, inlined: a frame less)
            rec = runner.direct.get(now)
            if rec is not None:
                runner.calls += 1
                runner.last_pointers = now
                rec.launch()
                return rec.outputs
        return slow(*inputs)

    return replay_or_call


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
