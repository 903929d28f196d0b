"""``kiln precompile`` as a fleet job: for a GPU this host does not have, and as a CI gate.

    kiln precompile models:make --gpu h200 --shapes 8x128 --shape-range 1..64x128
    kiln precompile models:make --gpu sm_90 --versions-from h200.json --json
    kiln precompile models:make --gpu h200 --shapes 8x128 --check     exit 1 if any missing

The model is built on the CPU and traced on fake tensors of the target's device
(``fake_device``), through the kiln backend's own Dynamo and AOTAutograd path, so each
graph's key is the one a client on that GPU computes. Each request then goes through the
client (``client.KilnClient``: the store, then the farm when one is up, else this
process); its kernels are cross-compiled for the target with heuristic configs, and
the artifact records ``autotuned: False``: tuning is left to GPU workers (the summary
counts those graphs as ``autotune_pending``): the farm's GPU autotuners when a farm is
up, else the store's autotune queue, which ``kiln precompile --gpu-worker`` drains on a
GPU host (``autotune_queue``). With ``--versions-from`` the keys carry the
target host's torch and triton versions (``kiln versions --json`` there) and the graphs
compile in this process, with this host's compiler, under those keys.

``--check`` compiles nothing: it lists the graphs missing from the store and exits 1 if
any is, for a CI gate.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kiln.frontend.cli.errors import EXIT_FAILED, EXIT_OK


def expand_shape_range(text: str) -> list[list[tuple[int, ...]]]:
    """``1..8x128,128`` -> one shape set per combination of the ranged sizes.

    A size is ``N``, ``A..B`` (powers of two from A up to B) or ``A..B:S`` (step S);
    inputs are separated by commas, as in ``--shapes``."""
    try:
        inputs = [[_sizes(dim) for dim in part.split("x")] for part in text.split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected shapes such as 1..64x128 (powers of two), 8..32:8x128 "
            "(a step) or 8x128,128 (one per input)") from None
    per_input = [list(itertools.product(*dims)) for dims in inputs]
    return [list(combo) for combo in itertools.product(*per_input)]


def _sizes(dim: str) -> list[int]:
    if ".." not in dim:
        return [int(dim)]
    low_text, _, rest = dim.partition("..")
    high_text, _, step_text = rest.partition(":")
    low, high = int(low_text), int(high_text)
    if low < 1 or high < low:
        raise ValueError(dim)
    if step_text:
        return list(range(low, high + 1, int(step_text)))
    sizes = []
    while low <= high:
        sizes.append(low)
        low *= 2
    return sizes


@dataclass
class GraphRecord:
    """What the job did for one graph of one shape set."""

    shapes: list[list[int]]
    graph: str
    key: str | None
    status: str  # hit, compiled, present, missing, not_keyed
    source: str = ""  # farm or local, for compiled graphs
    kernels: int = 0
    autotune_pending: bool = False
    autotune: str = ""  # tuned, farm, here, queued (for a GPU worker) or "" (nothing)
    notes: list[str] = field(default_factory=list)


def run_job(make_model: Callable[[], Any], shape_sets: Sequence[Sequence[Sequence[int]]],
            dtype: str, target: dict[str, Any], config: Any, *, check: bool = False,
            train: bool = False, versions: dict[str, Any] | None = None,
            runtime: dict[str, Any] | None = None,
            on_graph: Callable[[GraphRecord], None] | None = None) -> list[GraphRecord]:
    """Trace every shape set for ``target`` and check or compile each graph."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kiln.frontend.core.client import client_for
    from kiln.frontend.cross.fake_device import fake_inputs, fake_module, trace_requests

    client = client_for(config)
    device = "cuda" if target.get("kind") == "cuda" else "cpu"
    mode = FakeTensorMode(allow_non_fake_inputs=device == "cpu")
    model = make_model()
    if isinstance(model, torch.nn.Module):
        model = fake_module(model, mode, device)
    records = []
    for shapes in shape_sets:
        inputs = fake_inputs(shapes, getattr(torch, dtype), mode, device)
        for traced in trace_requests(model, inputs, config, target, versions=versions,
                                     runtime=runtime, train=train):
            record = GraphRecord([list(s) for s in shapes], traced.name, None, "not_keyed",
                                 notes=[*traced.notes, *([traced.reason] if traced.reason
                                                         else [])])
            if traced.request is not None:
                _check_or_compile(client, traced.request, record, check)
            records.append(record)
            if on_graph is not None:
                on_graph(record)
    return records


def _check_or_compile(client: Any, request: Any, record: GraphRecord, check: bool) -> None:
    from kiln.compiler.versions import versions as local_versions
    from kiln.frontend.core.keys import compute_key

    key = compute_key(request)
    record.key = key.key
    if check:
        record.status = "present" if client.store.contains(key.key) else "missing"
        return
    if request.versions == local_versions():
        result = client.compile(request, record.graph)
        record.status = "hit" if result.source == "hit" else "compiled"
        record.source = "" if result.source == "hit" else result.source
        compiled = result.compiled
    elif client.store.contains(key.key):
        record.status = "hit"
        return
    else:
        compiled = _compile_for_other_versions(client, key, request)
        record.status, record.source = "compiled", "local"
    record.kernels = len(compiled.binaries)
    record.autotune = _autotune_route(client, key.key, compiled, request.target,
                                      record.source)
    record.autotune_pending = record.autotune in ("farm", "here", "queued")


def _autotune_route(client: Any, key: str, compiled: Any, target: dict[str, Any],
                    source: str) -> str:
    """Who tunes the graph: ``tuned`` already, the ``farm``'s GPU autotuners or a GPU
    ``here`` (the client tunes in the background and publishes), else ``queued`` in the
    store for ``kiln precompile --gpu-worker`` (``""``: nothing to tune)."""
    from kiln.frontend.cli.autotune_queue import queue_for_gpu

    if compiled.autotuned:
        return "tuned"
    if compiled.stats.get("autotune_pending") and source in ("farm", "local"):
        return "farm" if source == "farm" else "here"
    return "queued" if queue_for_gpu(client.store, key, compiled, target) else ""


def _compile_for_other_versions(client: Any, key: Any, request: Any) -> Any:
    """Compile here, with this host's versions, and publish under the key that carries
    the target host's versions (the farm's workers refuse foreign versions)."""
    from kiln.compiler.versions import versions as local_versions
    from kiln.workers.artifact import to_artifact

    start = time.perf_counter()
    compiled = client.local.compile(key.key, replace(request, versions=local_versions()))
    info = {"wall_s": time.perf_counter() - start, "mode": "local",
            "farm": "kiln precompile --versions-from", "autotune": "pending",
            "built_with": dict(local_versions()),
            "graph_compile_s": compiled.timings.get("graph_compile", 0.0),
            "kernel_compile_s": compiled.timings.get("kernel_compile", 0.0)}
    client.store.publish(to_artifact(key, request, compiled, info))
    return compiled


def summarize(records: Sequence[GraphRecord], target: dict[str, Any], seconds: float
              ) -> dict[str, Any]:
    counts = {status: sum(r.status == status for r in records)
              for status in ("hit", "compiled", "present", "missing", "not_keyed")}
    return {"target": target, "graphs": len(records), **counts,
            "farm": sum(r.source == "farm" for r in records),
            "local": sum(r.source == "local" for r in records),
            "kernels": sum(r.kernels for r in records),
            "autotune_pending": sum(r.autotune_pending for r in records),
            "autotune_queued": sum(r.autotune == "queued" for r in records),
            "seconds": round(seconds, 3), "records": [asdict(r) for r in records]}


# ---------------------------------------------------------------------------------------
# The command's hooks (cli.py calls these).


def add_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu", metavar="TARGET", help="precompile for this GPU from any "
                        "host (fake CUDA tensors): sm_90, sm_80, or h200, h100, a100, ...")
    parser.add_argument("--versions-from", metavar="FILE", help="key with the torch and "
                        "triton versions of the target host (`kiln versions --json` there)")
    parser.add_argument("--shape-range", action="append", type=expand_shape_range,
                        metavar="RANGE", help="shape sets from ranges: 1..64x128 (powers "
                        "of two), 8..32:8x128 (step 8)")
    parser.add_argument("--gpu-worker", action="store_true", help="on a GPU host: tune "
                        "the graphs queued in the store by precompiles without a GPU, and "
                        "publish them (no TARGET)")
    parser.add_argument("--limit", type=int, metavar="N", help="--gpu-worker: at most N "
                        "queued graphs")
    parser.add_argument("--check", action="store_true", help="compile nothing: list the "
                        "graphs missing from the store; exit 1 if any is (a CI gate)")


def wants_job(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "gpu", None) or getattr(args, "check", False)
                or getattr(args, "shape_range", None) or getattr(args, "versions_from", None))


def cmd_job(args: argparse.Namespace) -> int:
    """``kiln precompile`` with --gpu, --check, --shape-range or --versions-from."""
    import torch

    from kiln.frontend.cli.errors import CliError, UsageError
    from kiln.frontend.cli.targets import MODES, load_entry
    from kiln.frontend.config import KilnConfig
    from kiln.frontend.core.compile import target_for
    from kiln.frontend.cross.fake_device import (
        FakeDeviceError,
        load_runtime,
        load_versions,
        parse_gpu,
    )

    shape_sets = list(args.shapes or []) + [s for r in args.shape_range or [] for s in r]
    if ":" not in args.target or not shape_sets:
        raise UsageError("--gpu, --check, --shape-range and --versions-from need a "
                         "module:function target and --shapes or --shape-range")
    device = args.device or "cpu"
    if device.startswith("cuda") and not args.gpu and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available here; use --gpu")
    try:
        target = parse_gpu(args.gpu) if args.gpu else target_for(torch.device(device))
        versions = load_versions(args.versions_from) if args.versions_from else None
        runtime = load_runtime(args.versions_from) if args.versions_from else None
    except FakeDeviceError as e:
        raise UsageError(str(e)) from None
    start, records = time.perf_counter(), []
    config = KilnConfig.resolve(dict(args.option or []))
    try:
        for kind in MODES[args.mode or "inference"]:
            records += run_job(load_entry(args.target), shape_sets, args.dtype or "float32",
                               target, config, check=args.check, train=kind == "train",
                               versions=versions, runtime=runtime,
                               on_graph=None if args.json else _print_record)
    except FakeDeviceError as e:
        raise CliError(str(e)) from None
    summary = summarize(records, target, time.perf_counter() - start)
    if args.json:
        print(json.dumps(summary, sort_keys=True))
    else:
        _print_summary(summary, args.check)
    return EXIT_FAILED if summary["missing"] or summary["not_keyed"] else EXIT_OK


def _print_record(record: GraphRecord) -> None:
    shapes = ",".join("x".join(map(str, s)) for s in record.shapes)
    key = (record.key or "-")[:16]
    print(f"  {shapes:<20} {record.graph:<14} {key:<16} {record.status}"
          f"{' (' + record.source + ')' if record.source else ''}"
          + "".join(f"\n    note: {n}" for n in record.notes), file=sys.stderr)


def _print_summary(summary: dict[str, Any], check: bool) -> None:
    target = summary["target"]
    where = f"sm_{target['arch']}" if target.get("kind") == "cuda" else "cpu"
    if check:
        print(f"{summary['graphs']} graphs for {where}: {summary['present']} in the store, "
              f"{summary['missing']} missing, {summary['not_keyed']} cannot be keyed")
        return
    print(f"precompiled {summary['graphs']} graphs for {where}: {summary['hit']} already "
          f"in the store, {summary['compiled']} compiled ({summary['farm']} on the farm, "
          f"{summary['local']} here), {summary['not_keyed']} cannot be keyed; "
          f"{summary['kernels']} kernels, {summary['autotune_pending']} graphs left for "
          f"GPU autotuning ({summary['autotune_queued']} queued for "
          f"`kiln precompile --gpu-worker`); {summary['seconds']:.1f} s")


def add_versions_parser(sub: Any) -> None:
    versions = sub.add_parser("versions", help="the versions keys carry (Kiln, compiler "
                              "sources, torch, triton): for precompile --versions-from")
    versions.add_argument("--json", action="store_true", help="one JSON object")
    versions.set_defaults(func=cmd_versions)


def cmd_versions(args: argparse.Namespace) -> int:
    """The versions keys carry, plus (``runtime``, not in keys) this host's CUDA and
    cuDNN versions, which decide the attention kernel a precompile must model."""
    from kiln.frontend.core.keys import versions
    from kiln.frontend.cross.sdpa_model import host_runtime

    mine, runtime = versions(), host_runtime()
    if args.json:
        print(json.dumps({**mine, "runtime": runtime}, sort_keys=True))
    else:
        for name, value in {**mine, **runtime}.items():
            print(f"{name:<10} {value}")
    return EXIT_OK
