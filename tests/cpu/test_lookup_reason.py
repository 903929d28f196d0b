"""A graph that was compiled although the store had (or should have had) its artifact says
why its lookup missed: the bench's warm rows and KILN_DEBUG's key.json report it, so that
an intermittent warm-start miss on the GPU host names its cause (2026-12-04)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kiln.artifact_store import open_store
from kiln.compiler.decompositions import trace_aten
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.client import KilnClient
from kiln.frontend.core.serialize import make_request
from kiln.frontend.transports.inprocess import InProcessFarm


def model(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return ((a + b) * b.relu()).sum(dim=-1)


def client(root: Path) -> KilnClient:
    store = open_store(root, local_cache=False, stats_file=False)
    return KilnClient(KilnConfig.resolve(), store=store, farm=InProcessFarm())


def test_a_miss_says_whether_the_artifact_was_missing_or_damaged(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_STATS_FILE", "off")
    args = [torch.randn(4, 8), torch.randn(4, 8)]
    request = make_request(trace_aten(model, args), args, options={}, target={"kind": "cpu"})
    root = tmp_path / "store"
    first = client(root).compile(request, "graph")
    assert (first.source, first.lookup) == ("local", "missing")
    again = client(root).compile(request, "graph")
    assert (again.source, again.lookup) == ("hit", "found")
    # damage the wrapper blob the graph's manifest names
    store = open_store(root, local_cache=False, stats_file=False)
    artifact = store.get(first.key.key)
    assert artifact is not None
    from kiln.artifact_store.cas import sha256_hex

    digest = sha256_hex(artifact.blobs["wrapper.py"])
    (blob,) = [p for p in (root / "cas").rglob(digest) if p.is_file()]
    blob.write_bytes(b"tampered")
    damaged = client(root).compile(request, "graph")
    assert damaged.source == "local"
    assert damaged.lookup.startswith("damaged: ") and "wrapper.py" in damaged.lookup, \
        damaged.lookup
    from kiln.compiler.compiled_graph import load

    fresh = [torch.randn(4, 8), torch.randn(4, 8)]  # the graph compiled again computes it
    got = load(damaged.compiled, {}, torch.device("cpu"))(list(fresh))
    torch.testing.assert_close(got[0], model(*fresh), rtol=1e-5, atol=1e-5)
