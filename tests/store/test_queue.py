"""Work queues in the store (queue/<name>/<key>): the GPU autotune queue that a CPU-only
precompile fills and a GPU worker drains, on every backend."""

from __future__ import annotations

from typing import Any

import pytest
from store_helpers import make_artifact

from kiln.artifact_store import open_store


def test_enqueue_list_dequeue(backend: tuple[str, dict[str, Any]]) -> None:
    url, options = backend
    store = open_store(url, storage_options=options, local_cache=False)
    keys = [make_artifact(kernels=1).key, "ab" * 32, "cd" * 32]
    assert store.queued("autotune") == []
    for key in keys:
        assert store.enqueue("autotune", key) is True
    assert store.enqueue("autotune", keys[0]) is True  # idempotent: one marker per key
    assert sorted(store.queued("autotune")) == sorted(keys)
    assert store.queued("other") == []
    store.dequeue("autotune", keys[1])
    store.dequeue("autotune", keys[1])  # already gone: nothing
    assert sorted(store.queued("autotune")) == sorted([keys[0], keys[2]])
    assert store.keys() == []  # markers are not artifacts


def test_queue_refuses_bad_names_and_read_only(tmp_path: Any) -> None:
    store = open_store(f"file://{tmp_path}/store", local_cache=False)
    with pytest.raises(ValueError, match="invalid artifact key"):
        store.enqueue("autotune", "../escape")
    reader = open_store(f"file://{tmp_path}/store", local_cache=False, read_only=True)
    assert reader.enqueue("autotune", "ab" * 32) is False
    (tmp_path / "store" / "queue" / "autotune").mkdir(parents=True)
    (tmp_path / "store" / "queue" / "autotune" / "not a key!").write_bytes(b"")
    assert reader.queued("autotune") == []
