"""What a compiled artifact depends on besides its graph: Kiln's version, a hash of the
compiler's sources, torch and triton. A request carries the client's versions (its key's
``versions`` part); a worker refuses a request whose versions are not its own."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import tomllib
from pathlib import Path

import torch

# Suffixes of files under compiler/ whose contents can change what it generates.
SOURCE_SUFFIXES = frozenset(
    {".py", ".pyi", ".c", ".cc", ".cpp", ".h", ".hpp", ".cu", ".cuh", ".j2", ".jinja", ".tmpl"}
)


def compiler_dir() -> Path:
    return Path(__file__).parent


def kiln_version() -> str:
    """The installed distribution's version, else the source tree's pyproject version."""
    try:
        return importlib.metadata.version("kiln")
    except importlib.metadata.PackageNotFoundError:
        pass
    pyproject = compiler_dir().parent / "pyproject.toml"
    try:
        return str(tomllib.loads(pyproject.read_text())["project"]["version"])
    except (OSError, KeyError, tomllib.TOMLDecodeError):
        return "unknown"


def hash_source_tree(root: Path) -> str:
    """sha256 over the sorted relative paths and contents of the source files under root."""
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts
    )
    h = hashlib.sha256()
    for path in files:
        rel = path.relative_to(root).as_posix().encode()
        content = path.read_bytes()
        # Length prefixes keep (path, content) boundaries unambiguous.
        h.update(len(rel).to_bytes(8, "little") + rel)
        h.update(len(content).to_bytes(8, "little") + content)
    return h.hexdigest()


def triton_version() -> str | None:
    for dist in ("triton", "pytorch-triton"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    if importlib.util.find_spec("triton") is None:
        return None
    import triton

    return str(triton.__version__)


@functools.cache
def versions() -> dict[str, str | None]:
    """Versions that change compiled output; computed once per process."""
    return {
        "kiln": kiln_version(),
        "compiler": hash_source_tree(compiler_dir()),
        "torch": str(torch.__version__),
        "triton": triton_version(),
    }
