"""Ranks of one job: torchrun with 4 gloo ranks on the CPU, a DDP-wrapped model compiled
by Kiln (tests/ddp_child.py). DDP's split graphs compile once across the ranks (claims in
the shared store; compiles summed over ranks from the stats file), every rank computes
the same keys (the rank is in no key), and outputs and gradients equal eager DDP's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.compiler.runtime.kernel_files import interpreter_active
from tests.fleet_helpers import fleet_env, graph_keys

ROOT = Path(__file__).resolve().parents[2]
RANKS = 4

pytestmark = pytest.mark.skipif(interpreter_active(), reason="C++ CPU kernels")


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_ddp_graphs_compile_once_across_ranks(tmp_path: Path) -> None:
    out = tmp_path / "ranks"
    out.mkdir()
    env = fleet_env(tmp_path, KILN_CLAIM_TTL="10")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={RANKS}",
         "--master_addr=127.0.0.1", f"--master_port={free_port()}",
         str(ROOT / "tests" / "ddp_child.py"), str(out)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(RANKS)]
    per_rank = ranks[0]["keys"]
    assert len(per_rank) >= 4, per_rank  # split graphs: forward and backward of several
    assert all(r["keys"] == per_rank for r in ranks), "a key differs between ranks"
    keys = graph_keys(tmp_path / "store")
    assert keys == set(per_rank)
    data = json.loads((tmp_path / "stats.json").read_text())
    assert data["client"]["compiles"] == len(keys), data["client"]
    assert sum(r["counters"].get("compiles", 0) for r in ranks) == len(keys)
    assert data["client"]["graphs"] == RANKS * len(per_rank)
    assert "RANK" not in os.environ  # the test itself runs outside torchrun
