"""Generated kernel sources live in real files (Triton reads source through ``inspect``)
under the private cache folder, named by their content's hash and compared with the
source before each import (``local_cache``); importing one gives its module.

The module runs the source text this process holds (verified bytes), compiled here:
never the file as it is on disk by then, and never a ``__pycache__`` ``.pyc`` that
someone planted to match the file's size and time. ``linecache`` holds the same text,
so ``inspect`` (and Triton through it) reads what runs."""

from __future__ import annotations

import hashlib
import linecache
import os
import sys
from pathlib import Path
from types import ModuleType

from .local_cache import cache_root, private_dir, verified_file

__all__ = ["cache_root", "import_source", "source_hash", "write_source"]


def source_hash(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def write_source(source: str, suffix: str = ".py") -> Path:
    """``source`` in a file named by its hash, checked (and rewritten if it differs)."""
    digest = source_hash(source)
    return verified_file(private_dir("kernels", digest[:2]) / f"k{digest[:40]}{suffix}",
                         source.encode())


def import_source(source: str, interpret: bool = False) -> ModuleType:
    """Import a kernel module from its source; ``interpret`` loads it for Triton's
    interpreter (a separate module object, so both kinds can coexist in a process)."""
    path = write_source(source)
    mod_name = f"kiln_kernels.{path.stem}{'_interp' if interpret else ''}"
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    module = ModuleType(mod_name)
    module.__file__ = str(path)
    # mtime None: linecache.checkcache keeps the entry, whatever the file holds later
    linecache.cache[str(path)] = (len(source), None, source.splitlines(True), str(path))
    code = compile(source, str(path), "exec", dont_inherit=True)
    if interpret:
        ensure_interpreter()
    sys.modules[mod_name] = module  # as an import does while the module body runs
    try:
        exec(code, module.__dict__)
    except BaseException:
        sys.modules.pop(mod_name, None)
        raise
    if interpret:
        _bind_interpreted_helpers(module)
    sys.modules[mod_name] = module
    return module


def interpreter_active() -> bool:
    """True when Triton was imported for its interpreter (its own helpers interpreted)."""
    if "triton" not in sys.modules:
        return os.environ.get("TRITON_INTERPRET", "") == "1"
    import triton.language as tl

    return type(tl.sum).__name__ == "InterpretedFunction"


def ensure_interpreter() -> None:
    """Triton's interpreter must be chosen before Triton is first imported."""
    if "triton" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"
        return
    if not interpreter_active():
        raise RuntimeError(
            "the triton-interpret CPU backend needs Triton's interpreter, which is chosen when "
            "triton is first imported: set TRITON_INTERPRET=1 before starting Python (or use "
            "KILN_CPU_BACKEND=cpp)")


def _bind_interpreted_helpers(module: ModuleType) -> None:
    """Under the interpreter, kernels call NumPy's libdevice (extern calls cannot run)."""
    from . import interpret_libdevice

    interpret_libdevice.patch_interpreter_dot()
    if hasattr(module, "libdevice"):
        module.libdevice = interpret_libdevice  # type: ignore[attr-defined]
