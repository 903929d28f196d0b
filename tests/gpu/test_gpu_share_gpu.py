"""Benchmarks that share the GPU with a program's loop (``workers.gpu_share``) on a real
GPU: a loop of matmuls reports its calls on the default stream while another thread
times a kernel in turns on the low-priority stream. The paced timing agrees with the
unpaced one, turns ran and were counted, the loop's calls were timed with CUDA events,
and the loop's results are right."""

from __future__ import annotations

import threading

import pytest
import torch

from kiln.compiler.autotune import time_launch, time_sliced
from kiln.compiler.runtime.cudagraphs import GPU_WORK_LOCK
from kiln.workers.gpu_share import GpuShare, TorchDevice, peak_gb_s


def test_a_benchmark_in_turns_beside_a_loop_agrees_with_one_alone() -> None:
    share = GpuShare(TorchDevice(torch.cuda.current_device()), lock=GPU_WORK_LOCK)
    # a call of about a millisecond; a kernel to time of some microseconds
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.float16)
    expected = (a.float() @ b.float())
    x = torch.randn(1 << 22, device="cuda")
    alone = time_launch(lambda t: t.mul_(1.0), [x])
    result: dict[str, float] = {}

    def tune() -> None:
        with share.tuning():
            result["peak"] = peak_gb_s(share) or 0.0
            result["ms"] = time_sliced(lambda t: t.mul_(1.0), [x], share)

    with share.tuning():  # the loop's calls are reported from its start
        thread = threading.Thread(target=tune)
        thread.start()
        calls = 0
        while thread.is_alive() or calls < 20:
            call = share.call_begin("matmul")
            out = a @ b
            share.call_end(call)
            calls += 1
            if calls % 10 == 0:  # a loop reads a result now and then (loss.item())
                torch.testing.assert_close(out.float(), expected, atol=1.0, rtol=2e-2)
        thread.join()
    torch.cuda.synchronize()
    counts = share.take_counters()["gpu_share"][share.stats.gpu]
    assert share.stats.gpu.startswith("cuda:")
    assert counts["turns"] >= 2 and counts["calls_timed"] > 0
    assert result["peak"] > 100.0  # GB/s: a real copy was timed
    assert result["ms"] == pytest.approx(alone, rel=0.5)
