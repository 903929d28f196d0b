"""The backend freezes the objects older than a compile for the garbage collector while
it runs, and gives them back when the outermost compile returns (``frontend.core.backend``)."""

from __future__ import annotations

import gc

from kiln.frontend.core.backend import older_objects_frozen

FRESH = 10_000  # objects made between two steps of a test


def test_objects_are_frozen_during_the_outermost_compile_only() -> None:
    assert gc.get_freeze_count() == 0
    with older_objects_frozen():
        frozen = gc.get_freeze_count()
        assert frozen > 0
        # Made after the freeze: a second freeze would take them. (Frozen objects that
        # other threads free leave the count, so it is bounded, not compared exactly.)
        fresh = [[] for _ in range(FRESH)]
        with older_objects_frozen():  # a nested compile freezes nothing more
            assert gc.get_freeze_count() < frozen + len(fresh)
        assert 0 < gc.get_freeze_count() < frozen + len(fresh)
    assert gc.get_freeze_count() == 0 and gc.isenabled()


def test_a_program_that_froze_objects_or_disabled_the_collector_is_left_alone() -> None:
    gc.freeze()
    try:
        mine = gc.get_freeze_count()
        fresh = [[] for _ in range(FRESH)]
        with older_objects_frozen():  # Kiln freezes nothing more...
            assert gc.get_freeze_count() < mine + len(fresh)
        assert gc.get_freeze_count() > mine // 2  # ...and does not unfreeze the program's
    finally:
        gc.unfreeze()
    gc.disable()
    try:
        with older_objects_frozen():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_an_error_in_the_compile_still_unfreezes() -> None:
    try:
        with older_objects_frozen():
            raise RuntimeError("compile failed")
    except RuntimeError:
        pass
    assert gc.get_freeze_count() == 0
