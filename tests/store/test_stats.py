"""Counters per tier: in process (`stats()`), and summed over processes in a JSON file
that `kiln stats --json` reads (`read_stats()`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from store_helpers import ROOT, make_artifact

from kiln.artifact_store import open_store, read_stats, summarize
from kiln.artifact_store.stats import latency_quantile, merge_counters, new_histogram, observe

CHILD = """
import sys
from kiln.artifact_store import Artifact, open_store
store = open_store(sys.argv[1])
store.publish(Artifact("b" * 64, {"child": True}, {"x": b"child blob"}))
assert store.get("b" * 64) is not None
assert store.get("c" * 64) is None
# no close(): the counters are flushed at exit
"""


def test_counters_in_process(tmp_path: Path) -> None:
    store = open_store(f"memory://kiln-{uuid.uuid4().hex}", local_cache=tmp_path / "cache")
    artifact = make_artifact()
    assert store.get(artifact.key) is None
    assert store.publish(artifact)
    assert store.get(artifact.key) is not None
    assert store.get_manifest(artifact.key) is not None
    stats = store.stats()
    assert (stats["hits"], stats["misses"], stats["publishes"]) == (1, 1, 1)
    local, remote = stats["tiers"]["local"], stats["tiers"]["remote"]
    assert (local["hits"], local["misses"], local["manifest_hits"]) == (1, 1, 1)
    assert (remote["hits"], remote["misses"]) == (0, 1)
    assert local["bytes_read"] == artifact.nbytes
    assert local["writes"] == remote["writes"] == 1
    assert local["latency"]["get"]["count"] == 2
    assert local["latency"]["manifest"]["count"] == 1
    assert stats["url"].startswith("memory://")
    json.dumps(stats)  # a plain dict: JSON as is


def test_counters_persist_and_add_up_across_processes(tmp_path: Path, clean_env: Path) -> None:
    store_url = str(tmp_path / "store")
    store = open_store(store_url)
    assert store.publish(make_artifact())
    assert store.get("a" * 64) is not None
    store.close()
    path = clean_env / "kiln" / "stats.json"
    assert read_stats()["store"]["hits"] == 1 == read_stats(str(path))["store"]["hits"]

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-c", CHILD, store_url], env=env, check=True)
    counters = read_stats()["store"]
    assert (counters["hits"], counters["misses"], counters["publishes"]) == (2, 1, 2)
    assert counters["tiers"]["local"]["latency"]["get"]["count"] == 3
    summary = summarize(counters)
    assert summary["hit_rate"] == 2 / 3
    assert summary["tiers"]["local"]["latency"]["get"]["p50_ms"] is not None


def test_unreadable_stats_file_starts_afresh(tmp_path: Path, clean_env: Path) -> None:
    path = clean_env / "kiln" / "stats.json"
    path.parent.mkdir(parents=True)
    path.write_text("{ torn")
    store = open_store(tmp_path / "store")
    assert store.get("a" * 64) is None
    assert store.flush_stats()
    assert read_stats()["store"]["misses"] == 1


def test_stats_can_be_turned_off(tmp_path: Path, clean_env: Path) -> None:
    store = open_store(tmp_path / "store", stats_file=False)
    assert store.get("a" * 64) is None
    store.close()
    assert not (clean_env / "kiln" / "stats.json").exists()
    assert read_stats() == {}


def test_merge_and_quantiles() -> None:
    a = {"hits": 1, "since": 10.0, "tiers": {"local": {"max_ms": 3.0, "errors": {}}}}
    b = {"hits": 2, "since": 5.0, "tiers": {"local": {"max_ms": 1.0, "errors": {"down": 1}}}}
    assert merge_counters(a, b) == {
        "hits": 3, "since": 5.0, "tiers": {"local": {"max_ms": 3.0, "errors": {"down": 1}}}}
    histogram = new_histogram()
    for ms in (0.05, 0.2, 0.2, 0.7, 30.0):
        observe(histogram, ms / 1000)
    # Linear within the bucket holding the rank: 1 value below 0.1, 2 in (0.1, 0.25].
    assert latency_quantile(histogram, 0.5) == pytest.approx(0.1 + 0.15 * 0.75)
    assert latency_quantile(histogram, 1.0) == 30.0  # the largest seen, not the bucket's 50
    assert latency_quantile(new_histogram(), 0.5) is None
    # p50 is never above max (a single 0.3 ms lookup used to report p50 0.5 ms, max 0.3).
    single = new_histogram()
    observe(single, 0.3 / 1000)
    p50, p99 = latency_quantile(single, 0.5), latency_quantile(single, 0.99)
    assert p50 is not None and p99 is not None
    assert 0.25 <= p50 <= p99 <= single["max_ms"] == pytest.approx(0.3)
