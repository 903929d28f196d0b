"""What code generation hands to kernel compilation and to the wrapper."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

# A kernel's name becomes a module attribute, a C symbol and part of file and blob names:
# from a stored manifest it is hostile, so it must be a plain identifier.
_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")


def check_kernel_name(name: object) -> str:
    """``name`` if it is identifier-like (no dunders); ValueError naming it otherwise."""
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name) or name.startswith("__"):
        raise ValueError(f"invalid kernel name {name!r}: expected an identifier such as "
                         "triton_poi_fused_add_0")
    return name


@dataclass(frozen=True)
class KernelSpec:
    """One generated kernel: its source and how to launch it."""

    name: str
    backend: str  # "triton" or "cpp"
    kind: str  # "pointwise", "persistent_reduction", "reduction"
    source: str
    arg_buffers: tuple[str, ...]  # buffer names, in the kernel's argument order
    signature: dict[str, str] = field(default_factory=dict)  # Triton argument types
    xnumel: int = 1
    rnumel: int = 1
    configs: tuple[dict[str, Any], ...] = ()
    # Storage bytes of each argument buffer, in argument order: what an autotuner must
    # allocate to launch the kernel alone. Empty in specs from before it was recorded.
    arg_bytes: tuple[int, ...] = ()
    # Templates: (batch, M, N) of the output their tiles cover (the launch grid's extent).
    tile_shape: tuple[int, ...] = ()
    # A graph with dynamic shapes: the scalar arguments after the buffers (numels, size
    # symbols), as Python expressions over ``s0, s1, ...`` that the wrapper evaluates.
    # ``xnumel``/``rnumel`` above are then size hints, for configs and autotuning.
    size_args: tuple[str, ...] = ()
    # A fixed number of programs, whatever the config (a row-column kernel: one program
    # per part of the rows, each looping over its rows); 0: one per x block.
    programs: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "backend": self.backend, "kind": self.kind,
                "source": self.source, "arg_buffers": list(self.arg_buffers),
                "signature": dict(self.signature), "xnumel": self.xnumel,
                "rnumel": self.rnumel, "configs": [dict(c) for c in self.configs],
                "arg_bytes": list(self.arg_bytes), "tile_shape": list(self.tile_shape),
                "size_args": list(self.size_args), "programs": self.programs}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> KernelSpec:
        """Checks what later becomes a name or a path (from a store or a farm)."""
        return KernelSpec(check_kernel_name(d["name"]), d["backend"], d["kind"], d["source"],
                          tuple(d["arg_buffers"]), dict(d["signature"]), int(d["xnumel"]),
                          int(d["rnumel"]), tuple(dict(c) for c in d["configs"]),
                          tuple(int(n) for n in d.get("arg_bytes", ())),
                          tuple(int(n) for n in d.get("tile_shape", ())),
                          tuple(str(a) for a in d.get("size_args", ())),
                          int(d.get("programs", 0)))

    def grid(self, config: dict[str, Any]) -> tuple[int, int, int]:
        """Programs to launch with ``config``: one per tile (templates) or x block."""
        if self.tile_shape:
            batch, m, n = self.tile_shape
            tiles = batch * _cdiv(m, int(config["BLOCK_M"])) * _cdiv(n, int(config["BLOCK_N"]))
            # A persistent template runs one program per SM over all the tiles.
            return (min(tiles, int(config.get("NUM_SMS") or tiles)), 1, 1)
        if self.programs:
            return (self.programs, 1, 1)
        return (_cdiv(self.xnumel, int(config["XBLOCK"])), 1, 1)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
