"""The ``kiln`` command.

    kiln precompile TARGET [--shapes 8x128 16x128,128]   fill the store ahead of a job
        [--gpu h200] [--versions-from F] [--check]       ... for a GPU this host lacks
    kiln package TARGET --shapes 8x128 -o model.kiln     one file that runs without Dynamo
    kiln versions [--json]                               what keys carry (for --versions-from)
    kiln stats [--json]                                  hits, misses, compiles, time saved
    kiln inspect KEY [--json] [--source KERNEL]          manifest, wrapper, kernels, lifetimes
    kiln explain-miss A B                                which key part differs
    kiln gc [--max-age 7d] [--max-size 10G] [--dry-run]  collect the store
    kiln farm up|down|status                             a Ray farm on this machine

Every command reads the same ``KILN_*`` variables as the backend (``KILN_STORE``,
``KILN_FARM``, ...). Exit status: 0 on success, 1 when the command could not do its
work (a key not found, a farm that will not start), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kiln.artifact_store import default_stats_file, open_store, read_stats, summarize

from . import precompile_gpu
from .package_cli import add_package_parser

EXIT_OK, EXIT_FAILED = 0, 1
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``30m``, ``12h``, ``7d``, ``2w``."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a duration such as 12h or 7d")
    return float(match.group(1)) * _UNITS[match.group(2)]


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True, default=str))


# ---------------------------------------------------------------------------------------
# stats


def stats_summary(data: dict[str, Any]) -> dict[str, Any]:
    """One object from the stats file: store hits and misses per tier, client counters."""
    store, client = data.get("store") or {}, data.get("client") or {}
    tiers = store.get("tiers") or {}
    summary: dict[str, Any] = {
        "stats_file": default_stats_file(), "since": store.get("since"),
        "updated": data.get("updated"),
        "hits": {"total": store.get("hits", 0),
                 **{name: tier.get("hits", 0) for name, tier in tiers.items()}},
        "misses": {"total": store.get("misses", 0),
                   **{name: tier.get("misses", 0) for name, tier in tiers.items()}},
    }
    for name in ("graphs", "compiles", "compiles_farm", "compiles_local", "farm_fallbacks",
                 "compile_errors", "kernels_compiled", "compile_seconds", "time_saved_s"):
        summary[name] = client.get(name, 0)
    for name in ("publishes", "publish_failures", "integrity_failures", "signature_failures"):
        summary[name] = store.get(name, 0)
    summary["store"] = summarize(store)
    return summary


def cmd_stats(args: argparse.Namespace) -> int:
    summary = stats_summary(read_stats())
    if args.json:
        print(json.dumps(summary, sort_keys=True, default=str))
        return EXIT_OK
    hits, misses = summary["hits"], summary["misses"]
    tiers = ", ".join(f"{k} {v}" for k, v in hits.items() if k != "total")
    print(f"stats file      {summary['stats_file']}")
    print(f"store lookups   {hits['total']} hits ({tiers or 'no tiers'}), "
          f"{misses['total']} misses")
    print(f"graphs          {summary['graphs']} ({summary['compiles']} compiled: "
          f"{summary['compiles_farm']} on the farm, {summary['compiles_local']} locally)")
    print(f"kernels         {summary['kernels_compiled']} compiled")
    print(f"compile time    {summary['compile_seconds']:.1f} s; "
          f"time saved by hits {summary['time_saved_s']:.1f} s")
    print(f"problems        {summary['farm_fallbacks']} farm fallbacks, "
          f"{summary['compile_errors']} compile errors, "
          f"{summary['integrity_failures']} damaged artifacts")
    return EXIT_OK


# ---------------------------------------------------------------------------------------
# inspect


def _kernel_rows(manifest: dict[str, Any], sizes: dict[str, int]) -> list[str]:
    rows = [f"  {'kernel':<44} {'kind':<21} {'numel':>12}  {'config':<34} warps shared "
            "tuned  binary"]
    for entry in manifest.get("kernels", []):
        config = ",".join(f"{k}={v}" for k, v in sorted(entry.get("config", {}).items())
                          if k not in ("num_warps", "num_stages"))
        launch = entry.get("launch", {})
        blob = (entry.get("binary") or {}).get("blob")
        size = f"{sizes.get(blob, 0)} B" if blob else "-"
        tuned = "yes" if entry.get("autotune") else "no"
        numel = f"{entry.get('xnumel')}x{entry.get('rnumel')}"
        rows.append(f"  {entry['name']:<44} {entry['kind']:<21} {numel:>12}  {config:<34} "
                    f"{launch.get('num_warps', '-'):>5} {launch.get('shared', '-'):>6} "
                    f"{tuned:<5}  {size}")
    return rows


def cmd_inspect(args: argparse.Namespace) -> int:
    store = open_store(read_only=True)
    described = store.describe(args.key)
    artifact = store.get(args.key) if described is not None else None
    if described is None or artifact is None:
        print(f"kiln inspect: no artifact {args.key} in {store.url}", file=sys.stderr)
        return EXIT_FAILED
    manifest = artifact.manifest
    if args.source:
        entries = [e for e in manifest["kernels"] if e["name"] == args.source]
        if not entries:
            print(f"kiln inspect: no kernel {args.source}", file=sys.stderr)
            return EXIT_FAILED
        print(artifact.blobs[entries[0]["source_blob"]].decode())
        return EXIT_OK
    if args.json:
        _print_json({**described, "meta": manifest})
        return EXIT_OK
    print("\n".join(describe_artifact(described, manifest)))
    if not args.no_wrapper:
        print("\n== wrapper (wrapper.py) ==")
        print(artifact.blobs["wrapper.py"].decode())
    return EXIT_OK


def describe_artifact(described: dict[str, Any], manifest: dict[str, Any]) -> list[str]:
    graph, compile_info = manifest.get("graph", {}), manifest.get("compile", {})
    stats, signature = graph.get("stats", {}), described.get("signature")
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(described.get("created", 0)))
    lines = [
        f"key          {described['key']}",
        f"created      {created}; {described['bytes']} bytes in {len(described['blobs'])} "
        f"blobs; signed: {signature['kid'] if signature else 'no'}",
        f"target       {json.dumps(manifest.get('target'), sort_keys=True)}",
        f"versions     {json.dumps(manifest.get('versions'), sort_keys=True)}",
        f"options      {json.dumps(manifest.get('options'), sort_keys=True)}",
        f"compiled     {compile_info.get('mode', '?')} ({compile_info.get('farm', '?')}) in "
        f"{compile_info.get('wall_s', 0):.2f} s: graph "
        f"{compile_info.get('graph_compile_s', 0):.2f} s, kernels "
        f"{compile_info.get('kernel_compile_s', 0):.2f} s",
        f"graph        {graph.get('name')} on {graph.get('device_type')}: "
        f"{stats.get('kernels', 0)} kernels, {stats.get('buffers', 0)} buffers, peak "
        f"{stats.get('peak_bytes', 0)} bytes; autotuned: {graph.get('autotuned')}",
        "key parts    " + ", ".join(f"{k} {v[:12]}" for k, v in
                                    manifest.get("key_parts", {}).items()),
        "", "== kernels ==",
        *_kernel_rows(manifest, {n: b["size"] for n, b in described["blobs"].items()}),
        "", "== buffer lifetimes ==", graph.get("lifetimes", "") or "(none)",
    ]
    return lines


# ---------------------------------------------------------------------------------------
# explain-miss


def _key_parts_of(ref: str) -> tuple[dict[str, str], Any]:
    """(key parts, request or None) of a key in the store, or of a request saved by
    KILN_DEBUG (its request.msgpack, or the folder holding it)."""
    from kiln.compiler.request import CompileRequest

    from .keys import compute_key

    path = Path(ref)
    if path.is_dir():
        path = path / "request.msgpack"
    if path.is_file():
        request = CompileRequest.from_bytes(path.read_bytes())
        return compute_key(request).parts, request
    manifest = open_store(read_only=True).get_manifest(ref)
    if manifest is None:
        raise LookupError(f"{ref} is neither a saved request nor a key in the store")
    return dict(manifest.get("key_parts", {})), None


def cmd_explain_miss(args: argparse.Namespace) -> int:
    from .keys import diff_requests, explain_miss

    try:
        (parts_a, request_a), (parts_b, request_b) = map(_key_parts_of, (args.a, args.b))
    except (LookupError, ValueError) as e:
        print(f"kiln explain-miss: {e}", file=sys.stderr)
        return EXIT_FAILED
    lines = explain_miss(parts_a, parts_b)
    if not lines:
        print("the keys are equal: every part matches")
        return EXIT_OK
    print("\n".join(lines))
    if request_a is not None and request_b is not None:
        print("\n".join(["", "in detail:"] + [f"  {line}" for line in
                                             diff_requests(request_a, request_b)]))
    return EXIT_OK


# ---------------------------------------------------------------------------------------
# gc


def cmd_gc(args: argparse.Namespace) -> int:
    from kiln.artifact_store.config import parse_size

    store = open_store()
    max_bytes = parse_size(args.max_size, "--max-size") if args.max_size else None
    report = store.gc(max_age_s=args.max_age, max_bytes=max_bytes, dry_run=args.dry_run)
    _print_json({"store": store.url, "dry_run": args.dry_run, "report": report})
    failed = any(isinstance(r, dict) and "error" in r for r in report.values())
    return EXIT_FAILED if failed else EXIT_OK


# ---------------------------------------------------------------------------------------
# farm


def cmd_farm(args: argparse.Namespace) -> int:
    from . import farm

    if args.action == "up":
        try:
            info = farm.start_local_cluster(num_cpus=args.num_cpus, num_gpus=args.num_gpus,
                                            port=args.port)
        except (OSError, RuntimeError, TimeoutError) as e:
            print(f"kiln farm up: {e}", file=sys.stderr)
            return EXIT_FAILED
        if not args.no_warm:
            _warm_farm(str(info["address"]))
        state = "already running" if info.get("already_running") else "started"
        print(f"farm {state} at {info['address']} (address in {farm.farm_file()})")
        return EXIT_OK
    if args.action == "down":
        stopped = farm.stop_local_cluster()
        print(f"farm at {stopped['address']} stopped" if stopped else "no farm is up")
        return EXIT_OK
    return _farm_status(args)


def _farm_status(args: argparse.Namespace) -> int:
    """The farm clients use: KILN_FARM's address, else the one of `kiln farm up`."""
    from . import farm
    from .config import KilnConfig

    mode = KilnConfig.resolve().farm
    if mode.lower() in (farm.LOCAL, farm.INPROCESS):
        info = farm.read_farm_file()
        if info is None:
            print(f"KILN_FARM={mode}: no farm is up (local clients start an embedded Ray)")
            return EXIT_FAILED
        mode = str(info["address"])
    reason = farm.probe(mode)
    print(f"farm at {mode}: {'up' if reason is None else reason}")
    if reason is None and args.json:
        _print_json(farm.RayFarm(mode).stats())
    return EXIT_OK if reason is None else EXIT_FAILED


def _warm_farm(address: str) -> None:
    """Start the coordinator and its workers now, so the first miss finds them warm."""
    import ray

    from .farm import RayFarm

    actor = RayFarm(address).actor()
    ray.get(actor.wait_warm.remote(), timeout=300)
    ray.shutdown()


# ---------------------------------------------------------------------------------------
# precompile


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """``8x128,128`` -> [(8, 128), (128,)]: one tuple per input."""
    try:
        return [tuple(int(n) for n in part.split("x")) for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected shapes such as 8x128 or 8x128,128x64 (one per input)"
        ) from None


def parse_option(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE")
    try:
        return name.strip().lower(), json.loads(value)
    except json.JSONDecodeError:
        return name.strip().lower(), value


class Progress:
    """A one-line progress bar on stderr, fed by every graph the backend compiles."""

    def __init__(self, total: int | None) -> None:
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.counts = {"graphs": 0, "hits": 0, "misses": 0, "farm": 0, "local": 0,
                       "kernels": 0, "eager": 0}
        self.tty = sys.stderr.isatty()

    def graph(self, name: str, result: Any) -> None:
        self.counts["graphs"] += 1
        if result.source == "hit":
            self.counts["hits"] += 1
        else:
            self.counts["misses"] += 1
            self.counts[result.source] += 1
            self.counts["kernels"] += len(result.compiled.binaries)
        self.show()

    def step(self) -> None:
        self.done += 1
        self.show()

    def show(self) -> None:
        c, elapsed = self.counts, time.perf_counter() - self.start
        bar = ""
        if self.total:
            filled = int(20 * self.done / self.total)
            bar = f"[{'#' * filled}{'.' * (20 - filled)}] {self.done}/{self.total}  "
        line = (f"{bar}graphs {c['graphs']} (hits {c['hits']}, misses {c['misses']})  "
                f"kernels {c['kernels']}  {elapsed:.1f}s")
        print(("\r" + line) if self.tty else line, end="" if self.tty else "\n",
              file=sys.stderr, flush=True)

    def summary(self) -> dict[str, Any]:
        if self.tty:
            print(file=sys.stderr)
        return {**self.counts, "shape_sets": self.done,
                "seconds": round(time.perf_counter() - self.start, 3)}


def load_entry(target: str) -> Callable[..., Any]:
    """``pkg.module:function`` or ``path/to/file.py:function``."""
    import importlib
    import runpy

    where, _, name = target.rpartition(":")
    if where.endswith(".py"):
        namespace = runpy.run_path(where, run_name="kiln_precompile")
        return namespace[name]  # type: ignore[no-any-return]
    return getattr(importlib.import_module(where), name)  # type: ignore[no-any-return]


def _example_inputs(shapes: list[tuple[int, ...]], dtype: str, device: str) -> list[Any]:
    import torch

    torch_dtype = getattr(torch, dtype)
    if torch_dtype.is_floating_point:
        return [torch.randn(*s, dtype=torch_dtype, device=device) for s in shapes]
    return [torch.randint(0, 2, s, dtype=torch_dtype, device=device) for s in shapes]


def _run_entry(args: argparse.Namespace, options: dict[str, Any], progress: Progress) -> None:
    import torch

    model = load_entry(args.target)()
    for shapes in args.shapes or []:
        torch._dynamo.reset()  # a fresh compile per shape set: no recompile limit
        compiled = torch.compile(model, backend="kiln", options=options, dynamic=False)
        out = compiled(*_example_inputs(shapes, args.dtype, args.device))
        if args.train:
            flat = out if isinstance(out, (list, tuple)) else [out]
            losses = [o.float().sum() for o in flat if torch.is_tensor(o) and o.requires_grad]
            torch.stack(losses).sum().backward()
        progress.step()


def _run_script(args: argparse.Namespace, options: dict[str, Any]) -> None:
    """Run a script as __main__ with torch.compile's default backend made Kiln's."""
    import runpy

    import torch

    real_compile = torch.compile

    def kiln_compile(model: Any = None, **kwargs: Any) -> Any:
        if kwargs.get("backend", "inductor") == "inductor":
            kwargs.update(backend="kiln", options={**options, **(kwargs.get("options") or {})})
        return real_compile(model, **kwargs)

    argv = sys.argv
    sys.argv = [args.target, *args.script_args]
    torch.compile = kiln_compile  # type: ignore[assignment]
    try:
        runpy.run_path(args.target, run_name="__main__")
    finally:
        torch.compile = real_compile
        sys.argv = argv


def cmd_precompile(args: argparse.Namespace) -> int:
    import warnings

    from . import compile as kiln_compile
    from .backend import KilnFallbackWarning

    options = dict(args.option or [])
    if precompile_gpu.wants_job(args):  # a GPU this host lacks, ranges, a CI check
        return precompile_gpu.cmd_job(args, options)
    is_script = args.target.endswith(".py") and ":" not in args.target
    if not is_script and not args.shapes:
        print("kiln precompile: give --shapes for a module:function entry", file=sys.stderr)
        return 2
    progress = Progress(None if is_script else len(args.shapes))
    kiln_compile.observers.append(progress.graph)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", KilnFallbackWarning)
        try:
            _run_script(args, options) if is_script else _run_entry(args, options, progress)
        finally:
            kiln_compile.observers.remove(progress.graph)
    summary = progress.summary()
    summary["eager"] = sum(issubclass(w.category, KilnFallbackWarning) for w in caught)
    for w in caught:
        warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        print(f"precompiled {summary['shape_sets']} shape set(s): {summary['graphs']} graphs "
              f"({summary['hits']} hits, {summary['misses']} misses: {summary['farm']} on "
              f"the farm, {summary['local']} locally; {summary['eager']} eager), "
              f"{summary['kernels']} kernels compiled, {summary['seconds']:.1f} s")
    return EXIT_OK


def add_precompile_parser(sub: Any) -> None:
    pre = sub.add_parser("precompile", help="compile a model's graphs into the store ahead "
                         "of time", description="TARGET is module:function (or "
                         "file.py:function) returning a model, run once per --shapes; or "
                         "a script.py, run as __main__ (its arguments after --) with "
                         "torch.compile using Kiln.")
    pre.add_argument("target")
    pre.add_argument("--shapes", nargs="+", type=parse_shapes, metavar="SHAPES",
                     help="one input shape set each: 8x128 or 8x128,128 (one per input)")
    pre.add_argument("--dtype", default="float32")
    pre.add_argument("--device", default="cpu")
    pre.add_argument("--train", action="store_true", help="also compile the backward")
    pre.add_argument("--option", action="append", type=parse_option, metavar="NAME=VALUE",
                     help="a torch.compile option for Kiln (e.g. cpu_backend=cpp)")
    pre.add_argument("--json", action="store_true", help="the summary as JSON")
    precompile_gpu.add_flags(pre)
    pre.set_defaults(func=cmd_precompile)


# ---------------------------------------------------------------------------------------
# Parser.


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kiln", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    add_precompile_parser(sub)
    precompile_gpu.add_versions_parser(sub)
    add_package_parser(sub)
    stats = sub.add_parser("stats", help="hits, misses, compiles, kernels, time saved")
    stats.add_argument("--json", action="store_true", help="one JSON object")
    stats.set_defaults(func=cmd_stats)
    inspect = sub.add_parser("inspect", help="an artifact: manifest, wrapper, kernels")
    inspect.add_argument("key")
    inspect.add_argument("--json", action="store_true", help="the manifest as JSON")
    inspect.add_argument("--source", metavar="KERNEL", help="print one kernel's source")
    inspect.add_argument("--no-wrapper", action="store_true")
    inspect.set_defaults(func=cmd_inspect)
    explain = sub.add_parser("explain-miss", help="which key part differs between two")
    explain.add_argument("a", help="a key, or a request saved with KILN_DEBUG=1")
    explain.add_argument("b")
    explain.set_defaults(func=cmd_explain_miss)
    gc = sub.add_parser("gc", help="collect the store by age and size")
    gc.add_argument("--max-age", type=parse_duration, help="e.g. 7d")
    gc.add_argument("--max-size", help="e.g. 10G")
    gc.add_argument("--dry-run", action="store_true")
    gc.set_defaults(func=cmd_gc)
    farm = sub.add_parser("farm", help="a Ray farm on this machine for local clients")
    farm.add_argument("action", choices=["up", "down", "status"])
    farm.add_argument("--num-cpus", type=int)
    farm.add_argument("--num-gpus", type=int)
    farm.add_argument("--port", type=int)
    farm.add_argument("--no-warm", action="store_true", help="do not start workers now")
    farm.add_argument("--json", action="store_true", help="status: the farm's counters")
    farm.set_defaults(func=cmd_farm)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:  # `kiln precompile train.py -- --epochs 1`: the script's own
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    args = build_parser().parse_args(argv)
    args.script_args = script_args
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
