"""The first-call warm-up in tests: a compile that ends before its warm-up stops the
warm-up after its call in flight (tests/unit/test_warmup.py), so a test that counts the
warmed calls would race the compile's time (fast on the H200, slow under the
interpreter). ``compile_after_the_warmup`` makes the client's compile wait for the
warm-up to end."""

from __future__ import annotations

import threading
from typing import Any

import pytest


def compile_after_the_warmup(monkeypatch: pytest.MonkeyPatch,
                             warm_here: bool | None = None) -> None:
    """Patch the client's ``overlap`` so its compile starts once the warm-up has ended;
    ``warm_here`` (when given) places the warm-up on the caller's thread or not, as
    beside a farm's compile or beside a local one."""
    from kiln.frontend.core import client as kiln_client

    real_overlap = kiln_client.overlap

    def overlap(work: Any, warm: Any, warm_here: bool) -> Any:
        if warm is None:
            return real_overlap(work, warm, warm_here=warm_here)
        done = threading.Event()

        def warm_then_done(stop: threading.Event | None = None) -> None:
            try:
                warm(stop)
            finally:
                done.set()

        def work_after() -> Any:
            assert done.wait(120), "the warm-up did not end"
            return work()

        return real_overlap(work_after, warm_then_done,
                            warm_here=warm_here if placed is None else placed)

    placed = warm_here
    monkeypatch.setattr(kiln_client, "overlap", overlap)
