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
import json
import os
import runpy
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

from kiln.frontend.cli.errors import CliError, UsageError
from kiln.frontend.cli.targets import (
    MODES,
    _on_path,
    dim_str,
    example_inputs,
    has_ranges,
    load_entry,
    one_line,
    parse_dtype,
    parse_option,
    parse_shapes,
    user_code,
)
from kiln.frontend.config import KilnConfig, option_problems


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


# ---------------------------------------------------------------------------------------
# Targets.


def build_model(args: argparse.Namespace) -> Any:
    """The target's model, run once eagerly on every shape set: a shape the model does
    not take is bad usage, said in one line before Dynamo traces anything."""
    model = user_code(args.target, load_entry(args.target))
    import torch

    for shapes in args.shapes:
        try:
            with torch.no_grad():
                model(*example_inputs(shapes, args.dtype, args.device))
        except Exception as e:
            shown = ",".join("x".join(map(dim_str, s)) for s in shapes)
            raise UsageError(f"{args.target} does not run on --shapes {shown} "
                             f"({args.dtype}): {one_line(e)}") from None
    return model


def _run_entry(args: argparse.Namespace, model: Any, options: dict[str, Any], tally: Tally
               ) -> None:
    import torch

    for mode in MODES[args.mode]:
        for shapes in args.shapes:
            torch._dynamo.reset()  # each shape set a graph of its own (ranges: symbolic)
            compiled = torch.compile(model, backend="kiln", options=options,
                                     dynamic=None if has_ranges(shapes) else False)
            inputs = example_inputs(shapes, args.dtype, args.device)
            if mode == "inference":
                with torch.no_grad():
                    user_code(args.target, compiled, *inputs)
            else:
                user_code(args.target, _train_step, compiled, inputs)
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
        user_code(args.target, runpy.run_path, args.target, run_name="__main__")
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
    from kiln.frontend.cli import precompile_gpu

    if args.gpu_worker:  # drain the autotune queue of precompiles without a GPU
        from kiln.frontend.cli.autotune_queue import cmd_gpu_worker

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
    from kiln.frontend.core import compile as kiln_compile
    from kiln.frontend.core.fallback import KilnFallbackWarning

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
        from kiln.frontend.core.client import client_for

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
    from kiln.frontend.cli.precompile_gpu import add_flags

    add_flags(pre)
    pre.set_defaults(func=cmd_precompile)


__all__ = ["MODES", "add_precompile_parser", "cmd_precompile", "load_entry"]
