"""Spans of one compile, for the timeline that ``KILN_TRACE=path`` writes.

A tiny, pure-Python recorder (no Ray, no fsspec, no torch) that every process of a compile
uses: the client, the farm's coordinator, compile workers, kernel tasks and GPU
autotuners. A span is a Chrome trace "complete" event (``ph: "X"``) with wall-clock
microseconds, so spans from several processes of one machine line up on one timeline.

    with trace.span("lowering", cat="compiler", graph=name):
        ...

Recording is off unless this process turned it on (``enable()``: the client does when
``KILN_TRACE`` or ``KILN_DEBUG`` is set) or a ``capture()`` block is open in this thread
(a farm process asked to trace one request): a span then costs two clock reads. Events
are plain dicts, so a farm process returns them with its result and the client merges
them into its own file (``frontend.trace``).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

Event = dict[str, Any]
T = TypeVar("T")
R = TypeVar("R")

_lock = threading.Lock()
_events: list[Event] = []
_merged: set[tuple[Any, ...]] = set()
_enabled = False
_local = threading.local()
_process_name: str | None = None


def enable(on: bool = True) -> None:
    """Record every span of this process (until ``enable(False)``)."""
    global _enabled
    _enabled = on


def set_process_name(name: str) -> None:
    """How this process is labelled on the timeline ("client", "compile worker", ...)."""
    global _process_name
    _process_name = name


def recording() -> bool:
    return _enabled or bool(getattr(_local, "captures", None))


def now_us() -> float:
    return time.time_ns() / 1000.0


def _process_label() -> str:
    return _process_name or f"pid {os.getpid()}"


@contextmanager
def background() -> Iterator[None]:
    """Spans this thread records inside the block are background work (autotuning after
    the first output): they carry ``args["background"]`` and ``kiln trace summary`` keeps
    them off the critical path of the first output."""
    before = getattr(_local, "background", False)
    _local.background = True
    try:
        yield
    finally:
        _local.background = before


def in_background() -> bool:
    return bool(getattr(_local, "background", False))


def carry(fn: Callable[[T], R]) -> Callable[[T], R]:
    """``fn`` for another thread (a pool's) with this thread's recording context: its
    spans go to this thread's open captures too, and are background work where this
    thread's are."""
    sinks, behind = list(getattr(_local, "captures", None) or []), in_background()
    if not sinks and not behind:
        return fn

    def run(arg: T) -> R:
        before = getattr(_local, "captures", None)
        _local.captures = [*(before or []), *sinks]
        try:
            if not behind:
                return fn(arg)
            with background():
                return fn(arg)
        finally:
            _local.captures = before

    return run


def add(event: Event) -> None:
    """Record a finished event (this process's buffer, and any open capture)."""
    event.setdefault("pid", os.getpid())
    event.setdefault("tid", threading.get_native_id())
    event.setdefault("args", {}).setdefault("process", _process_label())
    if in_background():
        event["args"]["background"] = True
    captures = getattr(_local, "captures", None)
    if captures:
        for sink in captures:
            sink.append(event)
    if _enabled:
        with _lock:
            _events.append(event)


def make_event(name: str, start_us: float, end_us: float, cat: str = "kiln",
               **args: Any) -> Event:
    """A span as an event of this process and thread, not recorded anywhere (an async
    actor keeps one list per request: its coroutines share one thread)."""
    return {"name": name, "cat": cat, "ph": "X", "ts": start_us,
            "dur": max(0.0, end_us - start_us), "pid": os.getpid(),
            "tid": threading.get_native_id(), "args": {**args, "process": _process_label()}}


def complete(name: str, start_us: float, end_us: float, cat: str = "kiln",
             **args: Any) -> None:
    """A span measured elsewhere (a queue wait computed from two clocks)."""
    if recording():
        add(make_event(name, start_us, end_us, cat, **args))


@contextmanager
def span(name: str, cat: str = "kiln", **args: Any) -> Iterator[dict[str, Any]]:
    """Time the block as one span; the yielded dict takes more ``args`` on the way."""
    if not recording():
        yield args
        return
    start_wall = now_us()
    start = time.perf_counter_ns()
    try:
        yield args
    finally:
        dur = (time.perf_counter_ns() - start) / 1000.0
        add({"name": name, "cat": cat, "ph": "X", "ts": start_wall, "dur": dur,
             "args": dict(args)})


@contextmanager
def capture(on: bool = True) -> Iterator[list[Event]]:
    """Collect the spans this thread records inside the block (for a farm process to
    send back with its result); an empty list and no cost when ``on`` is false."""
    sink: list[Event] = []
    if not on:
        yield sink
        return
    captures = getattr(_local, "captures", None)
    if captures is None:
        captures = _local.captures = []
    captures.append(sink)
    try:
        yield sink
    finally:
        captures.remove(sink)


def merge(events: list[Event] | None) -> None:
    """Events recorded in another process (the farm's), into this process's buffer;
    an event merged before is not added twice. Merged from a background thread (the
    farm's tuning), they are background work."""
    if not events or not _enabled:
        return
    behind = in_background()
    with _lock:
        for event in events:
            if not isinstance(event, dict):
                continue
            ident = (event.get("name"), event.get("ts"), event.get("pid"), event.get("tid"))
            if ident not in _merged:
                _merged.add(ident)
                event = dict(event)
                if behind:
                    event["args"] = {**(event.get("args") or {}), "background": True}
                _events.append(event)


def events() -> list[Event]:
    """A copy of every event this process recorded or merged so far."""
    with _lock:
        return list(_events)


def clear() -> None:
    with _lock:
        _events.clear()
        _merged.clear()
