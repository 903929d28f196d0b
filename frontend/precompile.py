"""``kiln precompile``: fill the store before a job starts, and say truly what it stored.

    kiln precompile models:build --shapes 8x128 16x128 [--mode inference|train|both]
    kiln precompile train.py -- --epochs 1

A ``module:function`` (or ``file.py:function``) target returns a model; it is compiled
once per shape set and mode, each as the static graph a client asks for (Dynamo reset,
``dynamic=False``): ``inference`` runs it under ``torch.no_grad()`` (what a serving client
asks for), ``train`` runs forward and backward. A ``script.py`` target runs as
``__main__`` with ``torch.compile`` using Kiln; it compiles what it runs.

The summary counts what reached the store: "published N artifacts (M bytes)". The command
exits 1 when a compiled graph was not published, when any graph ran eagerly, or when no
graph was compiled at all, naming why; a store it cannot write fails before compiling.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import runpy
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

from .cli_errors import CliError, UsageError
from .config import KilnConfig, did_you_mean, option_problems

MODES = {"inference": ("inference",), "train": ("train",), "both": ("inference", "train")}


class Tally:
    """Every graph the backend compiled during the run, and a tqdm display of it."""

    def __init__(self, total: int | None) -> None:
        """``total`` shape sets to step through; None counts graphs (a script's run)."""
        try:
            from tqdm import tqdm
        except ImportError:  # a dependency; a machine without it still precompiles
            tqdm = _NoDisplay
        self.start = time.perf_counter()
        self.counts = {"graphs": 0, "hits": 0, "misses": 0, "farm": 0, "local": 0,
                       "kernels": 0, "published": 0, "published_bytes": 0,
                       "unpublished": 0, "eager": 0}
        self.tty = sys.stderr.isatty()  # a log file gets a few lines, not every redraw
        self.per_graph = total is None
        self.bar = tqdm(total=total, desc="precompile",
                        unit="graph" if self.per_graph else "shape set",
                        file=sys.stderr, dynamic_ncols=True,
                        mininterval=0.2 if self.tty else 30.0)

    def graph(self, name: str, result: Any) -> None:
        c = self.counts
        c["graphs"] += 1
        if result.source == "hit":
            c["hits"] += 1
        else:
            c["misses"] += 1
            c[result.source] += 1
            c["kernels"] += len(result.compiled.binaries)
            if result.published_bytes is None:
                c["unpublished"] += 1
            else:
                c["published"] += 1
                c["published_bytes"] += result.published_bytes
        self.bar.set_postfix(graphs=c["graphs"], hits=c["hits"], published=c["published"],
                             refresh=self.tty)
        if self.per_graph:
            self.bar.update(1)

    def step(self) -> None:
        self.bar.update(1)

    def close(self, shape_sets: int) -> dict[str, Any]:
        self.bar.close()
        return {**self.counts, "shape_sets": shape_sets,
                "seconds": round(time.perf_counter() - self.start, 3)}


class _NoDisplay:
    """Where tqdm is not installed: counts, shows nothing (the summary line remains)."""

    def __init__(self, total: int | None = None, **kwargs: Any) -> None:
        self.n = 0

    def update(self, n: int = 1) -> None:
        self.n += n

    def set_postfix(self, **kwargs: Any) -> None:
        pass

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------------------
# Argument types


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


def _size(dim: Dim) -> int:
    """The example size of a dimension: for a range, the smallest size Dynamo keeps
    symbolic (it specializes 1)."""
    return dim if isinstance(dim, int) else min(max(dim[0], 2), dim[1])


def _dim_str(dim: Dim) -> str:
    return str(dim) if isinstance(dim, int) else f"{dim[0]}-{dim[1]}"


def _has_ranges(shapes: list[tuple[Dim, ...]]) -> bool:
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


# ---------------------------------------------------------------------------------------
# Targets.


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
        namespace = _user_code(target, runpy.run_path, where, run_name="kiln_precompile")
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
            raise CliError(f"{target}: importing {where} raised {_one_line(e)}") from None
        namespace = vars(module)
    entry = namespace.get(name)
    if not callable(entry):
        found = sorted(k for k, v in namespace.items() if callable(v) and not k.startswith("_")
                       and getattr(v, "__module__", None) in (None, "kiln_precompile", where))
        raise UsageError(f"{where} has no function {name!r}"
                         + (f" (it defines: {', '.join(found[:8])})" if found else ""))
    return entry  # type: ignore[no-any-return]


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


def _user_code(target: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
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
        raise CliError(f"{target} raised {_one_line(e)}") from None


def _example_inputs(shapes: list[tuple[Dim, ...]], dtype: str, device: str) -> list[Any]:
    """Random inputs; a dimension given as a range is marked dynamic over it."""
    import torch

    torch_dtype = getattr(torch, dtype)
    sizes = [tuple(_size(d) for d in s) for s in shapes]
    if torch_dtype.is_floating_point:
        out = [torch.randn(*s, dtype=torch_dtype, device=device) for s in sizes]
    else:
        out = [torch.randint(0, 2, s, dtype=torch_dtype, device=device) for s in sizes]
    for t, shape in zip(out, shapes):
        for d, dim in enumerate(shape):
            if not isinstance(dim, int):
                torch._dynamo.mark_dynamic(t, d, min=dim[0], max=dim[1])
    return out


def build_model(args: argparse.Namespace) -> Any:
    """The target's model, run once eagerly on every shape set: a shape the model does
    not take is bad usage, said in one line before Dynamo traces anything."""
    model = _user_code(args.target, load_entry(args.target))
    import torch

    for shapes in args.shapes:
        try:
            with torch.no_grad():
                model(*_example_inputs(shapes, args.dtype, args.device))
        except Exception as e:
            shown = ",".join("x".join(map(_dim_str, s)) for s in shapes)
            raise UsageError(f"{args.target} does not run on --shapes {shown} "
                             f"({args.dtype}): {_one_line(e)}") from None
    return model


def _run_entry(args: argparse.Namespace, model: Any, options: dict[str, Any], tally: Tally
               ) -> None:
    import torch

    for mode in MODES[args.mode]:
        for shapes in args.shapes:
            torch._dynamo.reset()  # each shape set a graph of its own (ranges: symbolic)
            compiled = torch.compile(model, backend="kiln", options=options,
                                     dynamic=None if _has_ranges(shapes) else False)
            inputs = _example_inputs(shapes, args.dtype, args.device)
            if mode == "inference":
                with torch.no_grad():
                    _user_code(args.target, compiled, *inputs)
            else:
                _user_code(args.target, _train_step, compiled, inputs)
            tally.step()


def _train_step(compiled: Callable[..., Any], inputs: list[Any]) -> None:
    import torch

    out = compiled(*inputs)
    flat = out if isinstance(out, (list, tuple)) else [out]
    losses = [o.float().sum() for o in flat if torch.is_tensor(o) and o.requires_grad]
    if not losses:
        raise CliError("--mode train: no output requires grad (the model has no trainable "
                       "parameters?); use --mode inference")
    torch.stack(losses).sum().backward()


def _run_script(args: argparse.Namespace, options: dict[str, Any]) -> None:
    """Run a script as __main__ with torch.compile's default backend made Kiln's."""
    import torch

    real_compile = torch.compile

    def kiln_compile(model: Any = None, **kwargs: Any) -> Any:
        if kwargs.get("backend", "inductor") == "inductor":
            kwargs.update(backend="kiln", options={**options, **(kwargs.get("options") or {})})
        return real_compile(model, **kwargs)

    argv = sys.argv
    sys.argv = [args.target, *args.script_args]
    _on_path(os.path.dirname(args.target) or ".")
    torch.compile = kiln_compile  # type: ignore[assignment]
    try:
        _user_code(args.target, runpy.run_path, args.target, run_name="__main__")
    finally:
        torch.compile = real_compile
        sys.argv = argv


# ---------------------------------------------------------------------------------------
# The command.


def check_arguments(args: argparse.Namespace) -> bool:
    """Bad usage as UsageError, before anything is imported or compiled; True for a
    script target."""
    is_script = args.target.endswith(".py") and ":" not in args.target
    problems = option_problems(dict(args.option or []))
    if problems:
        raise UsageError(problems[0] + ("" if len(problems) == 1 else
                                        f" (and {len(problems) - 1} more)"))
    if is_script:
        if not os.path.isfile(args.target):
            raise UsageError(f"no such file: {args.target}")
        given = [f for f, v in (("--shapes", args.shapes), ("--dtype", args.dtype),
                                ("--device", args.device), ("--mode", args.mode)) if v]
        if given:
            raise UsageError(f"{', '.join(given)} apply to module:function targets; a script "
                             "compiles the inputs it runs")
    elif not args.shapes:
        raise UsageError("give --shapes for a module:function target (e.g. --shapes 8x128)")
    args.dtype, args.device = args.dtype or "float32", args.device or "cpu"
    args.mode = args.mode or "inference"
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device {args.device}: CUDA is not available on this machine")
    return is_script


def check_store(config: KilnConfig) -> None:
    """Fail before compiling when nothing could be published."""
    from kiln.artifact_store import ConfigError, open_store

    try:
        store = open_store(**config.store_kwargs(), strict=True)
    except ConfigError as e:
        raise CliError(f"cannot open the store: {e}") from None
    with store:
        reason = unpublishable_reason(store)
    if reason is not None:
        raise CliError(f"{reason}: nothing could be published")


def unpublishable_reason(store: Any) -> str | None:
    if store.disabled_reason is not None or store.primary is None:
        return f"cannot open the store {store.url or '(disabled)'}: " \
               f"{store.disabled_reason or 'see the error above'}"
    if store.read_only:
        return f"the store {store.url} is read-only (KILN_STORE_READ_ONLY=1)"
    if store.require_signed and store.keyring.signer is None:
        return ("signatures are required but KILN_SIGNING_KEY holds no key that can sign "
                f"({store.keyring.describe()})")
    return None


def cmd_precompile(args: argparse.Namespace) -> int:
    from . import precompile_gpu

    if args.gpu_worker:  # drain the autotune queue of precompiles without a GPU
        from .autotune_queue import cmd_gpu_worker

        return cmd_gpu_worker(args)
    if args.target is None:
        raise UsageError("precompile needs a TARGET (module:function or script.py), "
                         "or --gpu-worker")
    if precompile_gpu.wants_job(args):  # a GPU this host lacks, ranges, a CI check
        return precompile_gpu.cmd_job(args)
    is_script = check_arguments(args)
    options = dict(args.option or [])
    config = KilnConfig.resolve(options)
    check_store(config)
    model = None if is_script else build_model(args)
    summary, fallbacks = _compile_all(args, model, options)
    problems = _problems(summary, fallbacks, config)
    if args.json:
        print(json.dumps({**summary, "problems": problems}, sort_keys=True))
    else:
        sets = f" over {summary['shape_sets']} shape set(s)" if summary["shape_sets"] else ""
        print(f"published {summary['published']} artifacts ({summary['published_bytes']} "
              f"bytes): {summary['graphs']} graphs{sets}, {summary['hits']} already in the "
              f"store, {summary['misses']} compiled "
              f"({summary['farm']} on the farm, {summary['local']} locally), "
              f"{summary['kernels']} kernels, {summary['eager']} eager; "
              f"{summary['seconds']:.1f} s")
    if problems:
        raise CliError("; ".join(problems))
    return 0


def _compile_all(args: argparse.Namespace, model: Any, options: dict[str, Any]
                 ) -> tuple[dict[str, Any], list[str]]:
    """Run the target with every graph observed: (summary, eager-fallback messages)."""
    from . import compile as kiln_compile
    from .backend import KilnFallbackWarning

    is_script = model is None
    total = None if is_script else len(args.shapes) * len(MODES[args.mode])
    tally = Tally(total)
    kiln_compile.observers.append(tally.graph)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", KilnFallbackWarning)
        try:
            if is_script:
                _run_script(args, options)
            else:
                _run_entry(args, model, options, tally)
        finally:
            kiln_compile.observers.remove(tally.graph)
            summary = tally.close(0 if is_script else tally.bar.n)
    fallbacks = [str(w.message) for w in caught if issubclass(w.category, KilnFallbackWarning)]
    summary["eager"] = len(fallbacks)
    for w in caught:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return summary, fallbacks


def _problems(summary: dict[str, Any], fallbacks: list[str], config: KilnConfig
              ) -> list[str]:
    problems = []
    if summary["graphs"] == 0 and not fallbacks:
        problems.append("no graph was compiled (does the target call torch.compile?)")
    if summary["unpublished"]:
        from .client import client_for

        reason = unpublishable_reason(client_for(config).store) or \
            "the store refused them (see the warnings above)"
        problems.append(f"{summary['unpublished']} compiled graph(s) were not published: "
                        f"{reason}")
    if fallbacks:
        first = fallbacks[0].removeprefix("kiln: ")
        problems.append(f"{len(fallbacks)} graph(s) ran eagerly, so nothing was stored for "
                        f"them: {first}")
    return problems


def add_precompile_parser(sub: Any) -> None:
    pre = sub.add_parser(
        "precompile", help="compile a model's graphs into the store ahead of time",
        description="TARGET is module:function (or file.py:function) returning a model, "
        "compiled once per --shapes and --mode; or a script.py, run as __main__ (its "
        "arguments after --) with torch.compile using Kiln. Exit 1 when a graph was not "
        "published or ran eagerly.")
    pre.add_argument("target", nargs="?")
    pre.add_argument("--shapes", nargs="+", type=parse_shapes, metavar="SHAPES",
                     help="one input shape set each: 8x128 or 8x128,128 (one per input); "
                     "a dimension MIN-MAX (1-64x128) is dynamic: one compile for the range")
    pre.add_argument("--dtype", type=parse_dtype, help="input dtype (default float32)")
    pre.add_argument("--device", help="input device (default cpu)")
    pre.add_argument("--mode", choices=sorted(MODES), help="inference (under "
                     "torch.no_grad(), the default), train (forward and backward), or both")
    pre.add_argument("--train", action="store_const", const="train", dest="mode",
                     help="the same as --mode train")
    pre.add_argument("--option", action="append", type=parse_option, metavar="NAME=VALUE",
                     help="a torch.compile option for Kiln (e.g. cpu_backend=cpp)")
    pre.add_argument("--json", action="store_true", help="the summary as JSON")
    from .precompile_gpu import add_flags

    add_flags(pre)
    pre.set_defaults(func=cmd_precompile)


__all__ = ["MODES", "add_precompile_parser", "cmd_precompile", "load_entry"]
