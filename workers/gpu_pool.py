"""The farm's actors as pools (no Ray here: plain asyncio in the coordinator): its GPU
autotuners, and its kernel workers.

Every benchmark, a kernel's configs or a matmul's template choices, waits for whichever
allowed GPU frees first and runs there alone: the work spreads over every GPU the farm
has, a fast GPU takes more of it than a slow one, and no benchmark is timed while another
runs on the same GPU. Each run is a span on its GPU's own lane of the compile timeline
(``gpu_lane_event``), so ``kiln trace summary`` can say how evenly the GPUs were used.
Kernel compiles take the free kernel worker that has done least the same way: one
compile per worker process at a time, as many at once as the farm has workers.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from kiln.compiler import trace


@dataclass
class PoolMember:
    """One actor (an ``Autotuner``: with its GPU's arch and the GPU ids Ray gave it; a
    ``KernelWorker``: no arch), the process it runs in, and what it has done (jobs, busy
    microseconds)."""

    index: int
    actor: Any
    arch: int | None
    pid: int = 0
    gpu_ids: list[str] = field(default_factory=list)
    busy: bool = False
    jobs: int = 0
    busy_us: float = 0.0


class ActorPool:
    """Actors by index; ``use(allowed)`` lends the free one that has done least."""

    def __init__(self) -> None:
        self.members: list[PoolMember] = []
        self._changed = asyncio.Condition()

    def add(self, actor: Any, info: dict[str, Any]) -> PoolMember:
        member = PoolMember(len(self.members), actor, info.get("arch"),
                           int(info.get("pid") or 0),
                           [str(g) for g in info.get("gpu_ids") or []])
        self.members.append(member)
        return member

    def everyone(self) -> list[int]:
        return [m.index for m in self.members]

    def matching(self, arch: int) -> list[int]:
        """Indices of the autotuners that can time kernels built for ``arch`` (-1: the
        tests' fake benchmark, which matches any)."""
        return [m.index for m in self.members if m.arch in (arch, -1)]

    @asynccontextmanager
    async def use(self, allowed: Sequence[int]) -> AsyncIterator[PoolMember]:
        """The first of ``allowed`` to be free, held for the block."""
        if not allowed:
            raise ValueError("no actor in the pool to run on")
        async with self._changed:
            await self._changed.wait_for(lambda: any(not self.members[i].busy
                                                     for i in allowed))
            member = min((self.members[i] for i in allowed if not self.members[i].busy),
                         key=lambda m: (m.jobs, m.index))
            member.busy = True
        began = trace.now_us()
        try:
            yield member
        finally:
            member.jobs += 1
            member.busy_us += trace.now_us() - began
            async with self._changed:
                member.busy = False
                self._changed.notify_all()

    def usage(self) -> list[dict[str, Any]]:
        """Per GPU: jobs run and seconds busy since the farm started."""
        return [{"gpu": m.index, "gpu_ids": m.gpu_ids, "jobs": m.jobs,
                 "busy_s": m.busy_us / 1e6} for m in self.members]


def gpu_lane_event(member: PoolMember, name: str, start_us: float, end_us: float,
                   **args: Any) -> trace.Event:
    """A span on ``member``'s lane of the timeline: its process (the autotuner's), one
    thread per GPU, and ``gpu`` in its args (what per-GPU busy time is summed by)."""
    event = trace.make_event(name, start_us, end_us, cat="autotune", gpu=member.index,
                             gpu_ids=",".join(member.gpu_ids), **args)
    event["pid"] = member.pid or event["pid"]
    event["tid"] = member.index
    event["args"]["process"] = f"GPU autotuner {member.index}"
    return event
