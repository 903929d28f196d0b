"""bench/gpu_timing.py (no GPU needed; a CPU clock stands in for CUDA events): the sides
of a row are timed in alternating blocks, each side's median over all its calls, so a
host that slows down part-way through slows every side alike; the Dynamo floor's backend
computes the outputs once and every call returns them; the merged table prints the
floor's note line under a reduce-overhead row; and ``BENCH_SDPA_PRIORITY`` sets the
attention-backend order for the run (a diagnostic), rejecting unknown names."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_timing  # noqa: E402


class _DriftingHost:
    """A clock for ``time_interleaved`` where each call costs ``cost[name]`` ms, times
    ``slow`` from the ``slow_after``-th timed call of the run on (a host that drifts)."""

    def __init__(self, cost: dict[str, float], slow_after: int, slow: float) -> None:
        self.cost, self.slow_after, self.slow = cost, slow_after, slow
        self.order: list[str] = []

    def fn(self, name: str) -> Callable[..., Any]:
        def call(x: torch.Tensor) -> torch.Tensor:
            return x + 1

        call.__name__ = name
        return call

    def timer(self, fn: Callable[..., Any], args: list[Any]) -> float:
        fn(*args)
        self.order.append(fn.__name__)
        factor = self.slow if len(self.order) > self.slow_after else 1.0
        return self.cost[fn.__name__] * factor


def test_blocks_alternate_and_a_drift_lands_on_every_side() -> None:
    host = _DriftingHost({"eager": 1.0, "kiln": 0.5}, slow_after=8, slow=3.0)
    fns = {name: host.fn(name) for name in ("eager", "kiln")}
    got = gpu_timing.time_interleaved(fns, [[torch.randn(4)]], reps=8, blocks=4,
                                      timer=host.timer)
    assert host.order == ["eager", "eager", "kiln", "kiln"] * 4
    # half of each side's calls ran on the slowed host: the ratio is the true one
    assert got["kiln"] / got["eager"] == 0.5
    assert got == {"eager": 2.0, "kiln": 1.0}
    # one side after the other (what the bench did before) puts the drift on one side
    host = _DriftingHost({"eager": 1.0, "kiln": 0.5}, slow_after=8, slow=3.0)
    alone = {name: gpu_timing.time_fn(host.fn(name), [[torch.randn(4)]], 8, host.timer)
             for name in ("eager", "kiln")}
    assert alone["kiln"] / alone["eager"] == 1.5


def test_floor_backend_returns_the_outputs_computed_once() -> None:
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return (a * b).relu() + a

    first = [torch.randn(64, 128), torch.randn(64, 128)]
    floor = gpu_timing.floor_compiled(fn, first)
    out = floor(*first)
    torch.testing.assert_close(out, fn(*first))
    later = [torch.randn(64, 128), torch.randn(64, 128)]
    again = floor(*later)
    assert again is out  # no work per call: the ready output, not fn(*later)
    assert not torch.allclose(again, fn(*later))
    torch._dynamo.reset()


def test_table_prints_the_dynamo_floor_under_a_reduce_overhead_row(tmp_path: Path) -> None:
    row = {"workload": "seed 64x128 fp32 reduce-overhead", "side": "both",
           "eager_ms": 0.040, "inductor_ms": 0.030, "kiln_ms": 0.025,
           "dynamo_floor_ms": 0.018, "bytes_moved": 0}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"copy_GBps": 4000.0, "side": "both", "rows": [row]}))
    done = subprocess.run([sys.executable, "bench/gpu_bench.py", "--merge", str(path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("seed 64x128 fp32 reduce-overhead: Dynamo floor (a backend returning ready "
            "outputs) 0.0180 ms = 0.45x eager; Kiln 0.0250 ms = 0.62x eager, Inductor "
            "0.75x eager") in done.stdout, done.stdout


def test_sdpa_priority_from_the_environment(monkeypatch: Any) -> None:
    from torch.nn.attention import SDPBackend

    monkeypatch.delenv("BENCH_SDPA_PRIORITY", raising=False)
    before = torch._C._get_sdp_priority_order()
    with gpu_timing.sdpa_priority():
        assert torch._C._get_sdp_priority_order() == before
    monkeypatch.setenv("BENCH_SDPA_PRIORITY", "efficient, flash,cudnn,math")
    with gpu_timing.sdpa_priority():
        order = torch._C._get_sdp_priority_order()
        assert order[:4] == [b.value for b in (SDPBackend.EFFICIENT_ATTENTION,
                                               SDPBackend.FLASH_ATTENTION,
                                               SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH)]
    assert torch._C._get_sdp_priority_order() == before
    monkeypatch.setenv("BENCH_SDPA_PRIORITY", "efficient,fast")
    try:
        gpu_timing.sdpa_priority()
    except ValueError as e:
        assert "unknown backends ['fast']" in str(e)
    else:
        raise AssertionError("an unknown backend name was accepted")
