"""Candidate launch configs per kernel kind; the first is the heuristic choice and
autotuning (on a GPU) picks among all of them."""

from __future__ import annotations

from typing import Any

from ..common import next_power_of_2

# Rows up to this many elements are reduced in one block (persistent reductions).
PERSISTENT_RNUMEL = 4096


def _cfg(num_warps: int, num_stages: int = 1, **blocks: int) -> dict[str, Any]:
    return {**blocks, "num_warps": num_warps, "num_stages": num_stages}


def pointwise_configs(xnumel: int) -> list[dict[str, Any]]:
    cap = max(next_power_of_2(xnumel), 16)
    out: list[dict[str, Any]] = []
    for xblock, warps in ((1024, 4), (512, 4), (2048, 8), (256, 2), (128, 4), (4096, 8)):
        block = min(xblock, cap)
        cfg = _cfg(min(warps, max(1, block // 128)), XBLOCK=block)
        if cfg not in out:
            out.append(cfg)
    return out


def persistent_reduction_configs(xnumel: int, rnumel: int) -> list[dict[str, Any]]:
    rblock = next_power_of_2(rnumel)
    xcap = next_power_of_2(xnumel)
    out: list[dict[str, Any]] = []
    for target in (4096, 2048, 8192, 1024):
        xblock = max(1, min(xcap, target // rblock, 64))
        warps = max(1, min(16, (xblock * rblock) // 256))
        cfg = _cfg(warps, XBLOCK=xblock, RBLOCK=rblock)
        if cfg not in out:
            out.append(cfg)
    # Fewer warps per row for autotuning: a row reduced within one warp needs no shared
    # memory (short rows: 1 warp for up to 1024 elements), long rows with 8 warps hold
    # more loads in flight per thread.
    fewer = (_cfg(1, XBLOCK=max(1, min(xcap, 8, 1024 // rblock)), RBLOCK=rblock)
             if rblock <= 1024 else _cfg(8, XBLOCK=1, RBLOCK=rblock))
    half = _cfg(max(1, out[0]["num_warps"] // 2), XBLOCK=out[0]["XBLOCK"], RBLOCK=rblock)
    for cfg in (half, fewer):
        if cfg not in out:
            out.append(cfg)
    return out


def reduction_configs(xnumel: int, rnumel: int) -> list[dict[str, Any]]:
    xcap = next_power_of_2(xnumel)
    rcap = next_power_of_2(rnumel)
    out: list[dict[str, Any]] = []
    for xblock, rblock, warps in ((1, 2048, 8), (1, 1024, 4), (4, 512, 4), (8, 256, 4),
                                  (64, 64, 8), (1, 4096, 16)):
        cfg = _cfg(warps, XBLOCK=min(xblock, xcap), RBLOCK=min(rblock, rcap))
        if cfg not in out:
            out.append(cfg)
    return out


def outer_reduction_configs(xnumel: int, rnumel: int) -> list[dict[str, Any]]:
    """Reductions over a strided dimension (column sums): x, where memory is contiguous,
    across the lanes; r deep enough that each iteration has 8-16 KiB of loads in flight
    per program (a 64 x 8 tile, 2 KiB, ran at a third of the H200's bandwidth)."""
    xcap, rcap = next_power_of_2(xnumel), next_power_of_2(rnumel)
    out: list[dict[str, Any]] = []
    for xblock, rblock, warps in ((64, 64, 8), (128, 32, 8), (64, 32, 4), (32, 64, 4),
                                  (128, 64, 8), (64, 8, 4)):
        cfg = _cfg(warps, XBLOCK=min(xblock, xcap), RBLOCK=min(rblock, rcap))
        if cfg not in out:
            out.append(cfg)
    return out


def configs_for(kind: str, xnumel: int, rnumel: int, outer: bool = False
                ) -> list[dict[str, Any]]:
    if kind == "pointwise":
        return pointwise_configs(xnumel)
    if kind == "persistent_reduction":
        return persistent_reduction_configs(xnumel, rnumel)
    if outer:
        return outer_reduction_configs(xnumel, rnumel)
    return reduction_configs(xnumel, rnumel)
