"""AOT package benchmark: load + first output, and steady speed against the JIT path.

    python3 bench/package_bench.py [--device cuda|cpu] [--smoke] [--batch 8] [--seq 512]
                                   [--reps 50] [--gpu-less-build] [--threads N]
                                   [--json OUT]

Model: GPT-2 (transformers' GPT2LMHeadModel, default config, random weights, seeded)
returning its logits; fp16 on a GPU, fp32 on the CPU. Without transformers, a stand-in
of the same structure and sizes (token and position embeddings, 12 pre-norm blocks of
causal SDPA and a tanh-GELU MLP, the LM head tied to the embedding); ``--smoke``: the
stand-in at 2 layers, width 64, vocab 512, 1x32 tokens (a CPU check of the bench itself).

1. Build a package with its weights (``kiln package``; ``--gpu-less-build``: in a process
   that sees no GPU, as a CPU-only CI runner would, with cross-compiled cubins).
2. Load plus first output in fresh processes (median of 3): the clock starts after
   ``import torch`` and stops when the first output is ready (after a CUDA sync).
   Target: at most 1 s.
3. Steady speed in one process: the loaded package vs the JIT path
   (``torch.compile(backend="kiln")``, same model and weights), median ms per call
   (CUDA events on a GPU). Target: package / JIT at most 1.02. Both outputs are compared
   with eager (the run fails if either differs, or if the JIT falls back).

Output: one line per row on stdout, flushed as each is measured; ``--json OUT`` gets the
report after every step, so a run cut short keeps what it measured. A failing build
or load prints only the last 2000 characters of its stderr.
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
import torch.nn.functional as F  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# Kiln's tree first, then the caller's PYTHONPATH (where the GPU host's Ray is installed)
PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
MODEL_ENV = "PACKAGE_BENCH_MODEL"  # {"smoke": bool, "dtype": "float16"} for gpt2()

FIRST_OUTPUT = r"""
import json, sys, time
import torch
start = time.perf_counter()
import kiln
model = kiln.load_package(sys.argv[1], allow_unsigned=True)
device, shape, vocab = sys.argv[2], tuple(json.loads(sys.argv[3])), int(sys.argv[4])
ids = torch.randint(0, vocab, shape, device=device)
out = model(ids)
if device == "cuda":
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


class StandInBlock(torch.nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.c_attn, self.c_proj = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width,
                                                                                     width)
        self.c_fc, self.mlp_proj = torch.nn.Linear(width, 4 * width), torch.nn.Linear(
            4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.c_proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class StandIn(torch.nn.Module):
    """GPT-2's structure without transformers (the bench's model on hosts without it)."""

    def __init__(self, vocab: int, context: int, width: int, layers: int, heads: int) -> None:
        super().__init__()
        self.wte, self.wpe = torch.nn.Embedding(vocab, width), torch.nn.Embedding(context,
                                                                                 width)
        self.blocks = torch.nn.ModuleList(StandInBlock(width, heads) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(width)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.t()


def model_settings() -> dict[str, Any]:
    return dict(json.loads(os.environ.get(MODEL_ENV, "{}")))


def has_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def gpt2() -> torch.nn.Module:
    """The benchmark's model, built on the CPU, seeded, eval (``MODEL_ENV`` says which)."""
    settings = model_settings()
    dtype = getattr(torch, settings.get("dtype", "float16"))
    torch.manual_seed(0)
    if settings.get("smoke"):
        model: torch.nn.Module = StandIn(512, 64, 64, 2, 2)
    elif has_transformers():
        from transformers import GPT2Config, GPT2LMHeadModel

        model = Logits(GPT2LMHeadModel(GPT2Config()))
    else:
        model = StandIn(50257, 1024, 768, 12, 12)
    return model.to(dtype).eval()


def vocab_size() -> int:
    return 512 if model_settings().get("smoke") else 50257


class Report:
    """Rows printed as measured, and the JSON file rewritten after each."""

    def __init__(self, path: str | None, header: dict[str, Any]) -> None:
        self.path, self.data = path, dict(header)
        print("package_bench: " + ", ".join(f"{k}={v}" for k, v in header.items()), flush=True)
        self._save()

    def row(self, name: str, value: Any, target: str = "", ok: bool | None = None) -> None:
        self.data[name] = value
        shown = f"{value:.4g}" if isinstance(value, float) else str(value)
        verdict = "" if ok is None else ("ok" if ok else "MISSED")
        print(f"{name:<24} {shown:>12}  {target:<12} {verdict}".rstrip(), flush=True)
        if ok is not None:
            self.data.setdefault("targets", {})[name] = ok
        self._save()

    def _save(self) -> None:
        if self.path:
            Path(self.path).write_text(json.dumps(self.data, indent=1, sort_keys=True))


def run(args: list[str], env: dict[str, str], what: str) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=1800)
    if result.returncode != 0:
        sys.exit(f"{what} failed (exit {result.returncode}):\n{result.stderr[-2000:]}")
    return result


def build(path: Path, shape: tuple[int, int], device: str, gpu_less: bool) -> float:
    args = [sys.executable, "-m", "kiln.frontend.cli.main", "package", "bench.package_bench:gpt2",
            "--shapes", f"{shape[0]}x{shape[1]}", "--dtype", "int64", "--weights", "-o",
            str(path)] + (["--gpu", "sm_90"] if gpu_less else ["--device", device])
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    if gpu_less:
        env["CUDA_VISIBLE_DEVICES"] = ""
    start = time.perf_counter()
    run(args, env, "kiln package")
    return time.perf_counter() - start


def first_output(path: Path, shape: tuple[int, int], device: str) -> float:
    times = []
    for _ in range(3):
        result = run([sys.executable, "-c", FIRST_OUTPUT, str(path), device,
                      json.dumps(list(shape)), str(vocab_size())],
                     {**os.environ, "PYTHONPATH": PYTHONPATH}, "loading the package")
        times.append(json.loads(result.stdout.strip().splitlines()[-1])["load_first_output_s"])
    return statistics.median(times)


def median_ms(fn: Any, ids: torch.Tensor, reps: int) -> float:
    for _ in range(3):
        fn(ids)
    times = []
    for _ in range(reps):
        if ids.is_cuda:
            start, end = (torch.cuda.Event(enable_timing=True),
                          torch.cuda.Event(enable_timing=True))
            start.record()
            fn(ids)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            fn(ids)
            times.append((time.perf_counter() - began) * 1e3)
    return statistics.median(times)


def steady(report: Report, path: Path, shape: tuple[int, int], device: str,
           reps: int) -> bool:
    """JIT and package timings; True if both outputs match eager."""
    import kiln
    from kiln.frontend.core.fallback import KilnFallbackWarning

    model = gpt2().to(device)
    package = kiln.load_package(path, allow_unsigned=True)
    ids = torch.randint(0, vocab_size(), shape, device=device)
    tol = 2e-2 if model_settings()["dtype"] == "float16" else 1e-3
    matched = True
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", KilnFallbackWarning)
        jit = torch.compile(model, backend="kiln", dynamic=False)
        ref = model(ids).float()
        for name, fn in (("jit", jit), ("package", package)):
            out = fn(ids).float()
            close = torch.allclose(out, ref, rtol=tol, atol=tol)
            report.row(f"{name}_max_abs_err", (out - ref).abs().max().item(),
                       f"tol {tol:g}", close)
            matched &= close
        jit_ms, package_ms = median_ms(jit, ids, reps), median_ms(package, ids, reps)
    report.row("jit_ms", jit_ms)
    report.row("package_ms", package_ms)
    report.row("package_over_jit", package_ms / jit_ms, "<= 1.02", package_ms / jit_ms <= 1.02)
    return matched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--smoke", action="store_true", help="tiny stand-in model, 1x32")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--reps", type=int)
    parser.add_argument("--gpu-less-build", action="store_true")
    parser.add_argument("--threads", type=int, help="CPU threads (--device cpu; default "
                        "1: on a shared host, OpenMP spin-waits swamp small kernels)")
    parser.add_argument("--json", metavar="OUT")
    args = parser.parse_args()
    if args.device == "cpu":  # the fresh load processes inherit it too
        os.environ["OMP_NUM_THREADS"] = str(args.threads or 1)
        torch.set_num_threads(args.threads or 1)
    shape = (args.batch or (1 if args.smoke else 8), args.seq or (32 if args.smoke else 512))
    dtype = "float16" if args.device == "cuda" else "float32"
    os.environ[MODEL_ENV] = json.dumps({"smoke": args.smoke, "dtype": dtype})
    name = "stand-in (smoke)" if args.smoke else (
        "GPT-2 (transformers)" if has_transformers() else "GPT-2 stand-in (no transformers)")
    report = Report(args.json, {"model": name, "device": args.device, "dtype": dtype,
                                "shape": f"{shape[0]}x{shape[1]}",
                                "gpu_less_build": args.gpu_less_build,
                                "threads": torch.get_num_threads(),
                                "torch": torch.__version__})
    path = Path(_CACHE) / "gpt2.kiln"
    report.row("build_s", build(path, shape, args.device, args.gpu_less_build))
    report.row("package_mb", round(path.stat().st_size / 2**20, 1))
    load_s = first_output(path, shape, args.device)
    report.row("load_first_output_s", load_s, "<= 1 s", load_s <= 1.0)
    matched = steady(report, path, shape, args.device, args.reps or (5 if args.smoke else 50))
    if not matched:
        sys.exit("package_bench: an output differs from eager")


if __name__ == "__main__":
    main()
