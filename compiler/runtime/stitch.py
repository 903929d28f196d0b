"""Run a graph compiled as regions: each region's compiled ``call`` in order, values
passed from one to the next, and every value dropped right after its last use, so that
memory behaves as in the one graph (each region's wrapper frees its own inputs at their
last use too: it clears the argument list it is given).

    fn = stitch(steps, outputs, num_inputs)      a boxed callable: fn(args) -> outputs
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..regions import Source


@dataclass(frozen=True)
class Step:
    """One region at run time: its compiled ``call``, where each of its inputs comes
    from, the strides it was compiled for (None: a graph input, checked by the guards
    already), and how many values it returns."""

    call: Callable[[list[Any]], Sequence[Any]]
    inputs: tuple[Source, ...]
    strides: tuple[tuple[int, ...] | None, ...]
    num_outputs: int


@dataclass(frozen=True)
class Schedule:
    """Slots (graph inputs first, then each region's outputs), which slots each step
    reads, which it frees before it runs (their last use is this step), and which
    slots are the graph's outputs."""

    reads: tuple[tuple[int, ...], ...]
    frees: tuple[tuple[int, ...], ...]
    writes: tuple[int, ...]  # first slot of each step's outputs
    outputs: tuple[int | None, ...]
    num_slots: int


def schedule(steps: Sequence[Step], outputs: Sequence[Source], num_inputs: int) -> Schedule:
    """Slot numbers and last uses; ``ValueError`` for a source that names no earlier
    value (a plan from the store is checked here before anything runs)."""
    writes, slots = [], num_inputs
    for step in steps:
        writes.append(slots)
        slots += step.num_outputs

    def slot(source: Source, before: int) -> int:
        if source.kind == "input" and source.index < num_inputs:
            return source.index
        if source.kind == "value" and source.index < before and \
                source.output < steps[source.index].num_outputs:
            return writes[source.index] + source.output
        raise ValueError(f"value source {source} is not available there")

    reads = [tuple(slot(s, r) for s in step.inputs) for r, step in enumerate(steps)]
    kept = {slot(s, len(steps)) for s in outputs if s.kind != "none"}
    last: dict[int, int] = {}
    for r, read in enumerate(reads):
        for i in read:
            last[i] = r
    frees: list[list[int]] = [[] for _ in steps]
    for i, r in last.items():
        if i not in kept:
            frees[r].append(i)
    out = tuple(None if s.kind == "none" else slot(s, len(steps)) for s in outputs)
    return Schedule(tuple(reads), tuple(tuple(sorted(f)) for f in frees), tuple(writes), out,
                    slots)


def _restrided(value: Any, stride: tuple[int, ...] | None) -> Any:
    """A region's input with the strides it was compiled for (a region may return a
    value laid out otherwise than the trace said: copied, rarely)."""
    if stride is None or not isinstance(value, torch.Tensor) or value.stride() == stride:
        return value
    copy = torch.empty_strided(value.shape, stride, dtype=value.dtype, device=value.device)
    copy.copy_(value)
    return copy


def stitch(steps: Sequence[Step], outputs: Sequence[Source], num_inputs: int
           ) -> Callable[[list[Any]], tuple[Any, ...]]:
    """The boxed callable of the whole graph (see the module docstring)."""
    plan = schedule(steps, outputs, num_inputs)
    calls = [s.call for s in steps]
    strides = [s.strides for s in steps]
    counts = [s.num_outputs for s in steps]

    def call(args: list[Any]) -> tuple[Any, ...]:
        slots: list[Any] = list(args) + [None] * (plan.num_slots - len(args))
        args.clear()
        for r, fn in enumerate(calls):
            region_args = [_restrided(slots[i], s) for i, s in zip(plan.reads[r], strides[r])]
            for i in plan.frees[r]:
                slots[i] = None
            result = fn(region_args)
            del region_args
            if len(result) != counts[r]:
                raise RuntimeError(f"region {r} returned {len(result)} values, not the "
                                   f"{counts[r]} its plan says")
            base = plan.writes[r]
            slots[base:base + counts[r]] = result  # no loop variable keeps a value alive
            del result
        return tuple(None if i is None else slots[i] for i in plan.outputs)

    call._boxed_call = True  # type: ignore[attr-defined]
    return call
