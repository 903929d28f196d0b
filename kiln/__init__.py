"""Kiln: a distributed compile farm for ``torch.compile``, with its own compiler.

The public Python API::

    import kiln
    model = torch.compile(model, backend="kiln")   # or backend=kiln.backend
    kiln.main(["stats", "--json"])                  # the ``kiln`` command
    model = kiln.load_package("model.kiln")         # an AOT package: no Dynamo, no compile

The repository keeps the design card's folders (``frontend/``, ``compiler/``, ``workers/``,
``artifact_store/``); ``pyproject.toml`` installs them as ``kiln.frontend``,
``kiln.compiler``, ``kiln.workers`` and ``kiln.artifact_store``, so no generic top-level
name is ever taken from a user's program.

Importing ``kiln`` imports nothing heavy (the store must stay importable without torch):
each name below is loaded on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

__version__ = "0.1.0"

# public name -> (module, attribute)
_EXPORTS: dict[str, tuple[str, str]] = {
    "backend": ("kiln.frontend.core.backend", "kiln_backend"),
    "kiln_backend": ("kiln.frontend.core.backend", "kiln_backend"),
    "main": ("kiln.frontend.cli.main", "main"),
    "KilnFallbackWarning": ("kiln.frontend.core.fallback", "KilnFallbackWarning"),
    "KilnConfigWarning": ("kiln.frontend.config", "KilnConfigWarning"),
    "load_package": ("kiln.frontend.package", "load_package"),
    "PackageError": ("kiln.frontend.package", "PackageError"),
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'kiln' has no attribute {name!r}") from None
    value = getattr(import_module(module), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


# The repository's folders and the installed names they map to (as in pyproject.toml).
PACKAGE_DIRS: dict[str, str] = {
    "kiln.frontend": "frontend",
    "kiln.compiler": "compiler",
    "kiln.workers": "workers",
    "kiln.artifact_store": "artifact_store",
}


def snapshot_sources(root: Any, dest: Any) -> Any:
    """Copy the source tree at ``root`` into ``dest`` laid out as installed (``dest/kiln/
    compiler``, ...), so that ``dest`` on ``sys.path`` imports exactly that copy. Tests and
    benchmarks run Ray workers and fresh processes on such a snapshot, so edits to the tree
    during a run change nothing. Returns ``dest``."""
    import shutil
    from pathlib import Path

    root, dest = Path(root), Path(dest)
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(root / "kiln", dest / "kiln", ignore=ignore, dirs_exist_ok=True)
    for name, folder in PACKAGE_DIRS.items():
        shutil.copytree(root / folder, dest / "kiln" / name.split(".")[1], ignore=ignore)
    shutil.copy(root / "pyproject.toml", dest)
    return dest
