"""Remote cache hits in CI: a second runner, fresh but for the store, runs the same job with
no compile, no AOTAutograd trace and the same Dynamo graphs as the first. The job
(bench/ci_job.py) compiles several models in one process, one of them a training step
whose ``loss.backward()`` is inside the compiled function (a served backward Dynamo must
not trace into); runner B reads only, from a folder and from an S3 API server (moto, on
loopback; signed by A, B holding the public key)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from store_helpers import BUCKET

from bench.ci_cache import fresh_env, kiln_store, run_runner

# The models (its MLP as a training step), BatchNorm in train mode, a graph break
# in training steps and a model called at two batch sizes (its second size makes a graph
# with symbolic sizes): every kind of graph the AOT cache serves.
MODELS = "conv_bn_eval,encoder_eval,train_mlp,train_conv_bn,train_graph_break,two_batches"


def run(folder: Path, settings: dict[str, str]) -> dict[str, Any]:
    env = fresh_env(folder)
    env.update(settings, KILN_FARM="inprocess", KILN_SUMMARY="1")
    result = run_runner(env, ["--backend", "kiln", "--models", MODELS], timeout=300)
    assert "error" not in result, result.get("error")
    assert result["errors"] == {}, result["errors"]  # outputs, gradients, buffers vs eager
    assert result["fallback_warnings"] == []
    assert result["dynamo_warnings"] == [], json.dumps(result["dynamo_warnings"], indent=1)
    return result


def check_runners(tmp_path: Path, store: dict[str, dict[str, str]]) -> None:
    a = run(tmp_path / "A", store["builder"])
    b = run(tmp_path / "B", store["reader"])
    assert a["compiles"] > 0 and a["aot_traces"] > 0  # A really was cold
    assert a["aot_traces"] + a["aot_hits"] == a["graphs"]  # (graphs alike hit in A too)
    assert b["compiles"] == 0, b
    assert b["aot_traces"] == 0, b
    assert b["graphs"] == a["graphs"], (a["graphs"], b["graphs"])
    assert b["aot_hits"] == b["graphs"]  # every Dynamo graph served by the AOT cache
    assert b["bytes_fetched"] > 0
    assert "0 traced" in b["exit_summary"] and " 0 compiled" in b["exit_summary"], b


def test_second_runner_hits_everything_folder(tmp_path: Path) -> None:
    check_runners(tmp_path, kiln_store("kiln-folder", tmp_path, None))


def test_second_runner_hits_everything_s3(tmp_path: Path, s3_server: str) -> None:
    pytest.importorskip("cryptography")
    check_runners(tmp_path, kiln_store("kiln-s3", tmp_path, s3_server, BUCKET))
