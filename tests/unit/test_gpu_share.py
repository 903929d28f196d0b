"""Tuning beside the program on one GPU (``workers.gpu_share``), on a fake clock: turns
come one per call of a back-to-back loop (or after an idle gap), their budget is a share
of the calls' steady time, rests keep tuning to that share of the GPU, a benchmark's
launches fit the turns (``compiler.autotune.time_sliced``), calls beside a turn are
counted as slowed by what they took over steady, and kernels near the roofline keep
their heuristic config."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kiln.compiler import trace
from kiln.compiler.autotune import OVER_BUDGET, time_sliced
from kiln.workers import gpu_share
from kiln.workers.gpu_share import IDLE_S, DutyCycle, GpuShare, worth_tuning


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds


def _share(clock: FakeClock, slice_ms: float = 2.0, share: float = 0.25) -> GpuShare:
    return GpuShare(None, clock=clock, sleep=clock.sleep, slice_ms_=slice_ms, share_=share)


def _call(share: GpuShare, clock: FakeClock, ms: float, graph: str = "g") -> None:
    call = share.call_begin(graph)
    clock.t += ms / 1000
    share.call_end(call)


def test_a_turns_budget_is_a_share_of_the_fastest_graphs_steady_time() -> None:
    clock = FakeClock()
    share = _share(clock)
    assert share.budget_ms() == gpu_share.FIRST_BUDGET_MS  # no call timed yet
    for _ in range(5):
        _call(share, clock, 4.0, "forward")
        _call(share, clock, 10.0, "backward")
    assert share.budget_ms() == pytest.approx(0.25 * 4.0)
    for _ in range(5):
        _call(share, clock, 20.0, "forward")  # a slower forward: its median moves
    assert share.budget_ms() == 2.0  # never more than the slice


def test_turns_come_one_per_call_and_rest_for_the_share() -> None:
    clock = FakeClock()
    share = _share(clock)
    for _ in range(4):
        _call(share, clock, 4.0)
    with share.tuning():
        with share.turn() as budget:  # a call just ended: at once
            assert budget == pytest.approx(1.0)
            clock.t += 1.0 / 1000  # the turn's launches
        ended = clock.t
        _call(share, clock, 4.0)  # the loop's next call
        with share.turn():  # waits out the rest: 3x the turn at a share of 1/4
            assert clock.t >= ended + 0.003 - 1e-9
            start = clock.t
            clock.t += 1.0 / 1000
        with share.turn():  # no call ended since: only once the program looks idle
            assert clock.t - start >= IDLE_S
    assert share.stats.turns == 3


def test_calls_beside_a_turn_count_as_slowed_by_their_time_over_steady() -> None:
    clock = FakeClock()
    share = _share(clock)
    with share.tuning(), trace.capture() as events:
        assert share.watching()
        for _ in range(4):
            _call(share, clock, 4.0)
        with share.turn():
            _call(share, clock, 5.0)  # ran beside the turn: 1 ms over steady
        _call(share, clock, 4.0)
        counts = share.take_counters()["gpu_share"]["gpu"]
    slowed = [e for e in events if e["name"] == "call slowed by tuning"]
    assert len(slowed) == 1 and slowed[0]["args"]["ratio"] == pytest.approx(1.25)
    assert slowed[0]["dur"] == pytest.approx(5000)  # microseconds, the call's time
    assert [e["name"] for e in events].count("gpu turn") == 1
    assert not share.watching()
    assert counts["turns"] == 1 and counts["calls_timed"] == 6
    assert counts["calls_beside_turns"] == 1 and counts["slowed_calls"] == 1
    assert counts["slowed_ms"] == pytest.approx(1.0)
    assert counts["worst_extra_max_ms"] == pytest.approx(1.0)
    assert counts["since"] > 0 and counts["updated"] >= counts["since"]
    assert share.take_counters() == {}  # taken: nothing new


class _Launches:
    """A stand-in for timed launches: ``ms`` each, and the launches of each turn."""

    def __init__(self, ms: float) -> None:
        self.ms = ms
        self.per_turn: list[int] = []

    def __call__(self, run: Any, args: list[Any], count: int) -> list[float]:
        self.per_turn.append(count)
        return [self.ms] * count


class _Pacer:
    def __init__(self, budget: float) -> None:
        self.budget, self.turns = budget, 0

    def turn(self) -> Any:
        from contextlib import contextmanager

        @contextmanager
        def one() -> Any:
            self.turns += 1
            yield self.budget

        return one()


def test_a_benchmark_fits_its_launches_in_the_turns() -> None:
    launches, pacer = _Launches(0.1), _Pacer(0.45)
    ran: list[int] = []
    ms = time_sliced(lambda: ran.append(1), [], pacer, reps=10, launches=launches)
    assert ms == pytest.approx(0.1) and ran == [1]  # the warm-up launch
    assert launches.per_turn == [1, 4, 4, 1]  # one first, then what a turn holds
    assert pacer.turns == 4


def test_a_launch_too_long_for_any_turn_is_never_chosen() -> None:
    launches = _Launches(1.0)
    ms = time_sliced(lambda: None, [], _Pacer(1.0 / (OVER_BUDGET + 1)), launches=launches)
    assert ms == math.inf and launches.per_turn == [1]  # given up after one launch


def test_an_unpaced_gpu_times_every_launch_in_one_turn() -> None:
    launches = _Launches(0.2)
    assert time_sliced(lambda: None, [], gpu_share.Unpaced(), reps=10,
                       launches=launches) == pytest.approx(0.2)
    assert launches.per_turn == [10]


def test_a_shared_farm_gpu_keeps_to_its_duty_cycle() -> None:
    clock = FakeClock()
    cycle = DutyCycle("fake GPU", clock=clock, sleep=clock.sleep, slice_ms_=2.0, share_=0.2)
    starts = []
    for _ in range(3):
        with cycle.turn() as budget:
            assert budget == 2.0
            starts.append(clock.t)
            clock.t += 0.002
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert all(g == pytest.approx(0.002 / 0.2) for g in gaps)  # busy 1/5 of the time
    assert cycle.stats.turns == 3 and cycle.stats.turn_ms == pytest.approx(6.0)


def test_the_farm_shares_its_gpu_as_told(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(gpu_share.SHARED_GPU_ENV, "0")
    assert gpu_share.farm_pacer() is None
    monkeypatch.setenv(gpu_share.SHARED_GPU_ENV, "1")
    monkeypatch.setenv("KILN_TEST_FAKE_AUTOTUNE", "1")
    assert isinstance(gpu_share.farm_pacer(), DutyCycle)


@pytest.mark.parametrize(("nbytes", "ms", "peak", "worth"), [
    (3_000_000_000, 1.0, 3000.0, False),   # 3 TB/s of 3: at the roofline
    (300_000_000, 1.0, 3000.0, True),      # a tenth of it
    (1 << 20, 0.002, 3000.0, False),       # microseconds whatever the config
    (1 << 20, math.inf, 3000.0, True),     # the heuristic config does not run
    (1 << 20, 1.0, None, True),            # bandwidth unknown: tune
])
def test_only_kernels_far_from_the_roofline_are_worth_tuning(
        nbytes: int, ms: float, peak: float | None, worth: bool) -> None:
    assert worth_tuning(nbytes, ms, peak) is worth


def test_while_tuning_runs_the_gil_changes_hands_sooner() -> None:
    import sys

    before = sys.getswitchinterval()
    share = _share(FakeClock())
    with share.tuning():
        with share.tuning():  # (nested: a graph's tuning and a bucket's)
            assert sys.getswitchinterval() == min(before, gpu_share.SWITCH_S)
        assert sys.getswitchinterval() == min(before, gpu_share.SWITCH_S)
    assert sys.getswitchinterval() == before


def test_no_turn_beside_a_loops_first_calls_and_a_whole_slice_when_idle() -> None:
    clock = FakeClock()
    share = _share(clock)
    _call(share, clock, 4.0)  # one call: its steady time is not known yet
    start = clock.t
    with share.turn() as budget:  # so the turn waits until the program looks idle
        assert clock.t - start >= IDLE_S - 1e-9
        assert budget == 2.0  # and, idle, the turn may take the whole slice


def test_a_loop_with_no_gap_between_calls_does_not_starve_tuning() -> None:
    """A training or serving loop calls again the moment a call returns: the tuner,
    waiting for a gap between calls, would find none (before the handoff, six turns took
    about 20,000 such calls). The next call waits, at most HANDOFF_S, for the due turn to
    be taken: five turns come within a few hundred calls, real threads, real clock."""
    import threading
    import time

    share = GpuShare(None, slice_ms_=2.0, share_=0.25)
    turns_done = threading.Event()
    calls = 0

    def tuner() -> None:
        with share.tuning():
            for _ in range(5):
                with share.turn():
                    time.sleep(0.0002)  # the turn's launches
        turns_done.set()

    thread = threading.Thread(target=tuner)
    with share.tuning():  # calls are watched from the start, as while tuning waits
        thread.start()
        while not turns_done.is_set() and calls < 3000:
            call = share.call_begin("loop")
            time.sleep(0.001)  # the call's work; the next begins at once
            share.call_end(call)
            calls += 1
    taken = turns_done.is_set()  # before the loop stopped (then the program is idle)
    thread.join(30)
    assert taken and calls < 1000, f"5 turns not taken in {calls} back-to-back calls"
    assert share.stats.turns == 5 and share.stats.handoffs >= 1
