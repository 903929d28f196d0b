"""The farm's GPU autotuner pool, scheduling only (plain asyncio; no Ray, no GPU): every
benchmark goes to a free GPU, none shares a GPU with another, the work spreads over all
of them, and each run is a span on its GPU's lane of the timeline. Each fake benchmark
holds its GPU a fixed time; the wall-time comparison has a wide margin (it is a check of
the schedule, not a performance figure)."""

from __future__ import annotations

import asyncio
import time

import pytest

from kiln.frontend.trace import format_summary, gpu_usage, spans_from_events, summarize
from kiln.workers.gpu_pool import ActorPool, gpu_lane_event

HOLD_S = 0.05


def _pool(gpus: int, arch: int = 90) -> ActorPool:
    pool = ActorPool()
    for i in range(gpus):
        pool.add(object(), {"arch": arch, "pid": 1000 + i, "gpu_ids": [str(i)]})
    return pool


async def _run(pool: ActorPool, jobs: int) -> tuple[list[dict], int, float]:  # type: ignore[type-arg]
    running: dict[int, int] = {}
    most = 0
    events = []

    async def job(n: int) -> None:
        nonlocal most
        async with pool.use(pool.matching(90)) as gpu:
            running[gpu.index] = running.get(gpu.index, 0) + 1
            most = max(most, running[gpu.index])
            began = time.time_ns() / 1000
            await asyncio.sleep(HOLD_S)
            events.append(gpu_lane_event(gpu, "gemm benchmark", began, time.time_ns() / 1000,
                                         problem=str(n)))
            running[gpu.index] -= 1

    start = time.perf_counter()
    await asyncio.gather(*(job(n) for n in range(jobs)))
    return events, most, time.perf_counter() - start


def test_sixteen_benchmarks_spread_over_four_gpus_one_at_a_time() -> None:
    pool = _pool(4)
    events, most, wall4 = asyncio.run(_run(pool, 16))
    assert most == 1  # never two benchmarks on one GPU
    assert [u["jobs"] for u in pool.usage()] == [4, 4, 4, 4]
    assert all(u["busy_s"] >= 4 * HOLD_S * 0.9 for u in pool.usage())
    # The timeline says the same: one lane per GPU (the autotuner's process), 4 runs each.
    usage = gpu_usage(spans_from_events(events))
    assert [(g["gpu"], g["jobs"]) for g in usage["gpus"]] == [(str(i), 4) for i in range(4)]
    assert {(e["pid"], e["tid"]) for e in events} == {(1000 + i, i) for i in range(4)}
    assert {e["args"]["gpu_ids"] for e in events} == {"0", "1", "2", "3"}
    single = _pool(1)
    _, most1, wall1 = asyncio.run(_run(single, 16))
    assert most1 == 1 and single.usage()[0]["jobs"] == 16
    assert wall1 >= 16 * HOLD_S
    assert wall4 < 0.6 * wall1


def test_only_gpus_of_the_targets_arch_are_used() -> None:
    pool = ActorPool()
    pool.add(object(), {"arch": 80, "pid": 1})
    pool.add(object(), {"arch": 90, "pid": 2})
    pool.add(object(), {"arch": -1, "pid": 3})  # the tests' fake benchmark: any arch
    assert pool.matching(90) == [1, 2] and pool.matching(80) == [0, 2]

    async def one() -> int:
        async with pool.use(pool.matching(90)) as gpu:
            return gpu.index

    assert asyncio.run(one()) == 1


def test_no_matching_gpu_is_an_error_not_a_hang() -> None:
    async def none() -> None:
        async with ActorPool().use([]):
            pass

    with pytest.raises(ValueError, match="no actor in the pool"):
        asyncio.run(none())


def test_trace_summary_reports_each_gpus_busy_time() -> None:
    pool = _pool(2)
    events, _, _ = asyncio.run(_run(pool, 4))
    local = {"name": "gemm benchmark", "ph": "X", "ts": events[0]["ts"], "dur": 10.0,
             "pid": 7, "tid": 7, "cat": "autotune", "args": {"gpu": "local"}}
    summary = summarize(spans_from_events(events + [local]))
    usage = summary["gpu_usage"]
    assert [(g["gpu"], g["jobs"]) for g in usage["gpus"]] == [("0", 2), ("1", 2)]
    assert all(g["busy_ms"] >= 2 * HOLD_S * 1e3 * 0.9 for g in usage["gpus"])
    assert usage["wall_ms"] <= sum(g["busy_ms"] for g in usage["gpus"])
    text = format_summary(summary)
    assert "GPU autotuners" in text and "GPU 0" in text and "GPU 1" in text
