"""Autotuning on a GPU that runs someone's program: benchmarks in short slices that the
program's calls barely feel.

A benchmark launches candidate kernels on the GPU for as long as it takes. On the GPU a
user's loop runs on, every call that comes meanwhile waits behind those launches (10x to
300x slower for seconds). Here a benchmark asks for a *turn* before each group of
launches (``Pacer.turn``), and the pacer decides when and for how long:

- ``GpuShare``, a client's own GPU: the frontend reports each call of a graph being tuned
  (``call_begin`` / ``call_end``: host times, and CUDA events on the user's stream). A
  turn starts once a call ended since the last one (in a back-to-back loop, one turn per
  call), or once no call came for ``IDLE_S`` (the program does something else), and
  never while a call is launching; a loop that calls again the moment a call returns
  leaves no such gap, so the next call waits up to ``HANDOFF_S`` for the due turn to be
  taken (``ShareStats.handoffs``; without it tuning starved for thousands of calls). Its
  budget is ``share`` of the graphs' steady call time (at most ``slice_ms``), so a call
  that overlaps a turn takes at most ``1 + share`` times its steady time; after each turn
  the tuner rests so that it holds at most ``share`` of the GPU. Turns run on a
  low-priority CUDA stream that first waits for the user's last call, and hold
  ``GPU_WORK_LOCK`` so that no turn lands inside a CUDA graph capture.
- ``DutyCycle``, a farm's ``Autotuner`` on a GPU that a client process also uses (a
  one-GPU ``kiln farm up`` box): it cannot see the client's calls, so it keeps to the
  duty cycle alone: turns of ``slice_ms``, rests so that tuning holds ``share`` of it.
- ``Unpaced``: a farm GPU of its own: one turn, no budget (the benchmark as it was).

Which kernels are worth a benchmark at all is ``worth_tuning``: a kernel whose heuristic
config already moves its bytes near the GPU's bandwidth (the roofline of a memory-bound
kernel) or runs in microseconds keeps it.

Each turn is a span on the timeline (``gpu turn``, with the GPU's name) and the calls'
slowdown is counted (``ShareStats``): ``kiln stats`` shows both.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from kiln.compiler import trace

SLICE_MS_ENV = "KILN_AUTOTUNE_SLICE_MS"
SHARE_ENV = "KILN_AUTOTUNE_SHARE"
SHARED_GPU_ENV = "KILN_AUTOTUNE_GPU_SHARED"
SLICE_MS = 2.0  # the longest one turn holds the GPU
SHARE = 0.25  # tuning's part of the GPU, and of one call's time
FIRST_BUDGET_MS = 0.25  # a turn's budget before any call's time is known
IDLE_S = 0.05  # no call for this long: the program is doing something else
SLOW_RATIO = 1.1  # a call this much over its steady time counts as slowed
CLEAN_CALLS = 3  # calls with no turn beside them before a graph's steady time is known
# While tuning compiles candidates here, a thread running Python keeps the GIL up to the
# interpreter's switch interval before a waiting thread gets it: the program's call would
# wait that long (several times a short call) behind a candidate's compile.
SWITCH_S = 0.0005
# A loop that calls again the moment a call returns is never between calls when the
# tuner wakes: a call that begins while a due turn waits for that gap waits up to this
# long for the tuner to take it (the turn then runs beside the call), so tuning is not
# starved.
HANDOFF_S = 0.002


def _env_float(name: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ.get(name, "") or default))
    except ValueError:
        return default


def slice_ms() -> float:
    return _env_float(SLICE_MS_ENV, SLICE_MS) or SLICE_MS


def share() -> float:
    return min(0.9, _env_float(SHARE_ENV, SHARE) or SHARE)


class Pacer(Protocol):
    """What a benchmark asks before each group of launches (``compiler.autotune``)."""

    def turn(self) -> Any:
        """A context manager: blocks until the GPU may be used, yields the turn's budget
        in milliseconds of GPU time (``math.inf``: no limit)."""
        ...


class Device(Protocol):
    """The GPU side of ``GpuShare``, apart so that tests drive it with a fake clock."""

    name: str

    def mark(self) -> Any: ...  # an event on the user's current stream

    def elapsed_ms(self, start: Any, end: Any) -> float | None: ...  # None: not done

    def wait(self, event: Any) -> None: ...  # the host waits for the event

    def turn_stream(self, after: Any) -> Any: ...  # a context: the low-priority stream


@dataclass
class ShareStats:
    """What tuning beside the program cost its calls (``kiln stats``'s ``gpu_share``,
    per GPU)."""

    gpu: str = ""
    turns: int = 0
    turn_ms: float = 0.0  # host time inside turns
    first_turn: float = 0.0  # wall clock (time.time) of the first and last turn
    last_turn: float = 0.0
    calls_timed: int = 0  # calls timed while tuning ran
    calls_beside_turns: int = 0
    slowed_calls: int = 0  # beside a turn and over SLOW_RATIO times steady
    slowed_ms: float = 0.0  # their time over steady, summed
    worst_extra_ms: float = 0.0  # the most one call took over its steady time
    worst_ratio: float = 1.0
    handoffs: int = 0  # calls that waited (HANDOFF_S at most) for a due turn to be taken

    def counters(self) -> dict[str, float]:
        """Counters that add up across processes (``merge_counters``: ``*max_ms`` takes
        the largest, ``since`` the earliest, ``updated`` the latest)."""
        return {"turns": self.turns, "turn_ms": self.turn_ms,
                "calls_timed": self.calls_timed,
                "calls_beside_turns": self.calls_beside_turns,
                "slowed_calls": self.slowed_calls, "slowed_ms": self.slowed_ms,
                "worst_extra_max_ms": self.worst_extra_ms, "handoffs": self.handoffs}


def counter_delta(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """``now`` less ``before`` (the ``*max_ms`` ones as they are)."""
    return {k: v if k.endswith("max_ms") else v - before.get(k, 0) for k, v in now.items()}


@dataclass
class _Call:
    graph: str
    start: Any
    end: Any = None
    beside_turn: bool = False
    wall_us: float = 0.0  # when it began, on the timeline's clock


@dataclass
class _Graph:
    clean: deque[float] = field(default_factory=lambda: deque(maxlen=16))

    def steady(self) -> float | None:
        return statistics.median(self.clean) if len(self.clean) >= CLEAN_CALLS else None


class GpuShare:
    """The pacer of a client's own GPU; see the module docstring."""

    def __init__(self, device: Device | None, *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] | None = None, lock: Any = None,
                 slice_ms_: float | None = None, share_: float | None = None,
                 name: str = "") -> None:
        self.device = device
        self.clock = clock
        self.slice_ms = slice_ms() if slice_ms_ is None else slice_ms_
        self.share = share() if share_ is None else share_
        self.stats = ShareStats(gpu=device.name if device else name)
        self._lock = lock if lock is not None else threading.RLock()
        self._cond = threading.Condition()
        self._settle_lock = threading.Lock()
        self._sleep = sleep
        self._ended = 0  # calls ended so far
        self._ended_at_turn = 0
        self._last_call = clock()  # host time of the last call's end (or begin)
        self._in_call = 0
        self._in_turn = False
        self._turn_waiting = False  # a turn is due and waits only for a gap between calls
        self._rest_until = 0.0
        self._last_user: Any = None  # the user's last call's end event
        self._pending: deque[_Call] = deque(maxlen=256)  # calls whose events are not done
        self._graphs: dict[str, _Graph] = {}
        self._tuning = 0
        self._switch = sys.getswitchinterval()
        self._taken: dict[str, float] = {}

    # -- the program's side (``frontend.core.hotswap``) -----------------------------

    def watching(self) -> bool:
        """Whether calls should be reported: tuning runs or waits to run here."""
        return self._tuning > 0

    def call_begin(self, graph: str) -> _Call:
        with self._cond:
            if self._turn_waiting:  # set only while a tuner waits in _wait_for_turn
                self.stats.handoffs += 1
                self._cond.wait_for(lambda: not self._turn_waiting, HANDOFF_S)
            start = self.device.mark() if self.device else self.clock()
            self._in_call += 1
            return _Call(graph, start, beside_turn=self._in_turn, wall_us=trace.now_us())

    def call_end(self, call: _Call) -> None:
        call.end = self.device.mark() if self.device else self.clock()
        with self._cond:
            self._in_call -= 1
            self._ended += 1
            self._last_call = self.clock()
            self._last_user = call.end
            call.beside_turn = call.beside_turn or self._in_turn
            self._pending.append(call)
            self._cond.notify_all()

    # -- the tuner's side ----------------------------------------------------------

    @contextmanager
    def tuning(self) -> Iterator[None]:
        """Tuning runs here for the block: calls are reported meanwhile, and the GIL
        changes hands sooner (``SWITCH_S``)."""
        with self._cond:
            self._tuning += 1
            if self._tuning == 1:
                self._switch = sys.getswitchinterval()
                sys.setswitchinterval(min(self._switch, SWITCH_S))
        try:
            yield
        finally:
            with self._cond:
                self._tuning -= 1
                if self._tuning == 0:
                    sys.setswitchinterval(self._switch)

    def budget_ms(self) -> float:
        """A turn's budget: ``share`` of the fastest graph's steady time (calls overlap
        one turn at most), at most ``slice_ms``; ``slice_ms`` while the program is idle."""
        known = self._steady_times()
        if self.clock() - self._last_call >= IDLE_S:
            return self.slice_ms
        if not known:
            return min(self.slice_ms, FIRST_BUDGET_MS)
        return min(self.slice_ms, self.share * min(known))

    def _steady_times(self) -> list[float]:
        self._settle()
        return [s for g in self._graphs.values() if (s := g.steady()) is not None]

    @contextmanager
    def turn(self) -> Iterator[float]:
        self._wait_for_turn()
        budget = self.budget_ms()
        with self._cond:
            after = self._last_user
        if self.device is not None and after is not None:
            # The user's last call ends first, outside the turn's time: the rest that
            # follows a turn is for the turn's own launches.
            self.device.wait(after)
        with self._lock:
            started = self.clock()
            with self._cond:
                self._in_turn, self._ended_at_turn = True, self._ended
            try:
                with trace.span("gpu turn", cat="autotune", gpu=self.stats.gpu,
                                budget_ms=round(budget, 3)):
                    if self.device is not None:
                        with self.device.turn_stream(after):
                            yield budget
                    else:
                        yield budget
            finally:
                self._end_turn(started)

    def _end_turn(self, started: float) -> None:
        now = self.clock()
        held = now - started
        with self._cond:
            self._in_turn = False
            self._rest_until = now + held * (1 - self.share) / self.share
            for call in self._pending:  # calls still running beside the turn
                call.beside_turn = True
        stats = self.stats
        stats.turns += 1
        stats.turn_ms += held * 1000
        stats.last_turn = time.time()
        stats.first_turn = stats.first_turn or stats.last_turn

    def _wait_for_turn(self) -> None:
        """Until a call ended since the last turn with the calls' steady time known (or
        none came for ``IDLE_S``), no call is starting on the host, and the rest after
        the last turn is over."""
        from kiln.workers import foreground

        with self._cond:
            try:
                while True:
                    foreground.check_stopped()
                    now = self.clock()
                    idle = now - self._last_call >= IDLE_S
                    # A loop's first calls set the budget: no turn beside them until then.
                    ready = idle or (self._ended > self._ended_at_turn
                                     and self._knows_steady())
                    due = ready and now >= self._rest_until
                    if due and not self._in_call:
                        if self._turn_waiting:  # the call waiting for this gap goes on
                            self._turn_waiting = False
                            self._cond.notify_all()
                        return
                    self._turn_waiting = due  # the next call to begin hands over
                    wait = max(self._rest_until - now, 0.0) if ready else IDLE_S
                    self._pause(max(wait, 1e-4))
            except BaseException:
                self._turn_waiting = False  # stopped: no call waits for this turn
                raise

    def _knows_steady(self) -> bool:
        """Whether a steady time is known (called holding ``_cond``, released meanwhile:
        timing the calls queries their events)."""
        self._cond.release()
        try:
            return bool(self._steady_times())
        finally:
            self._cond.acquire()

    def _pause(self, seconds: float) -> None:
        """Sleep (the fake clock's ``sleep`` in tests), waking early for a call's end."""
        if self._sleep is not None:
            self._cond.release()
            try:
                self._sleep(seconds)
            finally:
                self._cond.acquire()
        else:
            self._cond.wait(seconds)

    def _settle(self) -> None:
        """Time the calls whose events are done: clean ones make a graph's steady time,
        those beside a turn count as slowed when over it (one tuning thread at a time)."""
        with self._settle_lock:
            self._settle_done()

    def _settle_done(self) -> None:
        with self._cond:
            pending = list(self._pending)
        done = []
        for call in pending:
            ms = self._call_ms(call)
            if ms is None:
                break  # later calls end later on the same stream
            done.append(call)
            self._count(call, ms)
        with self._cond:
            for call in done:
                if self._pending and self._pending[0] is call:
                    self._pending.popleft()

    def _call_ms(self, call: _Call) -> float | None:
        if self.device is None:
            return (call.end - call.start) * 1000
        return self.device.elapsed_ms(call.start, call.end)

    def _count(self, call: _Call, ms: float) -> None:
        graph = self._graphs.setdefault(call.graph, _Graph())
        stats = self.stats
        stats.calls_timed += 1
        if not call.beside_turn:
            graph.clean.append(ms)
            return
        stats.calls_beside_turns += 1
        steady = graph.steady()
        if steady is None or steady <= 0:
            return
        ratio = ms / steady
        stats.worst_ratio = max(stats.worst_ratio, ratio)
        stats.worst_extra_ms = max(stats.worst_extra_ms, ms - steady)
        if ratio > SLOW_RATIO:
            stats.slowed_calls += 1
            stats.slowed_ms += ms - steady
            trace.complete("call slowed by tuning", call.wall_us, call.wall_us + 1000 * ms,
                           cat="autotune", gpu=stats.gpu, graph=call.graph[:16],
                           ms=round(ms, 4), steady_ms=round(steady, 4),
                           ratio=round(ratio, 3))

    def take_counters(self) -> dict[str, Any]:
        """``kiln stats``'s ``gpu_share`` counters since the last take, by GPU (with the
        first and last turn's wall clock as ``since`` and ``updated``)."""
        self._settle()
        now = self.stats.counters()
        delta = counter_delta(now, self._taken)
        self._taken = now
        if not any(v for k, v in delta.items() if not k.endswith("max_ms")):
            return {}
        times = {"since": self.stats.first_turn, "updated": self.stats.last_turn} \
            if self.stats.turns else {}
        return {"gpu_share": {self.stats.gpu or "gpu": {**delta, **times}}}


class DutyCycle:
    """The pacer of a GPU shared with a process whose calls it cannot see (a farm's
    ``Autotuner`` beside a client on one GPU): turns of ``slice_ms``, each followed by a
    rest that keeps tuning to ``share`` of the GPU."""

    def __init__(self, name: str = "", *, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep, slice_ms_: float | None = None,
                 share_: float | None = None, stream: Callable[[], Any] | None = None) -> None:
        self.clock, self.sleep = clock, sleep
        self.slice_ms = slice_ms() if slice_ms_ is None else slice_ms_
        self.share = share() if share_ is None else share_
        self.stats = ShareStats(gpu=name)
        self._stream = stream
        self._rest_until = 0.0

    @contextmanager
    def turn(self) -> Iterator[float]:
        now = self.clock()
        if now < self._rest_until:
            self.sleep(self._rest_until - now)
        started = self.clock()
        try:
            with trace.span("gpu turn", cat="autotune", gpu=self.stats.gpu, shared=True,
                            budget_ms=self.slice_ms):
                if self._stream is not None:
                    with self._stream():
                        yield self.slice_ms
                else:
                    yield self.slice_ms
        finally:
            held = self.clock() - started
            self._rest_until = self.clock() + held * (1 - self.share) / self.share
            self.stats.turns += 1
            self.stats.turn_ms += held * 1000


class Unpaced:
    """A GPU of the tuner's own: one turn per benchmark, no budget."""

    @contextmanager
    def turn(self) -> Iterator[float]:
        yield float("inf")


# A heuristic config that moves its bytes at this part of the GPU's bandwidth, or that
# runs this fast, leaves too little to gain for a benchmark beside the program.
NEAR_ROOFLINE = 0.6
TOO_SHORT_MS = 0.004


def worth_tuning(nbytes: int, heuristic_ms: float, peak_gb_s: float | None) -> bool:
    """Whether a kernel's candidates are worth timing: its heuristic config runs long
    enough to matter and (where the GPU's bandwidth is known) moves its ``nbytes`` well
    below the bandwidth."""
    if not heuristic_ms > TOO_SHORT_MS or heuristic_ms == float("inf"):
        return heuristic_ms == float("inf")  # a heuristic that fails: tune
    if not peak_gb_s or nbytes <= 0:
        return True
    achieved_gb_s = nbytes / (heuristic_ms * 1e6)
    return achieved_gb_s < NEAR_ROOFLINE * peak_gb_s


# ---------------------------------------------------------------------------------------
# The real GPU, and the pacers this process uses.


class TorchDevice:
    """``Device`` on a CUDA GPU: timing events on the user's stream, and a stream of the
    lowest priority for turns (the default stream's own priority is the lowest, so this
    is no lower than the user's: a turn's budget is what bounds a call's wait)."""

    def __init__(self, index: int) -> None:
        import torch

        self.index = index
        self.name = f"cuda:{index} {torch.cuda.get_device_name(index)}"
        low, _ = torch.cuda.Stream.priority_range()  # type: ignore[call-arg]
        self.stream = torch.cuda.Stream(device=index, priority=low)

    def mark(self) -> Any:
        import torch

        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def elapsed_ms(self, start: Any, end: Any) -> float | None:
        return float(start.elapsed_time(end)) if end.query() else None

    def wait(self, event: Any) -> None:
        event.synchronize()

    @contextmanager
    def turn_stream(self, after: Any) -> Iterator[None]:
        import torch

        if after is not None:
            self.stream.wait_event(after)  # the user's last call first
        with torch.cuda.stream(self.stream):
            yield


_shares: dict[int, GpuShare] = {}
_shares_lock = threading.Lock()


def current() -> GpuShare | None:
    """This process's share of its current GPU, if tuning ever asked for it."""
    for share in list(_shares.values()):  # on every call of a tuned graph: no lock
        return share
    return None


def local_share() -> GpuShare:
    """The pacer of tuning in this process (made on first use): its current GPU, or no
    device under the tests' fake benchmark (host clock only)."""
    from kiln.compiler.runtime.cudagraphs import GPU_WORK_LOCK

    from .autotune import fake_autotune

    index = -1
    if not fake_autotune():
        import torch

        index = torch.cuda.current_device()
    with _shares_lock:
        if index not in _shares:
            device = None if index < 0 else TorchDevice(index)
            _shares[index] = GpuShare(device, lock=GPU_WORK_LOCK,
                                      name="" if device else "fake GPU")
        return _shares[index]


def shared_gpu() -> bool:
    """Whether a farm's ``Autotuner`` shares its GPU with another process: as
    ``KILN_AUTOTUNE_GPU_SHARED`` says (``1``/``0``), else whether NVML sees another
    process's compute context on it (a client beside a one-GPU ``kiln farm up``)."""
    forced = os.environ.get(SHARED_GPU_ENV, "")
    if forced in ("0", "1"):
        return forced == "1"
    try:
        import pynvml  # type: ignore[import-not-found]
        import torch

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(_physical_index(torch.cuda.current_device()))
        others = [p for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
                  if p.pid != os.getpid()]
        return bool(others)
    except Exception:  # no NVML here: a GPU of the farm's own, as before
        return False


def _physical_index(index: int) -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v for v in visible.split(",") if v.strip()]
    if index < len(ids) and ids[index].strip().isdigit():
        return int(ids[index])
    return index


def farm_pacer() -> DutyCycle | None:
    """A farm ``Autotuner``'s pacer: a duty cycle on a shared GPU, else none (checked
    per benchmark: a client may start beside the farm at any time)."""
    if not shared_gpu():
        return None
    global _farm_cycle
    if _farm_cycle is None:
        name, stream = _farm_stream()
        _farm_cycle = DutyCycle(name, stream=stream)
    return _farm_cycle


_farm_cycle: DutyCycle | None = None


def farm_stats() -> dict[str, Any]:
    """What this farm process's pacing did (an ``Autotuner``'s ``share_stats``)."""
    cycle = _farm_cycle
    return {} if cycle is None else {"gpu": cycle.stats.gpu, **cycle.stats.counters()}


def _farm_stream() -> tuple[str, Any]:
    """The GPU's name and a low-priority stream context for the farm's turns."""
    from .autotune import fake_autotune

    if fake_autotune():
        return "fake GPU", None
    import torch

    device = TorchDevice(torch.cuda.current_device())
    return device.name, lambda: device.turn_stream(None)


_peaks: dict[int, float | None] = {}


def peak_gb_s(pacer: Pacer) -> float | None:
    """The GPU's bandwidth (GB/s) from one device-to-device copy, timed in a turn (once
    per GPU)."""
    from .autotune import fake_autotune

    if fake_autotune():
        return None
    import torch

    index = torch.cuda.current_device()
    if index not in _peaks:
        _peaks[index] = _copy_gb_s(pacer)
    return _peaks[index]


def _copy_gb_s(pacer: Pacer) -> float | None:
    import torch

    with pacer.turn():
        src = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        dst.copy_(src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
    ms = start.elapsed_time(end)
    return 2 * src.numel() / (ms * 1e6) if ms > 0 else None  # read and write
