"""Helpers shared by the store tests (a module of its own: test files import it)."""

from __future__ import annotations

import logging
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the tests run from a checkout, installed or not
    sys.path.insert(0, str(ROOT))

from kiln.artifact_store import Artifact  # noqa: E402

BUCKET = "kiln-test"
STORE_LOGGER = "kiln.artifact_store"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def moto_server(bucket: str = BUCKET) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 with ``bucket`` made; yields its endpoint URL."""
    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1",
                     ).create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()


def s3_options(endpoint: str) -> dict[str, Any]:
    """s3fs storage options for the test server (explicit keys: no AWS env needed)."""
    return {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"},
    }


def make_artifact(key: str = "a" * 64, *, kernels: int = 3, size: int = 256,
                  seed: str = "") -> Artifact:
    """An artifact with a wrapper and `kernels` kernel binaries of `size` bytes."""
    blobs = {"wrapper.py": f"# wrapper {key} {seed}\ndef call(args): pass\n".encode()}
    for i in range(kernels):
        body = f"{seed}:{key}:{i}:".encode()
        blobs[f"kernels/triton_poi_fused_add_{i}.cubin"] = (body * (size // len(body) + 1))[:size]
    manifest = {
        "target": {"backend": "cuda", "arch": 90, "warp_size": 32},
        "versions": {"kiln": "0.1.0", "torch": "2.11"},
        "kernels": [{"name": f"triton_poi_fused_add_{i}", "grid": [i + 1, 1, 1]}
                    for i in range(kernels)],
        "timings": {"lowering": 0.25, "codegen": 0.5},
        "seed": seed,
    }
    return Artifact(key=key, manifest=manifest, blobs=blobs)


def store_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name.startswith(STORE_LOGGER) and r.levelno >= logging.WARNING]


def round_artifact(key: str, writer: int, round_: int) -> Artifact:
    """What `writer` publishes under `key` in round `round_`: blobs and metadata that
    identify each other, so a mix of two writers' objects cannot pass for an artifact."""
    seed = f"{writer}/{round_}"
    size = 200 + 97 * ((writer * 31 + round_) % 50)  # writers differ in sizes too
    artifact = make_artifact(key, kernels=3, size=size, seed=seed)
    manifest = dict(artifact.manifest, writer=writer, round=round_)
    return Artifact(key, manifest, artifact.blobs)


def concurrency_worker(
    url: str, options: dict[str, Any], writer: int, rounds: int, keys: list[str],
    signing_key: str | None,
) -> dict[str, Any]:
    """Publish and read `keys` (shared with other workers) for `rounds` rounds; report
    what came back. Runs in a spawned process."""
    from kiln.artifact_store import open_store

    store = open_store(url, storage_options=options, local_cache=False,
                       signing_key=signing_key, stats_file=False)
    report: dict[str, Any] = {"hits": 0, "misses": 0, "bad": [], "publish_failed": 0}
    for round_ in range(rounds):
        for key in keys:
            if not store.publish(round_artifact(key, writer, round_)):
                report["publish_failed"] += 1
        for key in keys:
            got = store.get(key)
            if got is None:
                report["misses"] += 1
                continue
            report["hits"] += 1
            expected = round_artifact(key, got.manifest["writer"], got.manifest["round"])
            if got.blobs != expected.blobs or got.manifest != expected.manifest:
                report["bad"].append((key, got.manifest["writer"], got.manifest["round"]))
    stats = store.stats()
    report["integrity_failures"] = stats["integrity_failures"]
    report["signature_failures"] = stats["signature_failures"]
    return report


def reader_worker(url: str, options: dict[str, Any], keys: list[str], seconds: float,
                  signing_key: str | None) -> dict[str, Any]:
    """Read `keys` in a tight loop while writers publish them: for `seconds` after the
    first hit (writers may start later than this reader), at most a minute in all."""
    import time

    from kiln.artifact_store import open_store

    store = open_store(url, storage_options=options, local_cache=False,
                       signing_key=signing_key, stats_file=False, read_only=True)
    report: dict[str, Any] = {"hits": 0, "misses": 0, "bad": []}
    start = time.monotonic()
    stop = start + 60.0
    while time.monotonic() < stop:
        for key in keys:
            got = store.get(key)
            if got is None:
                report["misses"] += 1
                continue
            if not report["hits"]:
                stop = min(stop, time.monotonic() + seconds)
            report["hits"] += 1
            expected = round_artifact(key, got.manifest["writer"], got.manifest["round"])
            if got.blobs != expected.blobs:
                report["bad"].append(key)
    report["integrity_failures"] = store.stats()["integrity_failures"]
    return report
