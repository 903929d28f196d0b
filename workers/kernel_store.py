"""Kernel binaries shared through the artifact store, by content key: a kernel compiled
for one graph or model is found by any other graph, model, process or machine that needs
the same kernel (source, config, target, compiler versions), not only by the farm that
happens to remember it.

    key = sha256(msgpack([KERNEL_SCHEMA, job.key, versions()]))
    manifest {"kind": "kernel", "job": job.key, "binary": <KernelBinary without bytes>}
    blob     "kernel.bin": the binary

Lookups are counted as ``kernel_hits`` / ``kernel_misses`` (not graph hits). What comes
back is checked as any store read is (signature, digest), then against the job: a
manifest for another job or kernel, or a binary for another target, is a miss.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any

import msgpack

from kiln.artifact_store import Artifact, Store
from kiln.compiler.kernel_compile import KernelBinary
from kiln.compiler.versions import versions

from .pipeline import KernelJob

log = logging.getLogger("kiln.kernel_store")

KERNEL_SCHEMA = "kiln-kernel/1"
BINARY_BLOB = "kernel.bin"


def kernel_store_key(job: KernelJob) -> str:
    wire = [KERNEL_SCHEMA, job.key, sorted(versions().items())]
    return hashlib.sha256(msgpack.packb(wire, use_bin_type=True)).hexdigest()


class KernelStore:
    """Get and put single kernel binaries in a store (see the module docstring)."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def get(self, job: KernelJob) -> KernelBinary | None:
        artifact = self.store.get(kernel_store_key(job), kind="kernel")
        if artifact is None:
            return None
        try:
            return self._binary(job, artifact)
        except (KeyError, TypeError, ValueError) as e:
            log.warning("kiln: stored kernel %s for %s cannot be used (%s); compiling it",
                        artifact.key[:16], job.spec.name, e)
            return None

    @staticmethod
    def _binary(job: KernelJob, artifact: Artifact) -> KernelBinary:
        manifest = artifact.manifest
        if manifest.get("kind") != "kernel" or manifest.get("job") != job.key:
            raise ValueError("the manifest is for another kernel job")
        record: dict[str, Any] = dict(manifest["binary"])
        record["binary"] = artifact.blobs[BINARY_BLOB]
        binary = KernelBinary.from_dict(record)
        if binary.name != job.spec.name or binary.target != job.target or \
                binary.config != job.config:
            raise ValueError("the binary is for another kernel, config or target")
        return binary

    def put(self, job: KernelJob, binary: KernelBinary) -> bool:
        record = binary.to_dict()
        data = record.pop("binary")
        manifest = {"kind": "kernel", "job": job.key, "binary": record}
        return self.store.publish(Artifact(kernel_store_key(job), manifest,
                                           {BINARY_BLOB: bytes(data)}))
