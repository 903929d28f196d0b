"""Artifact store benchmark (not a test).

Measures, on this machine:
1. manifest hit latency from the local tier, for a manifest naming 50 kernels
   (`get_manifest`, signature checked; target: median under 2 ms);
2. `get` of that 50-kernel artifact from the local tier (every blob read and hashed);
3. `get` of a 10 MiB artifact (10 blobs of 1 MiB) from the local tier and from an S3 API
   server (moto, started here as a separate process on loopback), with throughput;
4. `publish` of the 10 MiB artifact to the S3 server.

    .venv/bin/python bench/store_bench.py [--repeat N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln.artifact_store import Artifact, Store, open_store  # noqa: E402

SIGNING_KEY = "hmac:bench-farm-key"
MIB = 2**20


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def moto_server() -> Iterator[str]:
    """A moto S3 server in its own process (so it does not share the client's GIL)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto server did not start") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def s3_options(endpoint: str) -> dict[str, Any]:
    return {"key": "bench", "secret": "bench",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def kernels_artifact(n: int = 50) -> Artifact:
    """A graph of n kernels: wrapper, and per kernel a source and a ~16 KiB binary."""
    blobs = {"wrapper.py": b"def call(args):\n" + b"    pass\n" * 400}
    kernels = []
    for i in range(n):
        name = f"triton_poi_fused_add_mul_{i}"
        blobs[f"kernels/{name}.py"] = f"@triton.jit\ndef {name}(in_ptr0, out_ptr0):\n".encode() * 20
        blobs[f"kernels/{name}.cubin"] = os.urandom(16 * 1024)
        kernels.append({"name": name, "grid": [128, 1, 1], "num_warps": 4, "num_stages": 2,
                        "shared_mem": 0, "config": {"XBLOCK": 1024}})
    manifest = {"target": {"backend": "cuda", "arch": 90, "warp_size": 32},
                "versions": {"kiln": "0.1.0", "torch": "2.11", "triton": "3.6"},
                "kernels": kernels, "timings": {"lowering": 0.12, "codegen": 0.3}}
    return Artifact("b" * 64, manifest, blobs)


def big_artifact() -> Artifact:
    blobs = {f"kernels/k{i}.cubin": os.urandom(MIB) for i in range(10)}
    return Artifact("c" * 64, {"target": "cuda:90"}, blobs)


def timed(fn: Callable[[], Any], repeat: int) -> list[float]:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        samples.append(time.perf_counter() - start)
        assert result is not None and result is not False
    return samples


def summary(samples: list[float], nbytes: int = 0) -> dict[str, float]:
    ordered = sorted(samples)
    out = {
        "n": len(samples),
        "median_ms": statistics.median(ordered) * 1e3,
        "p90_ms": ordered[int(0.9 * (len(ordered) - 1))] * 1e3,
        "min_ms": ordered[0] * 1e3,
    }
    if nbytes:
        out["throughput_MBps"] = nbytes / statistics.median(ordered) / 1e6
    return out


def run(repeat: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp, moto_server() as endpoint:
        import boto3

        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="bench",
                     aws_secret_access_key="bench",
                     region_name="us-east-1").create_bucket(Bucket="bench")
        url = f"s3://bench/{uuid.uuid4().hex}"
        options = s3_options(endpoint)
        store: Store = open_store(url, storage_options=options, local_cache=Path(tmp, "cache"),
                                  signing_key=SIGNING_KEY, stats_file=False)
        remote_only = open_store(url, storage_options=options, local_cache=False,
                                 signing_key=SIGNING_KEY, stats_file=False)
        kernels, big = kernels_artifact(), big_artifact()
        assert store.publish(kernels) and store.publish(big)

        store.get_manifest(kernels.key)  # warm
        results["manifest_hit_local_50_kernels"] = summary(
            timed(lambda: store.get_manifest(kernels.key), repeat * 20))
        results["get_local_50_kernels"] = summary(
            timed(lambda: store.get(kernels.key), repeat * 5), kernels.nbytes)
        results["get_local_10MiB"] = summary(
            timed(lambda: store.get(big.key), repeat), big.nbytes)
        remote_only.get(big.key)  # warm the connection pool
        results["get_s3_10MiB"] = summary(
            timed(lambda: remote_only.get(big.key), repeat), big.nbytes)
        results["get_s3_50_kernels"] = summary(
            timed(lambda: remote_only.get(kernels.key), repeat), kernels.nbytes)

        # Baseline: the same objects fetched by s3fs alone (concurrent, no verification).
        assert remote_only.primary is not None
        io = remote_only.primary.io
        for name, artifact in (("10MiB", big), ("50_kernels", kernels)):
            described = remote_only.describe(artifact.key) or {}
            paths = sorted({io.blob_path(b["digest"]) for b in described["blobs"].values()})
            results[f"raw_s3fs_cat_{name}"] = summary(
                timed(lambda paths=paths: io.fs.cat(paths), repeat), artifact.nbytes)

        def publish_fresh() -> bool:
            blobs = {f"kernels/k{i}.cubin": os.urandom(MIB) for i in range(10)}
            return remote_only.publish(Artifact(uuid.uuid4().hex, {}, blobs))

        results["publish_s3_10MiB"] = summary(timed(publish_fresh, repeat), big.nbytes)
        manifest = io.read(io.manifest_path(kernels.key)) or b""
        results["sizes"] = {"manifest_50_kernels_bytes": len(manifest),
                            "artifact_50_kernels_bytes": kernels.nbytes,
                            "artifact_big_bytes": big.nbytes}
    results["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                          "platform": platform.platform(), "load_avg": os.getloadavg()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=20, help="samples of the slow cases")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    results = run(args.repeat)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(f"{'case':34} {'n':>5} {'median ms':>10} {'p90 ms':>9} {'min ms':>9} {'MB/s':>9}")
    for name, row in results.items():
        if "median_ms" not in row:
            continue
        rate = f"{row['throughput_MBps']:9.0f}" if "throughput_MBps" in row else " " * 9
        print(f"{name:34} {row['n']:5d} {row['median_ms']:10.3f} {row['p90_ms']:9.3f} "
              f"{row['min_ms']:9.3f} {rate}")
    print(json.dumps({"sizes": results["sizes"], "machine": results["machine"]}))


if __name__ == "__main__":
    main()
