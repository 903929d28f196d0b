"""`kiln inspect` of store entries that are not a compiled graph: AOT cache entries,
region plans, kernels shared by content key, max-autotune choices, and kinds a newer Kiln
may write. Each is a few lines in words, never a graph's fields printed as null."""

from __future__ import annotations

import json
from typing import Any


def _aot(manifest: dict[str, Any]) -> list[str]:
    if manifest.get("serve"):
        plan = " (a region plan)" if manifest.get("regions") else ""
        return [f"AOT cache entry of a Dynamo graph: serves graph {manifest.get('graph')}{plan}"]
    return [f"AOT cache entry of a Dynamo graph: traced, not served "
            f"({manifest.get('reason') or 'no reason recorded'})"]


def _regions(manifest: dict[str, Any]) -> list[str]:
    regions = (manifest.get("plan") or {}).get("regions") or []
    distinct = {r.get("key") for r in regions if isinstance(r, dict)}
    wall = (manifest.get("compile") or {}).get("wall_s", 0)
    lines = [f"region plan of a graph cut into {len(regions)} regions ({len(distinct)} "
             f"distinct), compiled in {float(wall or 0):.2f} s",
             f"target       {json.dumps(manifest.get('target'), sort_keys=True)}",
             "regions (each an artifact of its own):"]
    lines += [f"  {i:>3}  {r.get('key')}  {r.get('label') or ''}".rstrip()
              for i, r in enumerate(regions) if isinstance(r, dict)]
    return lines


def _kernel(manifest: dict[str, Any]) -> list[str]:
    binary = manifest.get("binary") or {}
    return [f"kernel binary shared by content key: {binary.get('name') or 'unnamed'} for "
            f"{json.dumps(binary.get('target'), sort_keys=True)}",
            f"config       {json.dumps(binary.get('config'), sort_keys=True)}",
            f"job          {manifest.get('job')}"]


def _gemm_choice(manifest: dict[str, Any]) -> list[str]:
    return ["max-autotune choice for one matmul problem: "
            f"{json.dumps(manifest.get('choice'), sort_keys=True)}"]


_KINDS = {"aot": _aot, "regions": _regions, "kernel": _kernel, "gemm_choice": _gemm_choice}


def describe_entry(key: str, manifest: dict[str, Any]) -> list[str] | None:
    """Lines describing a non-graph entry; None for a compiled graph (manifest with a
    `graph` part), which `kiln inspect` shows in full."""
    kind = manifest.get("kind")
    if kind in _KINDS:
        return [f"key          {key}", *_KINDS[kind](manifest)]
    if isinstance(manifest.get("graph"), dict):
        return None
    fields = ", ".join(sorted(str(k) for k in manifest)) or "none"
    return [f"key          {key}",
            f"an entry of kind {kind or 'unknown'} that this Kiln does not describe "
            f"(fields: {fields}); `kiln inspect --json` shows it whole"]
