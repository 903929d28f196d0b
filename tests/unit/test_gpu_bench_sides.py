"""bench/gpu_bench.py's split runs (no GPU needed for these parts): rows of a Kiln-only
and an Inductor-only run merge into one table with the ratio computed from both, and a
training step starts each call with fresh gradients and a new CUDA-graph step. The bench
sets cache variables when imported, so it runs in a child process here."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

KILN_SIDE = {"copy_GBps": 4000.0, "side": "kiln", "failed": [], "rows": [
    {"workload": "MLP training step 4096x1024 fp32", "side": "kiln", "mode": "max-autotune",
     "eager_ms": 5.0, "eager_kernel_ms": 4.8, "eager_launches": 20.0, "kiln_ms": 4.2,
     "kiln_kernel_ms": 4.1, "kiln_launches": 9.0, "kiln_compile_s": 21.5,
     "kiln_default_ms": 4.3, "kiln_default_compile_s": 6.0, "bytes_moved": 0,
     "gemm_problems": 5, "gemm_benchmarked": 5, "gemm_cached": 0, "gemm_untuned": 0,
     "kiln_cudagraphs_ms": 3.9}]}
INDUCTOR_SIDE = {"copy_GBps": 3900.0, "side": "inductor", "failed": [], "rows": [
    {"workload": "MLP training step 4096x1024 fp32", "side": "inductor",
     "mode": "max-autotune", "eager_ms": 5.5, "eager_kernel_ms": 4.9, "eager_launches": 20.0,
     "inductor_ms": 4.0, "inductor_kernel_ms": 3.9, "inductor_launches": 11.0,
     "inductor_compile_s": 150.0, "bytes_moved": 0}]}


def _bench(*args: str, code: str | None = None) -> str:
    command = [sys.executable, *(["-c", code] if code else ["bench/gpu_bench.py"]), *args]
    done = subprocess.run(command, cwd=ROOT / ("bench" if code else ""), capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_sides_merge_into_one_table(tmp_path: Path) -> None:
    kiln, inductor = tmp_path / "kiln.json", tmp_path / "inductor.json"
    kiln.write_text(json.dumps(KILN_SIDE))
    inductor.write_text(json.dumps(INDUCTOR_SIDE))
    out = _bench("--merge", str(kiln), str(inductor))
    (row,) = [line for line in out.splitlines() if line.startswith("| MLP")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    # workload, eager (the first file's), inductor, kiln, kiln default, kiln/inductor, ...
    assert cells[:6] == ["MLP training step 4096x1024 fp32", "5.000", "4.000", "4.200",
                         "4.300", "1.05"]
    assert cells[-3:] == ["20/11/9", "21.5", "150.0"]
    assert "copy bandwidth (d2d, read+write): 4000 GB/s" in out
    assert "5 benchmarked, 0 cached, 0 untuned" in out
    assert "with KILN_CUDAGRAPHS=1 (a diagnostic, not Kiln's mode): 3.900 ms, 0.97x" in out


def test_a_side_alone_prints_dashes_for_the_other(tmp_path: Path) -> None:
    kiln = tmp_path / "kiln.json"
    kiln.write_text(json.dumps(KILN_SIDE))
    out = _bench("--merge", str(kiln))
    (row,) = [line for line in out.splitlines() if line.startswith("| MLP")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[2] == "-" and cells[5] == "-" and cells[3] == "4.200"


STEPPED = """
import torch
import gpu_bench
from torch._inductor import cudagraph_trees

lin = torch.nn.Linear(4, 3)
lin.weight.grad = torch.randn(3, 4)
seen = []

def step(x):
    seen.append((lin.weight.grad, cudagraph_trees.MarkStepBox.mark_step_counter))
    lin(x).sum().backward()

w = gpu_bench.Workload("t", step, lambda: [], train=True, params=list(lin.parameters()))
before = cudagraph_trees.MarkStepBox.mark_step_counter
stepped = w.stepped(step)
stepped(torch.randn(2, 4))
stepped(torch.randn(2, 4))
assert [g for g, _ in seen] == [None, None], seen
assert [c for _, c in seen] == [before - 1, before - 2], (before, seen)
infer = gpu_bench.Workload("i", step, lambda: [])
assert infer.stepped(step) is step
print("ok")
"""


def test_training_steps_start_with_fresh_gradients_and_a_new_graph_step() -> None:
    assert _bench(code=STEPPED).strip().endswith("ok")
