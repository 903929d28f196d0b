"""Ranks of one job: torchrun with gloo ranks on the CPU.

- A DDP-wrapped model compiled by Kiln (tests/ddp_child.py, 4 ranks): DDP's split graphs
  compile once across the ranks (claims in the shared store; compiles summed over ranks
  from the stats file), every rank computes the same keys (the rank is in no key), and
  outputs and gradients equal eager DDP's.
- A tensor-parallel MLP (tests/tp_child.py, 2 ranks, ``parallelize_module``): its graphs,
  which take the device mesh and all-reduce inside, compile with no eager fallback, once
  across the ranks, and outputs and gradient shards equal eager's."""

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


def run_ranks(tmp_path: Path, child: str, ranks: int) -> tuple[list[dict], set[str]]:
    """torchrun ``child`` over ``ranks`` gloo ranks sharing a store; each rank's keys and
    counters, and the keys in the store."""
    out = tmp_path / "ranks"
    out.mkdir()
    env = fleet_env(tmp_path, KILN_CLAIM_TTL="10")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
         "--master_addr=127.0.0.1", f"--master_port={free_port()}",
         str(ROOT / "tests" / child), str(out)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    done = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
    return done, graph_keys(tmp_path / "store")


def test_ddp_graphs_compile_once_across_ranks(tmp_path: Path) -> None:
    ranks, keys = run_ranks(tmp_path, "ddp_child.py", RANKS)
    per_rank = ranks[0]["keys"]
    assert len(per_rank) >= 4, per_rank  # split graphs: forward and backward of several
    assert all(r["keys"] == per_rank for r in ranks), "a key differs between ranks"
    assert keys == set(per_rank)
    data = json.loads((tmp_path / "stats.json").read_text())
    assert data["client"]["compiles"] == len(keys), data["client"]
    assert sum(r["counters"].get("compiles", 0) for r in ranks) == len(keys)
    assert data["client"]["graphs"] == RANKS * len(per_rank)
    assert "RANK" not in os.environ  # the test itself runs outside torchrun


def test_tensor_parallel_graphs_compile_once_across_ranks(tmp_path: Path) -> None:
    ranks, keys = run_ranks(tmp_path, "tp_child.py", 2)
    per_rank = ranks[0]["keys"]
    assert len(per_rank) == 2, per_rank  # the forward and the backward
    assert ranks[1]["keys"] == per_rank, "a key differs between ranks"
    assert keys == set(per_rank)
    assert sum(r["counters"].get("compiles", 0) for r in ranks) == len(keys)
