"""GPU autotuning of graphs precompiled where no GPU of the target could time them.

``kiln precompile --gpu h200`` cross-compiles each kernel with heuristic configs. Where
a kernel has several candidate configs, timing them needs the target GPU:

- with a farm up whose GPU autotuners fit the target, the farm tunes in the background
  and publishes the tuned artifact under the same key (the precompile waits for it at
  exit, ``KILN_AUTOTUNE_EXIT_WAIT``);
- otherwise the precompile puts the key in the store's ``autotune`` queue
  (``queue/autotune/<key>``: an empty marker, see ``Store.enqueue``). A GPU host drains
  it with ``kiln precompile --gpu-worker``: for each queued key whose target is this
  GPU's arch and whose versions are this host's, it fetches and verifies the artifact,
  compiles and times every candidate here (``autotune_inprocess``), publishes the tuned
  artifact under the same key (``autotuned: true``) and removes the marker. Keys for
  another arch or other versions stay queued for a worker that fits them.

Clients pick the tuned artifact up on their next lookup, as with background tuning.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

QUEUE = "autotune"


def queue_for_gpu(store: Any, key: str, compiled: Any, target: dict[str, Any]) -> bool:
    """Queue ``key`` for a GPU worker if its graph has kernels with candidates to time
    and was not tuned; True if queued."""
    from kiln.workers.pipeline import tunable

    if target.get("kind") != "cuda" or compiled.autotuned or not tunable(compiled, target):
        return False
    return bool(store.enqueue(QUEUE, key))


@dataclass
class TuneRecord:
    key: str
    status: str  # tuned, untuned, gone, skipped, failed
    detail: str = ""
    kernels_timed: int = 0
    seconds: float = 0.0


def drain(client: Any, arch: int | None, *, limit: int | None = None) -> list[TuneRecord]:
    """Tune what the queue holds for this GPU (``arch``; None: the tests' fake timing
    stands in for any arch) and publish it."""
    records = []
    for key in client.store.queued(QUEUE)[:limit]:
        start = time.perf_counter()
        record = _tune_one(client, key, arch)
        record.seconds = round(time.perf_counter() - start, 3)
        if record.status in ("tuned", "untuned", "gone"):
            client.store.dequeue(QUEUE, key)
        records.append(record)
    return records


def _tune_one(client: Any, key: str, arch: int | None) -> TuneRecord:
    from kiln.compiler.versions import versions
    from kiln.workers.artifact import from_artifact, superseding
    from kiln.workers.pipeline import autotune_inprocess

    artifact = client.store.get(key)  # verified: signature, digests
    if artifact is None:
        return TuneRecord(key, "gone", "not in the store (or refused)")
    manifest = artifact.manifest
    target = manifest.get("target") or {}
    if manifest.get("graph", {}).get("autotuned"):
        return TuneRecord(key, "untuned", "already tuned")
    if arch is not None and int(target.get("arch", -1)) != arch:
        return TuneRecord(key, "skipped", f"for sm_{target.get('arch')}, this GPU is "
                          f"sm_{arch}")
    if manifest.get("versions") != versions():
        return TuneRecord(key, "skipped", "keyed for other versions than this host's: "
                          f"{json.dumps(manifest.get('versions'), sort_keys=True)}")
    try:
        heuristic = from_artifact(artifact)
        tuned = autotune_inprocess(heuristic, target, client.local.kernels,
                                   beside_program=False)
    except Exception as e:  # one graph's failure leaves it queued; the next goes on
        return TuneRecord(key, "failed", f"{type(e).__name__}: {e}")
    if not tuned.autotuned:
        return TuneRecord(key, "untuned", "no kernel has candidates to time")
    info = {**manifest.get("compile", {}), "autotune": "done", "autotuned_by": "gpu-worker"}
    if not client.store.publish(superseding(artifact, tuned, info)):
        return TuneRecord(key, "failed", "the store refused the tuned artifact")
    timed = len(tuned.stats.get("autotune", {}))
    return TuneRecord(key, "tuned", kernels_timed=timed)


def cmd_gpu_worker(args: argparse.Namespace) -> int:
    """``kiln precompile --gpu-worker``: drain the store's autotune queue on this GPU."""
    from kiln.frontend.cli.errors import EXIT_FAILED, EXIT_OK, UsageError
    from kiln.frontend.config import KilnConfig
    from kiln.frontend.core.client import client_for
    from kiln.workers.autotune import fake_autotune, gpu_arch

    config = KilnConfig.resolve(dict(args.option or []))
    client = client_for(config)
    if not client.store.can_publish:
        raise UsageError(f"--gpu-worker publishes tuned artifacts: the store "
                         f"{client.store.url} is read-only or needs a signing key here")
    arch = gpu_arch()
    if arch is None and not fake_autotune():
        raise UsageError("--gpu-worker times kernels on this host's GPU: none is visible")
    records = drain(client, arch, limit=args.limit)
    counts = {s: sum(r.status == s for r in records)
              for s in ("tuned", "untuned", "gone", "skipped", "failed")}
    if args.json:
        print(json.dumps({"queued": len(records), **counts,
                          "left": len(client.store.queued(QUEUE)),
                          "records": [asdict(r) for r in records]}, sort_keys=True))
    else:
        for r in records:
            print(f"  {r.key[:16]} {r.status:<8} {r.detail}")
        print(f"autotune queue: {len(records)} graphs, " + ", ".join(
            f"{n} {s}" for s, n in counts.items()))
    return EXIT_FAILED if counts["failed"] else EXIT_OK
