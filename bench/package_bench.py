"""AOT package benchmark (H200 host): GPT-2 (HF config, random weights, fp16).

    python3 bench/package_bench.py [--batch 8] [--seq 512] [--reps 50] [--json OUT]
                                   [--gpu-less-build]

1. Build a package with its weights (``--gpu-less-build``: in a process that sees no GPU,
   as a CPU-only CI runner would, with cross-compiled cubins).
2. Load plus first output in fresh processes (median of 3): the clock starts after
   ``import torch`` and stops after ``torch.cuda.synchronize()`` on the first output.
   Target: at most 1 s.
3. Steady speed in one process: the loaded package vs the JIT path
   (``torch.compile(backend="kiln")`` on the same model and weights), median ms per call
   with CUDA events. Target: package / JIT at most 1.02. Outputs are compared with eager.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

_CACHE = tempfile.mkdtemp(prefix="kiln_pkg_bench_")
os.environ.setdefault("KILN_CACHE_DIR", os.path.join(_CACHE, "kiln"))
os.environ.setdefault("KILN_FARM", "inprocess")
os.environ.setdefault("KILN_STORE", "file://" + os.path.join(_CACHE, "store"))
os.environ.setdefault("KILN_STATS_FILE", "off")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

FIRST_OUTPUT = r"""
import json, sys, time
import torch
start = time.perf_counter()
import kiln
model = kiln.load_package(sys.argv[1])
ids = torch.randint(0, 50257, tuple(json.loads(sys.argv[2])), device="cuda")
out = model(ids)
torch.cuda.synchronize()
print(json.dumps({"load_first_output_s": time.perf_counter() - start}))
"""


class Logits(torch.nn.Module):
    """GPT-2 returning its logits only (no cache), as a package and the JIT both run."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, use_cache=False).logits  # type: ignore[no-any-return]


def gpt2() -> torch.nn.Module:
    """The benchmark's model: built on the CPU, seeded, fp16, eval."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return Logits(GPT2LMHeadModel(GPT2Config())).half().eval()


def build(path: Path, shape: tuple[int, int], gpu_less: bool) -> float:
    start = time.perf_counter()
    args = [sys.executable, "-m", "kiln.frontend.cli", "package", "bench.package_bench:gpt2",
            "--shapes", f"{shape[0]}x{shape[1]}", "--dtype", "int64", "--weights", "-o",
            str(path)] + (["--gpu", "sm_90"] if gpu_less else ["--device", "cuda"])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if gpu_less:
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"kiln package failed:\n{result.stderr[-4000:]}")
    return time.perf_counter() - start


def first_output(path: Path, shape: tuple[int, int]) -> float:
    times = []
    for _ in range(3):
        result = subprocess.run([sys.executable, "-c", FIRST_OUTPUT, str(path),
                                 json.dumps(list(shape))], cwd=ROOT, capture_output=True,
                                text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        if result.returncode != 0:
            sys.exit(f"loading the package failed:\n{result.stderr[-4000:]}")
        times.append(json.loads(result.stdout.strip().splitlines()[-1])["load_first_output_s"])
    return statistics.median(times)


def median_ms(fn: Any, ids: torch.Tensor, reps: int) -> float:
    for _ in range(5):
        fn(ids)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(ids)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def steady(path: Path, shape: tuple[int, int], reps: int) -> dict[str, Any]:
    import kiln
    from kiln.frontend.backend import KilnFallbackWarning

    model = gpt2().cuda()
    package = kiln.load_package(path)
    ids = torch.randint(0, 50257, shape, device="cuda")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", KilnFallbackWarning)
        jit = torch.compile(model, backend="kiln", dynamic=False)
        ref, out_jit, out_pkg = model(ids), jit(ids), package(ids)
        errors = {name: (out.float() - ref.float()).abs().max().item()
                  for name, out in (("jit", out_jit), ("package", out_pkg))}
        package_ms, jit_ms = median_ms(package, ids, reps), median_ms(jit, ids, reps)
    return {"package_ms": package_ms, "jit_ms": jit_ms, "ratio": package_ms / jit_ms,
            "max_abs_err_vs_eager": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--gpu-less-build", action="store_true")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    shape = (args.batch, args.seq)
    path = Path(_CACHE) / "gpt2.kiln"
    report: dict[str, Any] = {"model": f"GPT-2 fp16 {shape[0]}x{shape[1]}",
                              "gpu_less_build": args.gpu_less_build}
    report["build_s"] = build(path, shape, args.gpu_less_build)
    report["package_bytes"] = path.stat().st_size
    report["load_first_output_s"] = first_output(path, shape)
    report.update(steady(path, shape, args.reps))
    print(json.dumps(report, indent=2))
    print(f"load + first output {report['load_first_output_s']:.3f} s (target <= 1 s); "
          f"steady package {report['package_ms']:.3f} ms vs JIT {report['jit_ms']:.3f} ms "
          f"= {report['ratio']:.3f}x (target <= 1.02)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
