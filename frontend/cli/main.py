"""The ``kiln`` command.

    kiln precompile TARGET [--shapes 8x128 16x128,128] [--mode inference|train|both]
        [--gpu h200] [--versions-from F] [--shape-range 1..64x128] [--check]
                                                         ... for a GPU this host lacks
    kiln package TARGET --shapes 8x128 -o model.kiln     one file that runs without Dynamo
    kiln versions [--json]                               what keys carry (--versions-from)
    kiln stats [--json] [--reset]                        hits, misses, compiles, time saved
    kiln inspect KEY [--json] [--source KERNEL]          manifest, wrapper, kernels, lifetimes
    kiln explain-miss A B                                which key parts differ, in words
    kiln gc [--max-age 7d] [--max-size 10G] [--dry-run]  collect the store
    kiln farm up|down|status [--json]                    a Ray farm on this machine
    kiln trace summary PATH [--json]                     a KILN_TRACE timeline's critical path
    kiln --version

Every command reads the same ``KILN_*`` variables as the backend (``KILN_STORE``,
``KILN_FARM``, ...), checked by ``frontend.config``: a bad one is a one-line warning and
its default. A KEY may be given by its first characters where they name one key.

Exit status: 0 on success; 1 when the command could not do its work (a store it cannot
open, a key not found or damaged, a farm that will not start or cannot be reached, a
precompile that published nothing or ran a graph eagerly); 2 on bad usage (an unknown
command, flag, option or value, a target that does not exist, an ambiguous key prefix).
Every error is one line on stderr, never a traceback (``KILN_DEBUG=1`` adds it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from kiln.artifact_store import (
    ConfigError,
    Store,
    default_stats_file,
    open_store,
    read_stats,
    summarize,
)
from kiln.frontend.cli.entries import describe_entry
from kiln.frontend.cli.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, CliError, UsageError
from kiln.frontend.config import KilnConfig

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}
_HEX = re.compile(r"^[0-9a-f]+$")
KEY_LENGTH = 64


def parse_duration(text: str) -> float:
    """Seconds from ``90``, ``30m``, ``12h``, ``7d``, ``2w``."""
    match = _DURATION.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a duration such as 12h or 7d")
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_size_arg(text: str) -> int:
    from kiln.artifact_store.config import parse_size

    try:
        return parse_size(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a size such as 10G, 512M or 1000000") from None


def parse_port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a port from 1 to 65535")
    return int(text)


def _print_json(value: Any) -> None:
    print(json.dumps(value, indent=2, sort_keys=True, default=str))


def _config() -> KilnConfig:
    return KilnConfig.resolve()


def open_cli_store(*, read_only: bool) -> Store:
    """The configured store, or CliError saying why it cannot be opened (a bad URL, a
    missing file system, a folder that does not exist)."""
    kwargs = _config().store_kwargs()
    if read_only:
        kwargs["read_only"] = True
    try:
        store = open_store(**kwargs, strict=True)
    except ConfigError as e:
        raise CliError(f"cannot open the store: {e}") from None
    reason = store.unusable_reason()
    if reason is not None:
        raise CliError(f"cannot open the store: {reason} (KILN_STORE)")
    return store


def resolve_key(store: Store, ref: str) -> str:
    """A full key from a key or its first characters (unique in the store)."""
    text = ref.strip().lower()
    if not _HEX.match(text) or len(text) > KEY_LENGTH:
        raise UsageError(f"{ref!r} is not a key (hex digits, or their first few)")
    if len(text) == KEY_LENGTH:
        return text
    errors: list[str] = []
    found = store.keys(text, errors)
    if not found and errors:
        raise CliError(f"cannot open the store: {'; '.join(errors)}")
    if not found:
        raise CliError(f"no artifact with a key starting {text} in {store.url}")
    if len(found) > 1:
        shown = ", ".join(k[:len(text) + 4] + "..." for k in found[:4])
        raise UsageError(f"key prefix {text} is ambiguous: {len(found)} keys start with it "
                         f"({shown}); give more characters")
    return found[0]


# ---------------------------------------------------------------------------------------
# stats


CLIENT_COUNTERS = ("graphs", "compiles", "compiles_farm", "compiles_local", "farm_fallbacks",
                   "compile_errors", "load_errors", "kernels_compiled", "compile_seconds",
                   "time_saved_s", "hits_autotuned", "autotune_publishes",
                   "kernels_from_store", "farm_not_up", "aot_hits", "aot_misses",
                   "aot_traces", "aot_uncached", "aot_publishes", "aot_rejected",
                   "hot_swaps", "bucket_tunes", "inference_direct", "gemm_problems",
                   "gemm_cached", "gemm_benchmarked", "gemm_untuned")
STORE_COUNTERS = ("publishes", "publish_failures", "integrity_failures", "signature_failures",
                  "claims", "claim_takeovers", "claim_waits", "claim_wait_seconds",
                  "claim_deadlines", "claim_errors")


def stats_summary(data: dict[str, Any], stats_file: str | None = None) -> dict[str, Any]:
    """One object from the stats file: store hits and misses per tier, client counters;
    every counter present (zeros included)."""
    store, client = data.get("store") or {}, data.get("client") or {}
    tiers = store.get("tiers") or {}
    summary: dict[str, Any] = {
        "enabled": stats_file is not None, "stats_file": stats_file,
        "since": store.get("since"), "updated": data.get("updated"),
        "hits": {"total": store.get("hits", 0),
                 **{name: tier.get("hits", 0) for name, tier in tiers.items()}},
        "misses": {"total": store.get("misses", 0),
                   **{name: tier.get("misses", 0) for name, tier in tiers.items()}},
    }
    for name in CLIENT_COUNTERS:
        summary[name] = client.get(name, 0)
    summary["graph_hits"] = client.get("hits", 0)  # graphs loaded from the store
    summary["tuned_took_over_after_ms"] = client.get("tuned_took_over_after_ms", 0)
    summary["tuned_took_over_after_max_ms"] = client.get("tuned_took_over_after_max_ms", 0)
    share = client.get("gpu_share")
    summary["gpu_share"] = share if isinstance(share, dict) else {}
    for name in STORE_COUNTERS:
        summary[name] = store.get(name, 0)
    summary["store"] = summarize(store)
    return summary


def print_gpu_share(summary: dict[str, Any]) -> None:
    """Tuning on a GPU the program ran on: its turns, the calls it slowed and by how
    much, and how long after a graph's first output its tuned kernels took over."""
    swaps, after = summary["hot_swaps"], summary["tuned_took_over_after_ms"]
    if swaps and after:
        print(f"tuned took over {after / swaps / 1000:.2f} s after a graph's first output on "
              f"average, {summary['tuned_took_over_after_max_ms'] / 1000:.2f} s at most")
    for gpu, c in sorted(summary["gpu_share"].items()):
        if not isinstance(c, dict):
            continue
        slowed = c.get("slowed_calls", 0)
        print(f"tuning on GPU   {gpu}: {c.get('turns', 0)} turns, "
              f"{c.get('turn_ms', 0.0) / 1000:.2f} s; {slowed} of {c.get('calls_timed', 0)} "
              f"calls slowed, {c.get('slowed_ms', 0.0):.1f} ms in all, at most "
              f"{c.get('worst_extra_max_ms', 0.0):.2f} ms in one call "
              f"(first turn {_clock(c.get('since'))}, last {_clock(c.get('updated'))})")


def _clock(when: Any) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when)) if isinstance(
        when, (int, float)) and when > 0 else "-"


def _stats_file() -> str | None:
    """Where the counters are, or None when KILN_STATS_FILE turns them off."""
    chosen = _config().store_kwargs()["stats_file"]
    if chosen is False:
        return None
    return os.path.expanduser(chosen) if chosen else default_stats_file()


def cmd_stats(args: argparse.Namespace) -> int:
    path = _stats_file()
    if args.reset:
        return _reset_stats(path)
    summary = stats_summary(read_stats(path) if path else {}, path)
    if args.json:
        print(json.dumps(summary, sort_keys=True, default=str))
        return EXIT_OK
    if path is None:
        print("stats are off (KILN_STATS_FILE=off): nothing is counted; unset it to count")
        return EXIT_OK
    hits, misses = summary["hits"], summary["misses"]
    tiers = ", ".join(f"{k} {v}" for k, v in hits.items() if k != "total")
    exists = "" if os.path.exists(path) else " (nothing counted yet)"
    print(f"stats file      {path}{exists}")
    print(f"store lookups   {hits['total']} hits ({tiers or 'no tiers'}), "
          f"{misses['total']} misses")
    print(f"graphs          {summary['graphs']} ({summary['compiles']} compiled: "
          f"{summary['compiles_farm']} on the farm, {summary['compiles_local']} locally)")
    print(f"kernels         {summary['kernels_compiled']} compiled")
    print(f"autotuning      {summary['autotune_publishes']} tuned artifacts published; "
          f"{summary['hot_swaps']} switches to tuned kernels in running processes; "
          f"{summary['bucket_tunes']} size buckets tuned")
    print_gpu_share(summary)
    print(f"max-autotune    {summary['gemm_problems']} GEMM problems: "
          f"{summary['gemm_benchmarked']} benchmarked, {summary['gemm_cached']} choices from "
          f"the store, {summary['gemm_untuned']} left to the library call untuned")
    print(f"AOT cache       {summary['aot_hits']} Dynamo graphs served with no AOTAutograd "
          f"trace, {summary['aot_traces']} traced ({summary['aot_misses']} misses, "
          f"{summary['aot_uncached']} not cacheable, {summary['aot_rejected']} rejected); "
          f"{summary['inference_direct']} traced inference graphs called with no AOT "
          "runtime wrapper")
    print(f"claims          {summary['claims']} keys claimed before compiling, "
          f"{summary['claim_takeovers']} taken over from a dead holder; "
          f"{summary['claim_waits']} waits on another process's claim "
          f"({summary['claim_wait_seconds']:.1f} s, {summary['claim_deadlines']} ran out)")
    print(f"compile time    {summary['compile_seconds']:.1f} s; "
          f"time saved by hits {summary['time_saved_s']:.1f} s")
    print(f"problems        {summary['farm_fallbacks']} farm fallbacks, "
          f"{summary['compile_errors']} compile errors, {summary['load_errors']} load errors, "
          f"{summary['integrity_failures']} damaged artifacts")
    return EXIT_OK


def _reset_stats(path: str | None) -> int:
    from kiln.artifact_store import reset_stats

    if path is None:
        print("stats are off (KILN_STATS_FILE=off): nothing to reset")
        return EXIT_OK
    try:
        removed = reset_stats(path)
    except OSError as e:
        raise CliError(f"cannot reset the counters in {path}: {e.strerror or e}") from None
    print(f"counters reset: {path} removed; counting starts again from zero" if removed
          else f"nothing to reset: {path} holds no counters yet")
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


_LOOKUP_FAILURES = {
    "missing": "no artifact {key} in {url}",
    "damaged": "artifact {key} in {url} is damaged: {detail}",
    "refused": "artifact {key} in {url} is refused: {detail}",
    "unsupported": "artifact {key} in {url} was written by a newer Kiln: {detail}",
    "unavailable": "cannot open the store: {detail}",
    "invalid": "{detail}",
}


def find_artifact(store: Store, ref: str) -> Any:
    """The artifact a key (or unique prefix) names; CliError telling a missing artifact
    from a damaged, refused or unreadable one."""
    key = resolve_key(store, ref)
    store_log = logging.getLogger("kiln.artifact_store")
    level = store_log.level
    store_log.setLevel(logging.ERROR)  # the store's own warning would repeat ours
    try:
        found = store.lookup(key)
    finally:
        store_log.setLevel(level)
    if found.artifact is None:
        detail = "; ".join(d for kind, d in found.problems if kind == found.status)
        message = _LOOKUP_FAILURES[found.status]
        raise CliError(message.format(key=key, url=store.url, detail=detail))
    return found.artifact


def cmd_inspect(args: argparse.Namespace) -> int:
    with open_cli_store(read_only=True) as store:
        artifact = find_artifact(store, args.key)
        described = store.describe(artifact.key)
    if described is None:
        raise CliError(f"artifact {artifact.key} changed while it was read; try again")
    manifest = artifact.manifest
    if args.source:
        entries = [e for e in manifest.get("kernels") or [] if e["name"] == args.source]
        if not entries:
            names = ", ".join(e["name"] for e in manifest.get("kernels") or []) or "none"
            raise CliError(f"no kernel {args.source} in artifact {artifact.key}; its "
                           f"kernels: {names}")
        print(artifact.blobs[entries[0]["source_blob"]].decode())
        return EXIT_OK
    if args.json:
        _print_json({**described, "meta": manifest})
        return EXIT_OK
    entry = describe_entry(artifact.key, manifest)
    if entry is not None:  # not a compiled graph: an AOT entry, a plan, a kernel, ...
        print("\n".join(entry))
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


def _side_of(ref: str, store: Store | None) -> tuple[dict[str, str], dict[str, Any]]:
    """(key parts, recorded parts) of one side of explain-miss: a request saved by
    KILN_DEBUG (its folder, request.msgpack or key.json), or a key (or prefix) in the
    store, whose manifest records the parts."""
    path = Path(ref)
    if path.is_dir():
        path = path / "request.msgpack"
    if path.name == "key.json" and path.is_file():
        try:
            saved = json.loads(path.read_text())
            parts = dict(saved["parts"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CliError(f"{ref}: not a key.json written by KILN_DEBUG ({e})") from None
        beside = path.with_name("request.msgpack")
        if not beside.is_file():
            return parts, {}
        path = beside
    if path.is_file():
        from kiln.compiler.request import CompileRequest, SerializationError
        from kiln.frontend.core.keys import compute_key, recorded_parts

        try:
            request = CompileRequest.from_bytes(path.read_bytes())
        except (OSError, SerializationError, ValueError) as e:
            raise CliError(f"{ref}: not a request saved by KILN_DEBUG ({e})") from None
        # the graph's bytes too, for where two saved graphs differ (not in manifests)
        return compute_key(request).parts, {**recorded_parts(request),
                                            "graph_request": request.graph}
    if os.sep in ref or ref.endswith((".json", ".msgpack")):
        raise UsageError(f"no such file or folder: {ref}")
    if store is None:
        raise CliError(f"{ref} is not a saved request, and the store cannot be opened")
    artifact = find_artifact(store, ref)
    manifest = artifact.manifest
    return dict(manifest.get("key_parts", {})), manifest


def cmd_explain_miss(args: argparse.Namespace) -> int:
    from kiln.frontend.core.keys import describe_differences, explain_miss

    needs_store = [ref for ref in (args.a, args.b) if not Path(ref).exists()]
    store = open_cli_store(read_only=True) if needs_store else None
    try:
        (parts_a, recorded_a), (parts_b, recorded_b) = (_side_of(r, store)
                                                        for r in (args.a, args.b))
    finally:
        if store is not None:
            store.close()
    lines = explain_miss(parts_a, parts_b)
    if not lines:
        print("the keys are equal: every part matches")
        return EXIT_OK
    print("\n".join(lines))
    detail = describe_differences(recorded_a, recorded_b)
    graphs = [recorded.get("graph_request") for recorded in (recorded_a, recorded_b)]
    if graphs[0] is not None and graphs[1] is not None:
        from kiln.compiler.request import graph_difference

        where = graph_difference(graphs[0], graphs[1])
        if where is not None:
            detail.append(f"graph: {where}")
    if detail:
        print("\n".join(["", "in detail:"] + [f"  {line}" for line in detail]))
    return EXIT_OK


# ---------------------------------------------------------------------------------------
# gc


def cmd_gc(args: argparse.Namespace) -> int:
    with open_cli_store(read_only=False) as store:
        if store.read_only:
            raise CliError(f"the store {store.url} is read-only (KILN_STORE_READ_ONLY=1): "
                           "gc cannot remove anything")
        report = store.gc(max_age_s=args.max_age, max_bytes=args.max_size,
                          dry_run=args.dry_run)
    _print_json({"store": store.url, "dry_run": args.dry_run, "report": report})
    errors = [f"{tier}: {r['error']}" for tier, r in report.items()
              if isinstance(r, dict) and "error" in r]
    if errors:
        raise CliError("gc failed for " + "; ".join(errors))
    return EXIT_OK


# ---------------------------------------------------------------------------------------
# farm


def cmd_farm(args: argparse.Namespace) -> int:
    from kiln.workers.serve import cluster as farm_cluster
    from kiln.workers.serve.farm_files import farm_file

    if args.action == "up":
        try:
            info = farm_cluster.start_local_cluster(
                num_cpus=args.num_cpus, num_gpus=args.num_gpus, port=args.port, host=args.host,
                join_now=not args.no_warm)
        except (OSError, RuntimeError, TimeoutError) as e:
            raise CliError(str(e)) from None
        if info.get("differs"):  # never silently a farm other than the one asked for
            raise CliError(f"a farm is already up at {info['address']} with "
                           f"{', '.join(info['differs'])}: `kiln farm down`, then `kiln "
                           "farm up` again to change it")
        if not args.no_warm and not info.get("gateway"):
            _warm_farm(str(info["address"]))  # no gateway: clients join Ray, warm it here
        state = "already running" if info.get("already_running") else "started"
        print(f"farm {state} at {info['address']} (address in {farm_file()}; Ray's "
              f"logs in {info.get('temp_dir') or info.get('log')})")
        print(f"gateway for local clients at {info['gateway']} (no Ray in the client"
              f"{'' if args.no_warm else '; the workers start in the background'})"
              if info.get("gateway") else "no gateway: local clients join Ray")
        print(farm_cluster.auth_instructions(info))
        return EXIT_OK
    if args.action == "down":
        stopped = farm_cluster.stop_local_cluster()
        if stopped is None:
            print("no farm is up")
        elif stopped.get("stale"):
            print(f"no farm is up: removed the stale {farm_file()} (for "
                  f"{stopped['address']}: {stopped['stale']}); nothing was stopped")
        else:
            print(f"farm at {stopped['address']} stopped")
        return EXIT_OK
    return _farm_status(args)


def _farm_status(args: argparse.Namespace) -> int:
    """The farm clients use: KILN_FARM's address, else the one of `kiln farm up`."""
    from kiln.frontend.transports.modes import farm_status

    status = farm_status(_config().farm)
    if args.json:
        print(json.dumps(status, sort_keys=True))
    elif status["up"]:
        counters = status["counters"]
        print(f"farm at {status['address']}: up ({counters['requests']} requests, "
              f"{counters['graph_compiles']} graphs and {counters['kernel_compiles']} "
              "kernels compiled)")
    else:
        where = f" at {status['address']}" if status["address"] else ""
        print(f"farm{where}: down: {status['reason']}")
    return EXIT_OK if status["up"] else EXIT_FAILED


def _warm_farm(address: str) -> None:
    """Start the coordinator and its workers now, so the first miss finds them warm."""
    import ray

    from kiln.workers.farm_api import FarmUnavailable
    from kiln.workers.ray_farm import RayFarm, use_farm_token
    from kiln.workers.serve.farm_files import read_farm_file

    use_farm_token(read_farm_file() or {})
    try:
        actor = RayFarm(address).actor()
        ray.get(actor.wait_warm.remote(), timeout=300)
    except (FarmUnavailable, ray.exceptions.RayError) as e:
        raise CliError(f"the farm at {address} started but its workers did not: {e}") \
            from None
    finally:
        ray.shutdown()


# ---------------------------------------------------------------------------------------
# Parser.


class Parser(argparse.ArgumentParser):
    """argparse, with usage errors as one line and exit status 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    from kiln import __version__
    from kiln.frontend.cli.precompile import add_precompile_parser

    parser = Parser(prog="kiln", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version", version=f"kiln {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    add_precompile_parser(sub)
    from kiln.frontend.cli.package_cmd import add_package_parser
    from kiln.frontend.cli.precompile_gpu import add_versions_parser

    add_versions_parser(sub)
    add_package_parser(sub)
    stats = sub.add_parser("stats", help="hits, misses, compiles, kernels, time saved")
    stats.add_argument("--json", action="store_true", help="one JSON object")
    stats.add_argument("--reset", action="store_true",
                       help="set every counter back to zero (removes the stats file)")
    stats.set_defaults(func=cmd_stats)
    inspect = sub.add_parser("inspect", help="an artifact: manifest, wrapper, kernels")
    inspect.add_argument("key", help="a key, or its first characters")
    inspect.add_argument("--json", action="store_true", help="the manifest as JSON")
    inspect.add_argument("--source", metavar="KERNEL", help="print one kernel's source")
    inspect.add_argument("--no-wrapper", action="store_true")
    inspect.set_defaults(func=cmd_inspect)
    explain = sub.add_parser("explain-miss", help="which key parts differ between two")
    explain.add_argument("a", help="a key (or its first characters), or a KILN_DEBUG "
                         "folder, its request.msgpack or key.json")
    explain.add_argument("b")
    explain.set_defaults(func=cmd_explain_miss)
    gc = sub.add_parser("gc", help="collect the store by age and size")
    gc.add_argument("--max-age", type=parse_duration, help="e.g. 7d")
    gc.add_argument("--max-size", type=parse_size_arg, help="e.g. 10G")
    gc.add_argument("--dry-run", action="store_true")
    gc.set_defaults(func=cmd_gc)
    farm = sub.add_parser("farm", help="a Ray farm on this machine for local clients")
    farm.add_argument("action", choices=["up", "down", "status"])
    farm.add_argument("--num-cpus", type=int)
    farm.add_argument("--num-gpus", type=int)
    farm.add_argument("--port", type=parse_port, help="up: the head's port (checked free)")
    farm.add_argument("--host", help="up: the address other machines join the farm by "
                      "(default: this machine only); Ray token auth is on either way")
    farm.add_argument("--no-warm", action="store_true", help="do not start workers now")
    farm.add_argument("--json", action="store_true", help="status: one JSON object")
    farm.set_defaults(func=cmd_farm)
    from kiln.frontend.trace import add_trace_parser

    add_trace_parser(sub)
    return parser


def _show_warning(message: Any, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    """Warnings as one line each: Kiln's own as they are, others with their category."""
    text = str(message).strip().replace("\n", " ")
    if text.startswith("kiln: "):
        text = text.removeprefix("kiln: ")
    else:
        text = f"{category.__name__}: {text}"
    print(f"warning: {text}", file=sys.stderr if file is None else file)


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's last flush of a closed pipe
    prints nothing at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """The ``kiln`` command; returns the exit status (module docstring)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:  # `kiln precompile train.py -- --epochs 1`: the script's own
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1:]
    command = next((a for a in argv if not a.startswith("-")), "")
    prog = f"kiln {command}".strip()
    saved = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        args = build_parser().parse_args(argv)
        args.script_args = script_args
        func: Callable[[argparse.Namespace], int] = args.func
        status = func(args)
        sys.stdout.flush()  # a closed pipe is seen here, not at the interpreter's exit
        return status
    except CliError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kiln ... --json | head`: the reader has all it wanted
        _quiet_stdout()
        return EXIT_OK
    except Exception as e:  # a bug: still one line, the traceback only when asked
        if _config().debug:
            import traceback

            traceback.print_exc()
        text = (str(e).strip().splitlines() or [""])[0]
        print(f"{prog}: unexpected {type(e).__name__}: {text} (KILN_DEBUG=1 shows the "
              "traceback)", file=sys.stderr)
        return EXIT_FAILED
    finally:
        warnings.showwarning = saved


__all__ = ["EXIT_FAILED", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]


if __name__ == "__main__":
    sys.exit(main())
