"""Many writers and readers of the same keys at once, in separate processes (spawn):
every read is a whole, verified artifact of one writer, or a miss."""

from __future__ import annotations

import multiprocessing
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest
from store_helpers import concurrency_worker, reader_worker, round_artifact

from kiln.artifact_store import open_store

SHARED = ["5" * 64, "6" * 64]
KEY = "farm-secret"


def own_key(writer: int) -> str:
    return f"{writer:02d}" * 32


def run_processes(url: str, options: dict[str, Any], writers: int, rounds: int) -> None:
    context = multiprocessing.get_context("spawn")
    with context.Pool(writers + 1) as pool:
        reader = pool.apply_async(
            reader_worker, (url, options, SHARED + [own_key(0)], 1.0, f"hmac:{KEY}"))
        jobs = [
            pool.apply_async(concurrency_worker,
                             (url, options, w, rounds, SHARED + [own_key(w)], f"hmac:{KEY}"))
            for w in range(writers)
        ]
        reports = [job.get(timeout=90) for job in jobs]
        read_report = reader.get(timeout=90)
    for report in reports:
        assert report["bad"] == [] and report["publish_failed"] == 0
        assert report["integrity_failures"] == 0 and report["signature_failures"] == 0
        # Each writer reads its own keys after publishing them: always a hit.
        assert report["misses"] == 0 and report["hits"] == rounds * 3
    assert read_report["bad"] == [] and read_report["integrity_failures"] == 0
    assert read_report["hits"] > 0

    store = open_store(url, storage_options=options, local_cache=False,
                       signing_key=f"hmac:{KEY}")
    for key in SHARED:
        got = store.get(key)
        assert got is not None
        assert got.manifest["round"] == rounds - 1  # the last round of some writer
        assert got == round_artifact(key, got.manifest["writer"], rounds - 1)
    for writer in range(writers):
        assert store.get(own_key(writer)) == round_artifact(own_key(writer), writer, rounds - 1)


def test_processes_on_local_files(tmp_path: Path) -> None:
    root = tmp_path / "store"
    run_processes(f"file://{root}", {}, writers=3, rounds=15)
    assert not list(root.rglob("*.tmp-*")), "temporary files left behind"


def test_processes_on_s3(s3_store: tuple[str, dict[str, Any]]) -> None:
    url, options = s3_store
    run_processes(url, options, writers=3, rounds=4)


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_threads_share_one_store(kind: str, tmp_path: Path) -> None:
    url = f"memory://kiln-{uuid.uuid4().hex}" if kind == "memory" else f"file://{tmp_path}/s"
    store = open_store(url, local_cache=False, signing_key=f"hmac:{KEY}")
    bad: list[Any] = []

    def work(writer: int) -> None:
        for round_ in range(30):
            for key in SHARED:
                assert store.publish(round_artifact(key, writer, round_))
                got = store.get(key)
                if got is None or got != round_artifact(
                        key, got.manifest["writer"], got.manifest["round"]):
                    bad.append((writer, round_, got))

    threads = [threading.Thread(target=work, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert bad == []
    assert store.stats()["integrity_failures"] == 0
