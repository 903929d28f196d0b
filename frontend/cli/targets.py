"""What ``kiln precompile`` and ``kiln package`` are pointed at: the model's entry
(``module:function`` or ``file.py:function``), its input shapes (``8x128``, a dynamic size
``1-64``), dtype and compile options, parsed with errors a user can act on."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import sys
from collections.abc import Callable
from typing import Any

from kiln.frontend.cli.errors import CliError, UsageError
from kiln.frontend.config import did_you_mean, option_problems

MODES = {"inference": ("inference",), "train": ("train",), "both": ("inference", "train")}

Dim = int | tuple[int, int]  # a size, or a dynamic size's (min, max)

def parse_shapes(text: str) -> list[tuple[Dim, ...]]:
    """``8x128,128`` -> [(8, 128), (128,)]: one tuple per input. A dimension ``1-64`` is
    dynamic over that range: ``1-64x128`` compiles once for every batch from 1 to 64."""
    try:
        shapes = [tuple(_parse_dim(n) for n in part.split("x")) for part in text.split(",")
                  if part]
    except ValueError:
        shapes = []
    if not shapes:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected shapes such as 8x128 or 8x128,128x64 (one per input), "
            "or 1-64x128 (a dynamic range)")
    return shapes

def _parse_dim(text: str) -> Dim:
    lo, sep, hi = text.partition("-")
    low, high = int(lo), int(hi or lo)
    if not 0 < low <= high:
        raise ValueError(text)
    return (low, high) if sep else low

def size_of(dim: Dim) -> int:
    """The example size of a dimension: for a range, the smallest size Dynamo keeps
    symbolic (it specializes 1)."""
    return dim if isinstance(dim, int) else min(max(dim[0], 2), dim[1])

def dim_str(dim: Dim) -> str:
    return str(dim) if isinstance(dim, int) else f"{dim[0]}-{dim[1]}"

def has_ranges(shapes: list[tuple[Dim, ...]]) -> bool:
    return any(not isinstance(d, int) for s in shapes for d in s)

def parse_option(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` (VALUE as JSON where it parses); unknown names and bad values are
    refused with the config layer's message."""
    name, sep, value = text.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE")
    try:
        parsed: Any = json.loads(value)
    except json.JSONDecodeError:
        parsed = value
    option = (name.strip().lower(), parsed)
    problems = option_problems(dict([option]))
    if problems:
        raise argparse.ArgumentTypeError(problems[0])
    return option

# torch's dtype names (a fixed list: checking --dtype must not wait for `import torch`)
DTYPES = ("float32", "float", "float64", "double", "float16", "half", "bfloat16", "int8",
          "int16", "short", "int32", "int", "int64", "long", "uint8", "bool",
          "float8_e4m3fn", "float8_e5m2")

def parse_dtype(text: str) -> str:
    if text not in DTYPES:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a dtype Kiln takes{did_you_mean(text, DTYPES)} (one of "
            f"{', '.join(DTYPES)})")
    return text

def _on_path(folder: str) -> None:
    """As `python script.py` and `python -m` do: the target's folder is importable."""
    folder = os.path.abspath(folder)
    if folder not in sys.path:
        sys.path.insert(0, folder)

def load_entry(target: str) -> Callable[..., Any]:
    """The function named by ``pkg.module:function`` or ``path/to/file.py:function``;
    UsageError for a target that does not exist, CliError for one whose code raises."""
    where, _, name = target.rpartition(":")
    if not where or not name:
        raise UsageError(f"{target!r}: expected module:function, file.py:function or a "
                         "script.py")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise UsageError(f"no such file: {where}")
        _on_path(os.path.dirname(where) or ".")
        namespace = user_code(target, runpy.run_path, where, run_name="kiln_precompile")
    else:
        _on_path(os.getcwd())
        try:
            module = importlib.import_module(where)
        except ModuleNotFoundError as e:
            if e.name and where.startswith(e.name):
                raise UsageError(f"no module named {where!r} here ({os.getcwd()}): run from "
                                 "the folder that holds it, or give file.py:function") from None
            raise CliError(f"{target}: importing {where} failed: {e}") from None
        except Exception as e:
            raise CliError(f"{target}: importing {where} raised {one_line(e)}") from None
        namespace = vars(module)
    entry = namespace.get(name)
    if not callable(entry):
        found = sorted(k for k, v in namespace.items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) in (None, "kiln_precompile", where))
        raise UsageError(f"{where} has no function {name!r}"
                         + (f" (it defines: {', '.join(found[:8])})" if found else ""))
    return entry  # type: ignore[no-any-return]

def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__

def user_code(target: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run the user's code; what it raises is one line naming the target."""
    try:
        return fn(*args, **kwargs)
    except SystemExit as e:
        if e.code in (None, 0):
            return None
        raise CliError(f"{target} exited with status {e.code}") from None
    except CliError:
        raise
    except Exception as e:
        raise CliError(f"{target} raised {one_line(e)}") from None

def example_inputs(shapes: list[tuple[Dim, ...]], dtype: str, device: str) -> list[Any]:
    """Random inputs; a dimension given as a range is marked dynamic over it."""
    import torch

    torch_dtype = getattr(torch, dtype)
    sizes = [tuple(size_of(d) for d in s) for s in shapes]
    if torch_dtype.is_floating_point:
        out = [torch.randn(*s, dtype=torch_dtype, device=device) for s in sizes]
    else:
        out = [torch.randint(0, 2, s, dtype=torch_dtype, device=device) for s in sizes]
    for t, shape in zip(out, shapes):
        for d, dim in enumerate(shape):
            if not isinstance(dim, int):
                torch._dynamo.mark_dynamic(t, d, min=dim[0], max=dim[1])
    return out
