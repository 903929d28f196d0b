"""A program that compiled with Kiln in process exits with its own status, at once.

On the H200 host (2026-12-04) a script that compiled a training step and then an inference
graph with ``KILN_FARM=inprocess`` printed "terminate called without an active exception"
after all its output and died of SIGABRT (status 134): the background tuning still running
after ``KILN_AUTOTUNE_EXIT_WAIT`` was abandoned inside torch's C++ code, and a daemon thread
returning from C++ into a finalizing interpreter aborts the process. A CPU graph never
tunes, so the pending case here submits a tuning job doing torch work on the client's own
tuner, as ``autotune_inprocess`` does (``foreground.wait_idle`` before each step). Each
case compiles a training step and an inference graph, checks them against eager with
fresh random inputs, and exits; the test checks the exit status and stderr.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = r"""
import sys, time, warnings
import torch
from kiln.frontend.core.fallback import KilnFallbackWarning

warnings.simplefilter("error", KilnFallbackWarning)
torch.manual_seed(int(sys.argv[2]))
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
x = torch.randn(8, 16)
step = torch.compile(lambda m, x: m(x).square().mean(), backend="kiln")

loss = step(model, x)
loss.backward()
grads = [p.grad.clone() for p in model.parameters()]
model.zero_grad()
ref = model(x).square().mean()
ref.backward()
torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
for got, want in zip(grads, [p.grad for p in model.parameters()]):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

with torch.no_grad():  # and an inference graph after it
    infer = torch.compile(model, backend="kiln")
    y = torch.randn(8, 16)
    torch.testing.assert_close(infer(y), model(y), rtol=1e-5, atol=1e-5)

if sys.argv[1] == "pending":  # tuning still running at exit, inside torch's C++ code
    from kiln.frontend.core.client import _clients
    from kiln.workers import foreground
    started = []

    def tune():
        a = torch.randn(600, 600)
        while True:
            foreground.wait_idle()
            for _ in range(20):
                a = (a @ a).tanh()
            started.append(1)

    client = next(iter(_clients.values()))
    client.tuner.submit("f" * 64, tune, lambda graph: None, local=True)
    while not started:
        time.sleep(0.01)
print("done", flush=True)
"""


@pytest.mark.parametrize("background", ["none", "pending"])
def test_a_training_step_then_inference_compiled_in_process_exits_cleanly(
        tmp_path: Path, background: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    env.update(KILN_FARM="inprocess", KILN_STORE=str(tmp_path / "store"),
               KILN_CACHE_DIR=str(tmp_path / "cache"), KILN_AUTOTUNE_EXIT_WAIT="0.2",
               KILN_STATS_FILE=str(tmp_path / "stats.json"))
    (tmp_path / "cache").mkdir(mode=0o700)
    for seed in range(2):
        proc = subprocess.run([sys.executable, "-c", SCRIPT, background, str(seed)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
        assert proc.stdout.strip().endswith("done"), proc.stdout
        assert "terminate called" not in proc.stderr, proc.stderr[-3000:]
