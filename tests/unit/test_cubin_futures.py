"""A kernel's first launch that meets a failed or deferred cubin load keeps none of its
callers' frames alive.

The cubin loader keeps each job's future, and so a failed load's exception. Raised again
on the launching thread as it was, that exception took the frames it passed through into
its traceback and kept them: the wrapper call that made the first launch, with every
buffer alive at that moment. On the H100 host ViT-B/16 held 743 MB and ResNet-50 1.9 GB
of such buffers between calls (``bench/memory_probe.py``), with tuning and the first-call
warm-up off as well."""

from __future__ import annotations

import gc
import weakref
from concurrent.futures import Future

import pytest

from kiln.compiler.runtime.cuda_driver import CudaDriverError, LoadDeferred
from kiln.compiler.runtime.static_launcher import (
    CubinLoadFailed,
    StaticCudaKernel,
    _result_unless_deferred,
    wait_prefetched,
)


class _Buffer:
    """Stands for a wrapper buffer alive in the calling frame."""


def _first_launch(pending: Future[object]) -> tuple[weakref.ref[_Buffer], object]:
    buffer = _Buffer()
    try:
        outcome: object = _result_unless_deferred(pending)  # type: ignore[arg-type]
    except CubinLoadFailed as e:
        outcome = f"failed: {e}"  # (the error itself holds this frame, as any raised)
    return weakref.ref(buffer), outcome


@pytest.mark.parametrize("error", [LoadDeferred("a capture holds the GPU"),
                                   CudaDriverError("cuModuleLoadData failed")])
def test_a_stored_load_error_keeps_no_frame_of_the_launch(error: Exception) -> None:
    pending: Future[object] = Future()
    pending.set_exception(error)
    for _ in range(2):  # a kernel shared by two graphs: the loader's same future
        buffer, outcome = _first_launch(pending)
        gc.collect()
        assert buffer() is None, "the launching frame's buffer is still alive"
    if isinstance(error, LoadDeferred):
        assert outcome is None  # the kernel loads on the launching thread instead
    else:
        assert str(outcome).startswith("failed: CudaDriverError: cuModuleLoadData")
    assert error.__traceback__ is None  # never raised here: no frame of ours on it


def test_waiting_for_prefetched_loads_raises_nothing_and_keeps_no_frame() -> None:
    def kernel(pending: Future[object]) -> StaticCudaKernel:
        made = StaticCudaKernel.__new__(StaticCudaKernel)  # only what the wait reads
        made._pending = pending  # type: ignore[assignment]
        return made

    failed: Future[object] = Future()
    failed.set_exception(CudaDriverError("out of memory"))
    done: Future[object] = Future()
    done.set_result(object())
    assert wait_prefetched([kernel(failed), kernel(done), object()]) == 2
    assert failed.exception() is not None and failed.exception().__traceback__ is None
