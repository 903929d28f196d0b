"""GPU benchmark: eager vs stock Inductor vs Kiln, side by side in one run (H200 host).

    python3 bench/gpu_bench.py [--only NAME[,NAME]] [--reps 50] [--json OUT]
                               [--max-autotune [MODE]] [--side kiln|inductor]
    python3 bench/gpu_bench.py --merge KILN.json INDUCTOR.json
    python3 bench/gpu_bench.py --dynamic [--reps 50] [--json OUT]

For each workload: median milliseconds per call (CUDA events around each call, after
warm-up, rotating over several fresh random input sets when they would fit in L2; eager,
Inductor and Kiln timed in 4 alternating blocks each, the median over all of a side's
calls, so that a drift of the host lands on every side alike: ``bench/gpu_timing.py``), the
Kiln / Inductor ratio, achieved GB/s of the kernels (memory-bound workloads: ideal bytes
over the GPU kernel time from the profiler) against the device-to-device copy bandwidth
measured in the same run, kernel launches per call (kernel events in the profiler), and
cold compile seconds for Kiln and Inductor (fresh caches, first call, Dynamo's tracing
included for both). ``--max-autotune`` compiles both with ``mode="max-autotune"`` (or
the mode given) and adds Kiln's default mode as a column.

``--side kiln`` (or ``inductor``) compiles and times only that compiler's rows (eager is
timed on both sides), so that a slow side (Inductor's max-autotune benchmarks every GEMM
for tens of seconds) can run in a call of its own: same workloads, seeds and settings;
``--merge`` prints the table of the two JSON files. ``--json`` is written after every
row, so a run cut short keeps the rows it finished. Inductor's "max-autotune" turns its
CUDA graphs on, Kiln's does not (Kiln's replays overwrite outputs without Inductor's
checks): a Kiln max-autotune row also times Kiln with ``KILN_CUDAGRAPHS=1`` as a
diagnostic line under the table (checked against eager too).

Training steps start each call as a training loop does: gradients set to None, and a new
CUDA-graph step marked (``torch.compiler.cudagraph_mark_step_begin``), for every
backend alike. Without it Inductor's CUDA graphs (mode "max-autotune") refuse a step
that accumulates into gradients a replay has overwritten.

Every row first checks Kiln against eager: the outputs (and, for training steps, every
parameter's gradient) must match, and a graph that falls back to eager
(``KilnFallbackWarning``) fails the row. The process exits non-zero if any row failed.
Rows named ``reduce-overhead`` compile Kiln and Inductor with ``mode="reduce-overhead"``
(CUDA graphs); their outputs are overwritten by the next replay, so they are cloned
before comparison. Under each such row a note line gives the Dynamo floor: the same
function compiled with a backend that does nothing but return outputs computed once
(``gpu_timing.floor_backend``), timed in the same alternating blocks, against eager: no
backend can go below it under Dynamo.

``--dynamic``: a decoder-only transformer forward (fp16) with a dynamic sequence length,
at 128, 512, 1024 and 2048 tokens: Kiln with the length marked dynamic (one compile must
serve all four), Kiln static (one compile per length) and Inductor with ``dynamic=True``,
all in one process. The table's times are that first process's steady state: Kiln's
after its background autotuning finished (per size bucket for the dynamic graph), which
the running graphs switch to between calls; the last column is the time right after the
first calls, while Kiln still runs heuristic configs and tunes in the background.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import warnings
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

import gemm_report  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from gpu_timing import (  # noqa: E402,F401
    floor_compiled,
    sdpa_priority,
    time_fn,
    time_interleaved,
)

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
    mode: str | None = None  # torch.compile mode for Kiln and Inductor ("reduce-overhead")
    params: list[torch.nn.Parameter] = field(default_factory=list)  # gradients compared
    results: dict[str, Any] = field(default_factory=dict)
    # The outputs and gradients (as ``_results`` orders them) computed in float64 for the
    # given inputs: a low-precision tensor outside the tolerance passes when Kiln's is as
    # close to float64 as eager's (a sum that cancels is ill-conditioned in bf16).
    reference: Callable[[list[Any]], list[torch.Tensor]] | None = None

    def stepped(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` as a training loop calls it (see the module docstring); others as is."""
        if not self.train:
            return fn

        def step(*args: Any) -> Any:
            for p in self.params:
                p.grad = None
            torch.compiler.cudagraph_mark_step_begin()
            return fn(*args)

        return step


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
                            lambda s=shape: [rand(*s), rand(*s), rand(*s)],  # type: ignore[misc]
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
    out.append(Workload("layer_norm backward 8192x4096 bf16", layer_norm_backward,
                        lambda: _ln_backward_inputs(8192, 4096, bf), 3 * 2 * 8192 * 4096))
    out.append(Workload("softmax 8192x8192 bf16", lambda x: torch.softmax(x, -1),
                        lambda: [rand(8192, 8192, dtype=bf)], 2 * 2 * 8192 * 8192))
    out.append(Workload("cross_entropy 4096x32000 bf16",
                        lambda x, t: F.cross_entropy(x, t),
                        lambda: [rand(4096, 32000, dtype=bf),
                                 torch.randint(0, 32000, (4096,), device="cuda")],
                        2 * 4096 * 32000))
    out.append(Workload("seed 64x128 fp32 reduce-overhead", seed_fn,
                        lambda: [rand(64, 128), rand(64, 128), rand(64, 128)],
                        mode="reduce-overhead"))
    out += model_workloads()
    out += encoder_workloads()
    return out


def layer_norm_backward(g: torch.Tensor, x: torch.Tensor, mean: torch.Tensor,
                        rstd: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> Any:
    """Input, weight and bias gradients of a layer norm (the weight and bias ones are
    column sums over all rows: split reductions)."""
    return torch.ops.aten.native_layer_norm_backward(g, x, [x.shape[-1]], mean, rstd, w, b,
                                                     [True, True, True])


def _ln_backward_inputs(rows: int, cols: int, dtype: torch.dtype) -> list[torch.Tensor]:
    x, w, b = rand(rows, cols, dtype=dtype), rand(cols, dtype=dtype), rand(cols, dtype=dtype)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [cols], w, b, 1e-5)
    return [rand(rows, cols, dtype=dtype), x, mean, rstd, w, b]


def model_workloads() -> list[Workload]:
    out: list[Workload] = []
    mlp = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).cuda()

    def mlp_step(x: torch.Tensor) -> torch.Tensor:
        loss = mlp(x).square().mean()
        loss.backward()
        return loss

    out.append(Workload("MLP training step 4096x1024 fp32", mlp_step,
                        lambda: [rand(4096, 1024)], train=True, params=list(mlp.parameters())))
    block = Block().cuda().half().eval()
    out.append(Workload("transformer block fwd 8x512x1024 fp16", block,
                        lambda: [rand(8, 512, 1024, dtype=torch.float16)]))
    gpt2 = _gpt2()
    if gpt2 is not None:
        for mode in (None, "reduce-overhead"):
            out.append(Workload("GPT-2 (HF, random weights) fwd 8x512 fp16"
                                + (" reduce-overhead" if mode else ""),
                                lambda ids: gpt2(ids).logits,
                                lambda: [torch.randint(0, 50257, (8, 512), device="cuda")],
                                mode=mode))
    resnet = _resnet18()
    if resnet is not None:
        out.append(Workload("ResNet-18 (torchvision) fwd 64x3x224x224 fp16", resnet,
                            lambda: [rand(64, 3, 224, 224, dtype=torch.float16)]))
    return out


class EncoderLayer(nn.Module):
    """Post-norm BERT-style layer: attention through SDPA with an additive mask."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
                   for t in self.qkv(x).split(d, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.ln1(x + self.proj(y.transpose(1, 2).reshape(b, s, d)))
        return self.ln2(x + self.fc2(F.gelu(self.fc1(x))))


class Encoder(nn.Module):
    """Token, position and segment embeddings (three embedding backwards in training),
    ``layers`` encoder layers, a pooled two-class head; the padding mask is built once
    per call and shared by every layer."""

    def __init__(self, layers: int, vocab: int = 30000, d: int = 512, heads: int = 8,
                 seq: int = 512) -> None:
        super().__init__()
        self.tok, self.pos, self.seg = (nn.Embedding(vocab, d), nn.Embedding(seq, d),
                                        nn.Embedding(2, d))
        self.ln = nn.LayerNorm(d)
        self.layers = nn.ModuleList(EncoderLayer(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, 2)

    def forward(self, ids: torch.Tensor, segments: torch.Tensor, keep: torch.Tensor
                ) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.ln(self.tok(ids) + self.pos(positions) + self.seg(segments))
        mask = torch.zeros(keep.shape, dtype=x.dtype, device=x.device).masked_fill(
            ~keep, float("-inf"))[:, None, None, :]
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x[:, 0])


def _encoder_inputs(batch: int, seq: int) -> list[torch.Tensor]:
    ids = torch.randint(0, 30000, (batch, seq), device="cuda")
    segments = torch.randint(0, 2, (batch, seq), device="cuda")
    lengths = torch.randint(seq // 2, seq + 1, (batch, 1), device="cuda")
    keep = torch.arange(seq, device="cuda")[None, :] < lengths
    return [ids, segments, keep]


def encoder_workloads() -> list[Workload]:
    torch.manual_seed(0)
    train = Encoder(layers=4, seq=256).cuda()
    labels = torch.randint(0, 2, (8,), device="cuda")

    def train_step(ids: torch.Tensor, segments: torch.Tensor, keep: torch.Tensor
                   ) -> torch.Tensor:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(train(ids, segments, keep).float(), labels)
        loss.backward()
        return loss

    def reference(args: list[Any]) -> list[torch.Tensor]:
        """The step in float64 without autocast: the loss, then every gradient."""
        exact = copy.deepcopy(train).double()
        with torch.enable_grad():
            loss = F.cross_entropy(exact(*args).double(), labels)
            loss.backward()
        return [loss.detach()] + [p.grad.detach() if p.grad is not None
                                  else torch.zeros_like(p) for p in exact.parameters()]

    infer = Encoder(layers=12, seq=512).cuda().half().eval()
    return [
        Workload("encoder training step 4 layers 8x256 bf16 autocast", train_step,
                 lambda: _encoder_inputs(8, 256), train=True,
                 params=list(train.parameters()), reference=reference),
        Workload("encoder fwd 12 layers 8x512 fp16", infer, lambda: _encoder_inputs(8, 512)),
    ]


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


def kernel_ms(fn: Callable[..., Any], args: list[Any], calls: int = 10,
              top: int = 0) -> tuple[float, float]:
    """(GPU kernel ms per call, kernel events per call), from the profiler: the time is
    the sum of the call's kernels, free of Python launch overhead; the count is what the
    table calls launches (kernels replayed from a CUDA graph count one each). ``top``
    prints the costliest kernels."""
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
    kernels = sum(1 for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA)
    return sum(e.self_device_time_total for e in events) / calls / 1e3, kernels / calls


def copy_bandwidth() -> float:
    """GB/s of a device-to-device copy (bytes read + written), measured now."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_fn(lambda: dst.copy_(src), [[]], 20)
    return 2 * src.numel() / ms / 1e6


def compiled(w: Workload, backend: str, mode: str | None = None
             ) -> tuple[Callable[..., Any], float]:
    """The workload compiled by ``backend`` (with ``mode``, else the workload's) and its
    cold compile seconds (first call).

    A Kiln graph that falls back to eager makes the row fail: the figures would be eager's.
    """
    from kiln import KilnFallbackWarning

    mode = mode or w.mode
    torch._dynamo.reset()
    fn = w.stepped(torch.compile(w.fn, backend=backend, dynamic=False, mode=mode))
    args = w.make_inputs()
    torch.cuda.synchronize()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught, _grad(w):
        warnings.simplefilter("always")
        fn(*args)
        fn(*args)  # a second call: CUDA graphs record on a later call than the first
    torch.cuda.synchronize()
    secs = time.perf_counter() - start
    fallbacks = [str(c.message) for c in caught if issubclass(c.category, KilnFallbackWarning)]
    if fallbacks:
        raise RuntimeError(f"kiln fell back to eager: {fallbacks[0]}")
    if backend == "kiln":
        # The first output came from heuristic configs; runtime is measured with what
        # background autotuning chose: wait for it, then load the tuned artifacts (a hit).
        from kiln.frontend.core.client import wait_for_background

        wait_for_background(900)
        torch._dynamo.reset()
        fn = w.stepped(torch.compile(w.fn, backend=backend, dynamic=False, mode=mode))
        with _grad(w):
            fn(*args)
            fn(*args)
        torch.cuda.synchronize()
    return fn, secs


def _outputs(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value.detach().clone()]  # a CUDA graph's output is overwritten on replay
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _outputs(v)]
    return []


def _results(w: Workload, fn: Callable[..., Any], args: list[Any]) -> list[torch.Tensor]:
    """The call's outputs, then (training steps) every parameter's fresh gradient."""
    for p in w.params:
        p.grad = None
    with _grad(w):
        outs = _outputs(fn(*args))
    torch.cuda.synchronize()
    grads = [p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p)
             for p in w.params]
    for p in w.params:
        p.grad = None
    return outs + grads


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm of the difference over the norm of ``b`` (NaN when either has one)."""
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def check_against_eager(w: Workload, fn: Callable[..., Any], args: list[Any]) -> float:
    """Largest relative error (norm of the difference over the norm of eager's) over the
    outputs and gradients; raises when one is off by more than the dtype allows, unless
    the workload has a float64 reference that Kiln's tensor is as close to as eager's
    (within 2x, as torch._dynamo's accuracy checks allow)."""
    got, want = _results(w, fn, args), _results(w, w.fn, args)
    if len(got) != len(want) or not want:
        raise RuntimeError(f"kiln returned {len(got)} tensors, eager {len(want)}")
    worst, exact = 0.0, None
    for i, (a, b) in enumerate(zip(got, want)):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise RuntimeError(f"tensor {i}: kiln {a.dtype}{list(a.shape)}, "
                               f"eager {b.dtype}{list(b.shape)}")
        if not b.is_floating_point():
            if not torch.equal(a, b):
                raise RuntimeError(f"tensor {i}: integers differ")
            continue
        err = _rel(a, b)
        low = b.dtype in (torch.float16, torch.bfloat16) or w.name.find("autocast") >= 0
        tol = 3e-2 if low else 1e-3
        if not err <= tol and low and w.reference is not None:  # (NaN stays a failure)
            exact = exact if exact is not None else w.reference(args)
            kiln64, eager64 = _rel(a, exact[i]), _rel(b, exact[i])
            print(f"# {w.name}: tensor {i} of {len(want)}: relative error {err:.2e} to eager;"
                  f" to float64 kiln {kiln64:.2e}, eager {eager64:.2e}", file=sys.stderr)
            if kiln64 <= 2 * eager64 + tol / 10:
                continue
            raise RuntimeError(f"tensor {i} of {len(want)}: relative error {err:.2e} to eager, "
                               f"{kiln64:.2e} to float64 (eager's: {eager64:.2e})")
        if not err <= tol:  # also catches NaN
            raise RuntimeError(f"tensor {i} of {len(want)}: relative error {err:.2e}")
        worst = max(worst, err)
    return worst


class _grad:
    def __init__(self, w: Workload) -> None:
        self.ctx = torch.enable_grad() if w.train else torch.no_grad()

    def __enter__(self) -> None:
        self.ctx.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.ctx.__exit__(*exc)


def run(w: Workload, reps: int, copy_gbs: float, side: str = "both") -> dict[str, Any]:
    """One row: ``side`` "both", or "kiln" / "inductor" alone (eager on every side)."""
    first = w.make_inputs()
    size = sum(nbytes(a) for a in first if isinstance(a, torch.Tensor))
    sets = [first] + [w.make_inputs() for _ in range(3 if size < L2_BYTES else 0)]
    row: dict[str, Any] = {"workload": w.name, "side": side}
    fns: dict[str, Callable[..., Any]] = {"eager": w.stepped(w.fn)}
    backends = [b for b in ("inductor", "kiln") if side in ("both", b)]
    for backend in backends:
        fn, secs = compiled(w, backend, MODE)
        fns[backend], row[f"{backend}_compile_s"] = fn, secs
    if "kiln" in fns:
        row["kiln_max_rel_err"] = check_against_eager(w, fns["kiln"], first)
        if MODE:
            fns["kiln_default"], row["kiln_default_compile_s"] = compiled(w, "kiln")
            _with_cudagraphs(w, fns, row, first)
    if w.mode == "reduce-overhead":
        with _grad(w):  # no reset: Dynamo keeps the row's other backends' entries
            fns["dynamo_floor"] = w.stepped(floor_compiled(w.fn, w.make_inputs()))
    with _grad(w):
        row.update({f"{name}_ms": ms for name, ms in time_interleaved(fns, sets, reps).items()})
    if MODE:
        row["mode"] = MODE
    for name in ["eager", *backends]:
        print(f"# {w.name}: {name} top kernels", file=sys.stderr)
        with _grad(w):
            row[f"{name}_kernel_ms"], row[f"{name}_launches"] = kernel_ms(
                fns[name], sets[0], top=PROFILE_TOP)
    if "kiln" in fns:
        row.update(_kiln_gemm_counters())
        row["kiln_gemm_choices"] = gemm_report.take()
    return derived(row, w.bytes_moved, copy_gbs)


def _with_cudagraphs(w: Workload, fns: dict[str, Callable[..., Any]], row: dict[str, Any],
                     args: list[Any]) -> None:
    """A diagnostic column: Kiln's max-autotune with its CUDA graphs on
    (``KILN_CUDAGRAPHS=1``; Kiln's max-autotune mode leaves them off, Inductor's turns its
    own on). The same store: a hit. A failure here is reported, not the row's."""
    before = os.environ.get("KILN_CUDAGRAPHS")
    os.environ["KILN_CUDAGRAPHS"] = "1"
    try:
        fn, _ = compiled(w, "kiln", MODE)
        row["kiln_cudagraphs_max_rel_err"] = check_against_eager(w, fn, args)
        fns["kiln_cudagraphs"] = fn
    except Exception as e:
        row["kiln_cudagraphs_error"] = f"{type(e).__name__}: {e}"[:500]
        print(f"# {w.name}: kiln with CUDA graphs FAILED {row['kiln_cudagraphs_error']}",
              file=sys.stderr)
    finally:
        if before is None:
            os.environ.pop("KILN_CUDAGRAPHS", None)
        else:
            os.environ["KILN_CUDAGRAPHS"] = before


def derived(row: dict[str, Any], bytes_moved: int, copy_gbs: float) -> dict[str, Any]:
    """The ratio and bandwidth columns of what the row has."""
    if "kiln_ms" in row and "inductor_ms" in row:
        row["kiln/inductor"] = row["kiln_ms"] / row["inductor_ms"]
    if "kiln_cudagraphs_ms" in row and "inductor_ms" in row:
        row["kiln_cudagraphs/inductor"] = row["kiln_cudagraphs_ms"] / row["inductor_ms"]
    row["bytes_moved"] = bytes_moved
    for name in ("inductor", "kiln"):
        if bytes_moved and f"{name}_kernel_ms" in row:
            gbs = bytes_moved / row[f"{name}_kernel_ms"] / 1e6
            row[f"{name}_GBps"] = gbs
            row[f"{name}_pct_copy"] = 100 * gbs / copy_gbs
    return row


def _kiln_gemm_counters() -> dict[str, Any]:
    """Max-autotune's GEMM problems so far in this process (``kiln stats``' counters)."""
    from kiln.frontend.core.client import process_counters

    total = process_counters()
    return {k: total.get(k, 0) for k in ("gemm_problems", "gemm_cached", "gemm_benchmarked",
                                         "gemm_untuned")}


def merge(paths: list[str]) -> tuple[list[dict[str, Any]], float]:
    """Rows of several ``--side`` runs joined by workload (eager from the first file
    that has it), the ratios computed again; and the first file's copy bandwidth."""
    rows: dict[str, dict[str, Any]] = {}
    copy_gbs = 0.0
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        copy_gbs = copy_gbs or float(data.get("copy_GBps", 0.0))
        for r in data["rows"]:
            into = rows.setdefault(r["workload"], {})
            into.update({k: v for k, v in r.items() if k not in into or
                         not k.startswith("eager")})
            into["side"] = "merged"
    for r in rows.values():
        derived(r, int(r.get("bytes_moved", 0)), copy_gbs or 1.0)
    return list(rows.values()), copy_gbs


def print_table(rows: list[dict[str, Any]], copy_gbs: float) -> None:
    print(f"copy bandwidth (d2d, read+write): {copy_gbs:.0f} GB/s")
    head: tuple[str, ...] = (
        "workload", "eager ms", "inductor ms", "kiln ms", "kiln/inductor", "kiln GPU ms",
        "inductor GPU ms", "kiln kernel GB/s", "kiln %copy", "inductor %copy",
        "launches eager/inductor/kiln", "kiln compile s", "inductor compile s")
    tuned = any("kiln_default_ms" in r for r in rows)
    if tuned:
        print(f"mode: {rows[0].get('mode')} (Inductor and Kiln); kiln default = Kiln's "
              "default mode")
        head = head[:4] + ("kiln default ms",) + head[4:]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        cells = [r["workload"], _ms(r, "eager_ms"), _ms(r, "inductor_ms"), _ms(r, "kiln_ms"),
                 _ms(r, "kiln/inductor", 2), _ms(r, "kiln_kernel_ms"),
                 _ms(r, "inductor_kernel_ms"), _ms(r, "kiln_GBps", 0),
                 f"{r['kiln_pct_copy']:.0f}%" if "kiln_pct_copy" in r else "-",
                 f"{r['inductor_pct_copy']:.0f}%" if "inductor_pct_copy" in r else "-",
                 "/".join(_ms(r, f"{n}_launches", 0) for n in ("eager", "inductor", "kiln")),
                 _ms(r, "kiln_compile_s", 1), _ms(r, "inductor_compile_s", 1)]
        if tuned:
            cells.insert(4, _ms(r, "kiln_default_ms"))
        print("| " + " | ".join(cells) + " |")
    for r in rows:
        if "dynamo_floor_ms" in r:
            print(f"{r['workload']}: Dynamo floor (a backend returning ready outputs) "
                  f"{_ms(r, 'dynamo_floor_ms', 4)} ms = "
                  f"{r['dynamo_floor_ms'] / r['eager_ms']:.2f}x eager; Kiln "
                  f"{_ms(r, 'kiln_ms', 4)} ms = {_ratio(r, 'kiln_ms', 'eager_ms')}x eager, "
                  f"Inductor {_ratio(r, 'inductor_ms', 'eager_ms')}x eager")
        if "kiln_cudagraphs_ms" in r or "kiln_cudagraphs_error" in r:
            print(f"{r['workload']}: Kiln {r.get('mode')} with KILN_CUDAGRAPHS=1 (a "
                  f"diagnostic, not Kiln's mode): {_ms(r, 'kiln_cudagraphs_ms')} ms, "
                  f"{_ms(r, 'kiln_cudagraphs/inductor', 2)}x Inductor "
                  f"{r.get('kiln_cudagraphs_error', '')}")
        if r.get("gemm_problems"):
            print(f"{r['workload']}: Kiln's GEMM problems so far in its process "
                  f"{r['gemm_problems']} ({r['gemm_benchmarked']} benchmarked, "
                  f"{r['gemm_cached']} cached, {r['gemm_untuned']} untuned)")
        for line in r.get("kiln_gemm_choices", []):
            print(f"{r['workload']}: Kiln's GEMM choice: {line}")


def _ratio(row: dict[str, Any], key: str, over: str) -> str:
    return f"{row[key] / row[over]:.2f}" if key in row and row.get(over) else "-"


def _ms(row: dict[str, Any], key: str, digits: int = 3) -> str:
    value = row.get(key)
    return "-" if value is None else f"{value:.{digits}f}"


DYNAMIC_LENGTHS = (128, 512, 1024, 2048)


def _decoder() -> nn.Module:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.models import Decoder

    return Decoder(vocab=32000, d=1024, heads=16, layers=4).cuda().half().eval()


def _kiln_graphs() -> list[str]:
    """Names of the graphs Kiln compiles or loads from now on (its observer list)."""
    from kiln.frontend.core import compile as kiln_compile

    names: list[str] = []
    kiln_compile.observers.append(lambda name, result: names.append(result.source))
    return names


def _dynamic_mode(model: nn.Module, inputs: dict[int, torch.Tensor], mode: str,
                  kwargs: dict[str, Any], rows: dict[int, dict[str, Any]], reps: int) -> None:
    """One compile mode at every length, in one process, as a user gets it: the first
    calls (compiles; Kiln's first output comes from heuristic configs while autotuning
    runs in the background: ``<mode>_first_ms`` is timed right after them), then, once
    Kiln's background work is done (the running graphs switch to the tuned kernels
    between calls: no reload, no second process), the steady state (``<mode>_ms``)."""
    from kiln import KilnFallbackWarning

    torch._dynamo.reset()
    graphs = _kiln_graphs()
    fn = torch.compile(model, **kwargs)
    kiln = kwargs["backend"] == "kiln"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)  # a fallback fails the run
        for k, n in enumerate(DYNAMIC_LENGTHS):
            if k == 0 and mode == "kiln_dynamic":
                torch._dynamo.mark_dynamic(inputs[n], 1)
            torch.testing.assert_close(fn(inputs[n]), model(inputs[n]), rtol=3e-2, atol=3e-2)
            rows[n][f"{mode}_first_ms"] = time_fn(fn, [[inputs[n]]], reps)
        if kiln:
            from kiln.frontend.core.client import wait_for_background

            started = time.perf_counter()
            wait_for_background(900)
            rows[DYNAMIC_LENGTHS[0]][f"{mode}_tuning_wait_s"] = time.perf_counter() - started
        for n in DYNAMIC_LENGTHS:  # the tuned kernels must match eager too
            torch.testing.assert_close(fn(inputs[n]), model(inputs[n]), rtol=3e-2, atol=3e-2)
            rows[n][f"{mode}_ms"] = time_fn(fn, [[inputs[n]]], reps)
    rows[DYNAMIC_LENGTHS[0]][f"{mode}_graphs"] = len(graphs)
    print(f"# {mode}: {len(graphs)} Kiln graph(s) ({', '.join(graphs)})", file=sys.stderr)


def run_dynamic(reps: int) -> list[dict[str, Any]]:
    """Per length: ms of Kiln dynamic, Kiln static and Inductor dynamic=True in steady
    state of this one process (and right after the first calls); graphs Kiln compiled
    for each mode (dynamic: one for all four lengths); the process's switches to tuned
    kernels and size buckets tuned (``kiln stats``' counters)."""
    model = _decoder()
    inputs = {n: torch.randint(0, 32000, (4, n), device="cuda") for n in DYNAMIC_LENGTHS}
    modes: dict[str, dict[str, Any]] = {
        "kiln_dynamic": dict(backend="kiln"),
        "kiln_static": dict(backend="kiln", dynamic=False),
        "inductor_dynamic": dict(backend="inductor", dynamic=True)}
    rows: dict[int, dict[str, Any]] = {n: {"workload": f"decoder fwd 4x{n} fp16"}
                                       for n in DYNAMIC_LENGTHS}
    for mode, kwargs in modes.items():
        _dynamic_mode(model, inputs, mode, kwargs, rows, reps)
        if kwargs["backend"] == "kiln":
            counters = _kiln_counters()
            rows[DYNAMIC_LENGTHS[0]][f"{mode}_counters"] = counters
            print(f"# {mode}: kiln counters so far {counters}", file=sys.stderr)
    for r in rows.values():
        r["dynamic/static"] = r["kiln_dynamic_ms"] / r["kiln_static_ms"]
        r["dynamic/inductor"] = r["kiln_dynamic_ms"] / r["inductor_dynamic_ms"]
    return list(rows.values())


def _kiln_counters() -> dict[str, Any]:
    """The process's client counters (what ``kiln stats`` adds up)."""
    from kiln.frontend.core.client import process_counters

    total = process_counters()
    return {k: total.get(k, 0) for k in ("graphs", "compiles", "hits", "hot_swaps",
                                         "bucket_tunes", "autotune_publishes")}


def print_dynamic(rows: list[dict[str, Any]]) -> None:
    head = ("workload", "kiln dynamic ms", "kiln static ms", "inductor dynamic ms",
            "dynamic/static (<=1.1)", "dynamic/inductor (<=1.0)",
            "right after compile: kiln dynamic / kiln static / inductor ms")
    print("steady state of the first process (Kiln: after its background autotuning, "
          "switched to the tuned kernels in process)")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        print(f"| {r['workload']} | {r['kiln_dynamic_ms']:.3f} | {r['kiln_static_ms']:.3f} | "
              f"{r['inductor_dynamic_ms']:.3f} | {r['dynamic/static']:.2f} | "
              f"{r['dynamic/inductor']:.2f} | {r['kiln_dynamic_first_ms']:.3f} / "
              f"{r['kiln_static_first_ms']:.3f} / {r['inductor_dynamic_first_ms']:.3f} |")
    first = rows[0]
    print(f"Kiln graphs: dynamic {first['kiln_dynamic_graphs']} (one compile must serve "
          f"all four lengths), static {first['kiln_static_graphs']}")
    for mode in ("kiln_dynamic", "kiln_static"):
        print(f"{mode}: waited {first.get(f'{mode}_tuning_wait_s', 0):.1f} s for background "
              f"autotuning; counters {first.get(f'{mode}_counters')}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--json", default="")
    parser.add_argument("--max-autotune", nargs="?", const="max-autotune", default=None,
                        metavar="MODE", help="compile with this torch.compile mode")
    parser.add_argument("--side", "--max-autotune-side", default="both",
                        choices=("both", "kiln", "inductor"),
                        help="compile and time only this compiler's rows")
    parser.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                        help="print the table of --side runs' JSON files")
    parser.add_argument("--dynamic", action="store_true",
                        help="the decoder with a dynamic sequence length only")
    ns = parser.parse_args()
    if ns.merge:
        merged, copy_gbs = merge(ns.merge)
        print_table(merged, copy_gbs)
        return
    global MODE
    MODE = ns.max_autotune
    gemm_report.watch()
    torch.manual_seed(0)
    if ns.dynamic:
        dyn = run_dynamic(ns.reps)
        print_dynamic(dyn)
        if ns.json:
            with open(ns.json, "w") as f:
                json.dump({"rows": dyn}, f, indent=1)
        return
    copy_gbs = copy_bandwidth()
    rows, failed = [], []
    sdpa = sdpa_priority()  # BENCH_SDPA_PRIORITY, a diagnostic (gpu_timing.py)
    sdpa.__enter__()
    for w in workloads():
        if ns.only and not any(k.strip() in w.name for k in ns.only.split(",")):
            continue
        try:
            rows.append(run(w, ns.reps, copy_gbs, ns.side))
        except Exception as e:  # report and go on: one failure must not hide the rest
            failed.append(f"{w.name}: {type(e).__name__}: {e}")
            print(f"# {w.name}: FAILED {type(e).__name__}: {e}", file=sys.stderr)
        print(f"# done: {w.name}", file=sys.stderr, flush=True)
        if ns.json:  # after every row: a run cut short keeps what it finished
            with open(ns.json, "w") as f:
                json.dump({"copy_GBps": copy_gbs, "side": ns.side, "rows": rows,
                           "failed": failed}, f, indent=1)
    print(f"# torch {torch.__version__}, triton {_triton_version()}, "
          f"{torch.cuda.get_device_name()}")
    print_table(rows, copy_gbs)
    if failed:
        print("FAILED rows:\n  " + "\n  ".join(failed))
        sys.exit(1)


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


if __name__ == "__main__":
    main()
