"""GPU benchmark: eager vs stock Inductor vs Kiln, side by side in one run (H200 host).

    python3 bench/gpu_bench.py [--only NAME[,NAME]] [--reps 50] [--json OUT]
                               [--max-autotune [MODE]]

For each workload: median milliseconds per call (CUDA events around each call, after
warm-up, rotating over several fresh random input sets when they would fit in L2), the
Kiln / Inductor ratio, achieved GB/s of the kernels (memory-bound workloads: ideal bytes
over the GPU kernel time from the profiler) against the device-to-device copy bandwidth
measured in the same run, and cold compile seconds for Kiln and Inductor (fresh caches,
first call, Dynamo's tracing included for both). ``--max-autotune`` compiles both with
``mode="max-autotune"`` (or the mode given) and adds Kiln's default mode as a column.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# Fresh caches so compile times are cold, set before torch/triton are imported.
_CACHE = tempfile.mkdtemp(prefix="kiln_bench_")
os.environ.setdefault("KILN_CACHE_DIR", os.path.join(_CACHE, "kiln"))
os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(_CACHE, "triton"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(_CACHE, "inductor"))
os.environ.setdefault("KILN_FARM", "inprocess")
os.environ.setdefault("KILN_STORE", "file://" + os.path.join(_CACHE, "store"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

L2_BYTES = 60 * 2**20
MODE: str | None = None  # torch.compile's mode for Inductor and Kiln (--max-autotune)
PROFILE_TOP = int(os.environ.get("BENCH_PROFILE_TOP", "0"))


@dataclass
class Workload:
    name: str
    fn: Callable[..., Any]
    make_inputs: Callable[[], list[Any]]
    bytes_moved: int = 0  # ideal HBM traffic, for memory-bound workloads
    train: bool = False
    results: dict[str, Any] = field(default_factory=dict)


def rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=dtype)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def seed_fn(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return ((a + b) * c.relu()).sum(dim=-1)


def mlp_tail(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    return F.gelu(x @ w + b) + r


class Block(nn.Module):
    def __init__(self, d: int = 1024, heads: int = 16) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def workloads() -> list[Workload]:
    bf, fp16 = torch.bfloat16, torch.float16
    out: list[Workload] = []
    for shape in ((64, 128), (8192, 4096)):
        out.append(Workload(f"seed {shape[0]}x{shape[1]} fp32", seed_fn,
                            lambda s=shape: [rand(*s), rand(*s), rand(*s)],
                            4 * (3 * shape[0] * shape[1] + shape[0])))
    out.append(Workload("gelu(x@W+b)+r 8192x4096 fp16", mlp_tail,
                        lambda: [rand(8192, 4096, dtype=fp16), rand(4096, 4096, dtype=fp16) / 64,
                                 rand(4096, dtype=fp16), rand(8192, 4096, dtype=fp16)],
                        2 * 8192 * 4096 * 3))
    w, b = rand(4096, dtype=bf), rand(4096, dtype=bf)
    out.append(Workload("layer_norm 8192x4096 bf16",
                        lambda x: F.layer_norm(x, (4096,), w, b),
                        lambda: [rand(8192, 4096, dtype=bf)], 2 * 2 * 8192 * 4096))
    out.append(Workload("rms_norm 8192x4096 bf16",
                        lambda x: F.rms_norm(x, (4096,), w, eps=1e-6),
                        lambda: [rand(8192, 4096, dtype=bf)], 2 * 2 * 8192 * 4096))
    out.append(Workload("softmax 8192x8192 bf16", lambda x: torch.softmax(x, -1),
                        lambda: [rand(8192, 8192, dtype=bf)], 2 * 2 * 8192 * 8192))
    out.append(Workload("cross_entropy 4096x32000 bf16",
                        lambda x, t: F.cross_entropy(x, t),
                        lambda: [rand(4096, 32000, dtype=bf),
                                 torch.randint(0, 32000, (4096,), device="cuda")],
                        2 * 4096 * 32000))
    out += model_workloads()
    return out


def model_workloads() -> list[Workload]:
    out: list[Workload] = []
    mlp = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()

    def mlp_step(x: torch.Tensor) -> torch.Tensor:
        loss = mlp(x).square().mean()
        loss.backward()
        return loss

    out.append(Workload("MLP training step 4096x1024 fp32", mlp_step,
                        lambda: [rand(4096, 1024)], train=True))
    block = Block().cuda().half().eval()
    out.append(Workload("transformer block fwd 8x512x1024 fp16", block,
                        lambda: [rand(8, 512, 1024, dtype=torch.float16)]))
    gpt2 = _gpt2()
    if gpt2 is not None:
        out.append(Workload("GPT-2 (HF, random weights) fwd 8x512 fp16",
                            lambda ids: gpt2(ids).logits,
                            lambda: [torch.randint(0, 50257, (8, 512), device="cuda")]))
    resnet = _resnet18()
    if resnet is not None:
        out.append(Workload("ResNet-18 (torchvision) fwd 64x3x224x224 fp16", resnet,
                            lambda: [rand(64, 3, 224, 224, dtype=torch.float16)]))
    return out


def _gpt2() -> Any:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        print("# transformers missing: GPT-2 skipped", file=sys.stderr)
        return None
    return GPT2LMHeadModel(GPT2Config()).cuda().half().eval()


def _resnet18() -> Any:
    try:
        import torchvision
    except ImportError:
        print("# torchvision missing: ResNet-18 skipped", file=sys.stderr)
        return None
    return torchvision.models.resnet18(weights=None).cuda().half().eval()


def time_fn(fn: Callable[..., Any], input_sets: list[list[Any]], reps: int) -> float:
    """Median ms per call over ``reps`` timed calls, rotating over the input sets."""
    for i in range(5):
        fn(*input_sets[i % len(input_sets)])
    torch.cuda.synchronize()
    times = []
    for i in range(reps):
        args = input_sets[i % len(input_sets)]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_ms(fn: Callable[..., Any], args: list[Any], calls: int = 10,
              top: int = 0) -> float:
    """GPU kernel time per call (sum of the call's kernels), from the profiler: what the
    memory-bound figures use, free of Python launch overhead. ``top`` prints the
    costliest kernels."""
    from torch.profiler import ProfilerActivity, profile

    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(*args)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
    events.sort(key=lambda e: -e.self_device_time_total)
    for e in events[:top]:
        print(f"#    {e.self_device_time_total / calls / 1e3:8.3f} ms  x{e.count // calls:<3} "
              f"{e.key[:90]}", file=sys.stderr)
    return sum(e.self_device_time_total for e in events) / calls / 1e3


def copy_bandwidth() -> float:
    """GB/s of a device-to-device copy (bytes read + written), measured now."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_fn(lambda: dst.copy_(src), [[]], 20)
    return 2 * src.numel() / ms / 1e6


def compiled(w: Workload, backend: str, mode: str | None = None
             ) -> tuple[Callable[..., Any], float]:
    """The workload compiled by ``backend`` and its cold compile seconds (first call)."""
    torch._dynamo.reset()
    fn = torch.compile(w.fn, backend=backend, dynamic=False, mode=mode)
    args = w.make_inputs()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with _grad(w):
        fn(*args)
    torch.cuda.synchronize()
    return fn, time.perf_counter() - start


class _grad:
    def __init__(self, w: Workload) -> None:
        self.ctx = torch.enable_grad() if w.train else torch.no_grad()

    def __enter__(self) -> None:
        self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.ctx.__exit__(*exc)


def run(w: Workload, reps: int, copy_gbs: float) -> dict[str, Any]:
    first = w.make_inputs()
    size = sum(nbytes(a) for a in first if isinstance(a, torch.Tensor))
    sets = [first] + [w.make_inputs() for _ in range(3 if size < L2_BYTES else 0)]
    row: dict[str, Any] = {"workload": w.name}
    fns: dict[str, Callable[..., Any]] = {"eager": w.fn}
    for backend in ("inductor", "kiln"):
        fn, secs = compiled(w, backend, MODE)
        fns[backend], row[f"{backend}_compile_s"] = fn, secs
    if MODE:
        fns["kiln_default"], row["kiln_default_compile_s"] = compiled(w, "kiln")
    for name, fn in fns.items():
        with _grad(w):
            row[f"{name}_ms"] = time_fn(fn, sets, reps)
    row["kiln/inductor"] = row["kiln_ms"] / row["inductor_ms"]
    if MODE:
        row["mode"] = MODE
    for name in ("inductor", "kiln"):
        print(f"# {w.name}: {name} top kernels", file=sys.stderr)
        with _grad(w):
            row[f"{name}_kernel_ms"] = kernel_ms(fns[name], sets[0], top=PROFILE_TOP)
    if w.bytes_moved:
        for name in ("inductor", "kiln"):
            gbs = w.bytes_moved / row[f"{name}_kernel_ms"] / 1e6
            row[f"{name}_GBps"] = gbs
            row[f"{name}_pct_copy"] = 100 * gbs / copy_gbs
    return row


def print_table(rows: list[dict[str, Any]], copy_gbs: float) -> None:
    print(f"copy bandwidth (d2d, read+write): {copy_gbs:.0f} GB/s")
    head = ("workload", "eager ms", "inductor ms", "kiln ms", "kiln/inductor",
            "kiln GPU ms", "inductor GPU ms", "kiln kernel GB/s", "kiln %copy",
            "inductor %copy", "kiln compile s", "inductor compile s")
    tuned = any("kiln_default_ms" in r for r in rows)
    if tuned:
        print(f"mode: {rows[0].get('mode')} (Inductor and Kiln); kiln default = Kiln's "
              "default mode")
        head = head[:4] + ("kiln default ms",) + head[4:]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["workload"], f"{r['eager_ms']:.3f}", f"{r['inductor_ms']:.3f}",
                 f"{r['kiln_ms']:.3f}", f"{r['kiln/inductor']:.2f}",
                 f"{r['kiln_kernel_ms']:.3f}", f"{r['inductor_kernel_ms']:.3f}",
                 f"{r.get('kiln_GBps', 0):.0f}" if "kiln_GBps" in r else "-",
                 f"{r['kiln_pct_copy']:.0f}%" if "kiln_pct_copy" in r else "-",
                 f"{r['inductor_pct_copy']:.0f}%" if "inductor_pct_copy" in r else "-",
                 f"{r['kiln_compile_s']:.1f}", f"{r['inductor_compile_s']:.1f}"]
        if tuned:
            cells.insert(4, f"{r.get('kiln_default_ms', float('nan')):.3f}")
        print("| " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--json", default="")
    parser.add_argument("--max-autotune", nargs="?", const="max-autotune", default=None,
                        metavar="MODE", help="compile with this torch.compile mode")
    ns = parser.parse_args()
    global MODE
    MODE = ns.max_autotune
    torch.manual_seed(0)
    copy_gbs = copy_bandwidth()
    rows = []
    for w in workloads():
        if ns.only and not any(k.strip() in w.name for k in ns.only.split(",")):
            continue
        try:
            rows.append(run(w, ns.reps, copy_gbs))
        except Exception as e:  # report and go on: one failure must not hide the rest
            print(f"# {w.name}: FAILED {type(e).__name__}: {e}", file=sys.stderr)
        print(f"# done: {w.name}", file=sys.stderr, flush=True)
    print(f"# torch {torch.__version__}, triton {_triton_version()}, "
          f"{torch.cuda.get_device_name()}")
    print_table(rows, copy_gbs)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"copy_GBps": copy_gbs, "rows": rows}, f, indent=1)


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


if __name__ == "__main__":
    main()
