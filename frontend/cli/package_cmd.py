"""``kiln package``: build an AOT package (``frontend.package.archive``) from the command line."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from kiln.frontend.cli.errors import EXIT_OK


def add_package_parser(sub: Any) -> None:
    from kiln.frontend.cli.targets import parse_dtype, parse_option, parse_shapes

    pkg = sub.add_parser("package", help="one file that runs a model with no Dynamo, "
                         "AOTAutograd or compile (kiln.load_package)",
                         description="TARGET is module:function (or file.py:function) "
                         "returning a model in eval mode; it is exported (torch.export) at "
                         "the --shapes given and compiled by Kiln.")
    pkg.add_argument("target")
    pkg.add_argument("--shapes", required=True, type=parse_shapes, metavar="SHAPES",
                     help="the input shapes: 8x128 or 8x128,128 (one per input)")
    pkg.add_argument("--dtype", type=parse_dtype, default="float32",
                     help="dtype of the inputs")
    pkg.add_argument("--device", default="cpu", help="cpu or cuda (this host's GPU)")
    pkg.add_argument("--gpu", metavar="TARGET", help="build for this GPU from any host: "
                     "sm_90, h200, a100, ... (fake CUDA tensors, cross-compiled kernels)")
    pkg.add_argument("--weights", action="store_true", help="put the weights in the file")
    pkg.add_argument("-o", "--output", required=True, help="the package file (model.kiln)")
    pkg.add_argument("--option", action="append", type=parse_option, metavar="NAME=VALUE",
                     help="a Kiln option (e.g. cpu_backend=cpp)")
    pkg.add_argument("--json", action="store_true", help="the summary as JSON")
    pkg.set_defaults(func=cmd_package)


def cmd_package(args: argparse.Namespace) -> int:
    output = _output_path(args.output)  # a bad -o fails at once, before torch is imported
    import torch

    from kiln.frontend.cli.errors import CliError, UsageError
    from kiln.frontend.cli.targets import load_entry
    from kiln.frontend.config import KilnConfig
    from kiln.frontend.core.compile import target_for
    from kiln.frontend.cross.fake_device import FakeDeviceError, parse_gpu
    from kiln.frontend.package.archive import PackageError, build_package, module_tensors

    try:
        target = parse_gpu(args.gpu) if args.gpu else target_for(torch.device(args.device))
    except FakeDeviceError as e:
        raise UsageError(str(e)) from None
    config = KilnConfig.resolve(dict(args.option or []))
    start = time.perf_counter()
    model = load_entry(args.target)().eval()
    weights = module_tensors(model) if args.weights else None
    model, inputs = _placed(model, args, target)
    try:
        data = build_package(model, inputs, target=target, config=config, weights=weights)
    except (PackageError, FakeDeviceError) as e:
        raise CliError(str(e)) from None
    try:
        output.write_bytes(data)
    except OSError as e:
        raise CliError(f"cannot write {args.output}: {e.strerror or e}") from None
    summary = {"output": args.output, "bytes": len(data), "target": target,
               "weights": bool(args.weights), "seconds": round(time.perf_counter() - start, 3)}
    print(json.dumps(summary, sort_keys=True) if args.json else
          f"wrote {args.output}: {len(data)} bytes for {_where(target)}"
          f"{' with weights' if args.weights else ''} in {summary['seconds']:.1f} s")
    return EXIT_OK


def _output_path(text: str) -> Path:
    """The package file to write, checked before anything compiles: its folder exists
    and this user may write there (UsageError, exit 2, otherwise)."""
    from kiln.frontend.cli.errors import UsageError

    path = Path(text).expanduser()
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise UsageError(f"-o {text}: is a folder; give the package file's name")
    if not folder.is_dir():
        raise UsageError(f"-o {text}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK):
        raise UsageError(f"-o {text}: the folder {folder} is not writable")
    return path


def _placed(model: Any, args: argparse.Namespace, target: dict[str, Any]) -> tuple[Any, Any]:
    """The model and random inputs on the target's device: real where this host has it,
    else fake (a GPU target on a host without one)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kiln.frontend.cli.targets import example_inputs
    from kiln.frontend.cross.fake_device import fake_inputs, fake_module

    dtype = getattr(torch, args.dtype)
    if target.get("kind") == "cuda" and not torch.cuda.is_available():
        from kiln.frontend.cross.cuda_guard_shim import ensure_fake_cuda_guard

        ensure_fake_cuda_guard()
        mode = FakeTensorMode()
        return fake_module(model, mode), fake_inputs(args.shapes, dtype, mode)
    device = "cuda" if target.get("kind") == "cuda" else "cpu"
    return model.to(device), example_inputs(args.shapes, args.dtype, device)


def _where(target: dict[str, Any]) -> str:
    return f"sm_{target['arch']}" if target.get("kind") == "cuda" else "cpu"
