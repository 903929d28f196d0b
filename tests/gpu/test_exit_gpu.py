"""On a GPU: a program that compiled a training step and an inference graph in process
exits with status 0 while its background tuning is cut off at exit (H200, 2026-12-04: it
died of SIGABRT, "terminate called without an active exception", after all its output).
``KILN_AUTOTUNE_EXIT_WAIT=0`` abandons tuning at once, wherever it is: compiling
candidates, benchmarking them, or loading the tuned kernels."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import sys, warnings
import torch
from kiln.frontend.core.fallback import KilnFallbackWarning

warnings.simplefilter("error", KilnFallbackWarning)
torch.manual_seed(int(sys.argv[1]))
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(),
                            torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 256)).cuda()
x = torch.randn(512, 256, device="cuda")
step = torch.compile(lambda m, x: m(x).square().mean(), backend="kiln")
loss = step(model, x)
loss.backward()
grads = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
ref = model(x).square().mean()
ref.backward()
torch.testing.assert_close(loss, ref, rtol=1e-4, atol=1e-4)
for got, want in zip(grads, [p.grad for p in model.parameters()]):
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
with torch.no_grad():
    y = torch.randn(512, 256, device="cuda")
    torch.testing.assert_close(torch.compile(model, backend="kiln")(y), model(y),
                               rtol=1e-4, atol=1e-4)
torch.cuda.synchronize()
print("done", flush=True)
"""


@pytest.mark.parametrize("wait", ["0", "1"])
def test_in_process_training_then_inference_exits_cleanly_with_tuning_cut_off(
        tmp_path: Path, wait: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(KILN_FARM="inprocess", KILN_STORE=str(tmp_path / "store"),
               KILN_CACHE_DIR=str(tmp_path / "cache"), KILN_AUTOTUNE_EXIT_WAIT=wait,
               KILN_STATS_FILE=str(tmp_path / "stats.json"),
               TRITON_CACHE_DIR=str(tmp_path / "triton"))
    (tmp_path / "cache").mkdir(mode=0o700)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, wait], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert proc.stdout.strip().endswith("done"), proc.stdout
    assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
