"""bench/memory_probe.py's reading of ``torch.cuda.memory`` snapshots (no GPU here: the
snapshots are written by hand in the format torch gives): the allocations alive at the
trace's highest point, and the blocks still allocated, each grouped by the frame that
best names who allocated them (a Kiln wrapper line with its text, read from linecache)."""

from __future__ import annotations

import linecache

from bench.memory_probe import alive_at_peak, held_by_frame

WRAPPER = "<kiln wrapper g>"
MB = 2**20


def _frames(line: int) -> list[dict[str, object]]:
    return [{"filename": "/site-packages/torch/cuda/memory.py", "line": 9, "name": "x"},
            {"filename": WRAPPER, "line": line, "name": "call"}]


def test_the_peak_and_what_is_held_are_named_by_wrapper_line() -> None:
    source = "def call(args):\n    buf0 = empty((4,))\n    buf1 = torch.mm(a, b)\n"
    linecache.cache[WRAPPER] = (len(source), None, source.splitlines(True), WRAPPER)
    trace = [
        {"action": "alloc", "addr": 1, "size": 3 * MB, "frames": _frames(2)},
        {"action": "alloc", "addr": 2, "size": 5 * MB, "frames": _frames(3)},
        {"action": "free_requested", "addr": 1, "size": 3 * MB},
        {"action": "free_completed", "addr": 1, "size": 3 * MB},
        {"action": "alloc", "addr": 3, "size": 1 * MB, "frames": _frames(2)},
    ]
    peak, groups = alive_at_peak({"device_traces": [trace]}, 0)
    assert peak == 8.0  # both first buffers, before the free
    assert groups == {f"{WRAPPER}:3 buf1 = torch.mm(a, b)": 5.0,
                      f"{WRAPPER}:2 buf0 = empty((4,))": 3.0}
    snapshot = {"segments": [{"blocks": [
        {"state": "active_allocated", "size": 5 * MB, "frames": _frames(3)},
        {"state": "inactive", "size": 7 * MB, "frames": _frames(2)},
        {"state": "active_allocated", "size": 2 * MB},  # allocated before recording
    ]}]}
    assert held_by_frame(snapshot) == {f"{WRAPPER}:3 buf1 = torch.mm(a, b)": 5.0,
                                       "?": 2.0}
