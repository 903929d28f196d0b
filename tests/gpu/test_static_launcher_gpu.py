"""The warm path on the GPU: a new process with only the store (empty Kiln, Triton and
XDG caches) and no C compiler loads every cubin through torch's static launcher, runs
the model and matches eager; then the in-process background autotuning publishes a tuned
artifact that the next process picks up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

RUN = """
import json, sys, time, warnings
import torch
from kiln.frontend.core.fallback import KilnFallbackWarning
from kiln.compiler import compiled_graph
from tests.models import Block
warnings.simplefilter("error", KilnFallbackWarning)
kinds = []
make = compiled_graph._launcher
def spy(compiled, spec, device, *rest):
    launcher = make(compiled, spec, device, *rest)
    kinds.append(type(launcher).__name__)
    return launcher
compiled_graph._launcher = spy
torch.manual_seed(0)
model = Block().cuda()
x = torch.randn(4, 16, 32, device="cuda")
start = time.perf_counter()
with torch.no_grad():
    out = torch.compile(model, backend="kiln")(x)
    torch.cuda.synchronize()
    first = time.perf_counter() - start
    torch.testing.assert_close(out, model(x), atol=1e-4, rtol=1e-3)
from kiln.frontend.core.client import _clients
client = next(iter(_clients.values()))
if sys.argv[1] == "cold":
    client.tuner.wait(600)
print(json.dumps({"kinds": kinds, "first_s": first, "counters": client.counters.snapshot()}))
"""


def _run(tmp_path: Path, phase: str, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_")}
    fresh = tmp_path / f"caches-{phase}"
    env.update(KILN_FARM="inprocess", KILN_STORE=str(tmp_path / "store"),
               KILN_LOCAL_CACHE="off", XDG_CACHE_HOME=str(fresh / "xdg"),
               KILN_CACHE_DIR=str(fresh / "kiln"), TRITON_CACHE_DIR=str(fresh / "triton"),
               **extra)
    proc = subprocess.run([sys.executable, "-c", RUN, phase], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_new_machine_warm_start_needs_no_c_compiler_and_uses_the_static_launcher(
        tmp_path: Path) -> None:
    import torch

    cold = _run(tmp_path, "cold")
    assert cold["counters"]["compiles_local"] >= 1
    # A new machine: only the store; a C compiler that fails if anything calls it.
    warm = _run(tmp_path, "warm", CC="/bin/false", CXX="/bin/false")
    assert warm["counters"].get("compiles", 0) == 0 and warm["counters"]["hits"] >= 1
    triton_kinds = [k for k in warm["kinds"] if k != "CppLauncher"]
    assert triton_kinds, warm
    if hasattr(torch._C, "_StaticCudaLauncher"):
        assert set(triton_kinds) == {"StaticCudaKernel"}, warm["kinds"]
    # Autotuning ran after the first output, on this GPU, and its artifact superseded
    # the heuristic one: the warm process hit an autotuned graph.
    assert cold["counters"].get("autotune_publishes", 0) >= 1, cold
    assert warm["counters"].get("hits_autotuned", 0) >= 1, warm
