"""A region of ResNet-50's training forward, generated for the H200 and run on CPU under
Triton's interpreter (a diagnostic, not a test; no GPU, no torchvision).

The graph is the one the H200 compiles for ``bench/coldstart_models.resnet50_train``:
torchvision's ResNet-50 layout (rebuilt here: downsample after conv3, in-place ReLUs),
frozen BatchNorm, fp32 weights under fp16 autocast, traced by AOTAutograd's partitioner on
CPU tensors (CPU autocast in fp16), then traced again on fake CUDA tensors with Kiln's
decompositions and cut into regions as ``KILN_REGIONS=on`` cuts it. Region 0 comes out as
on the H200 (335 ATen nodes, ``_to_copy`` to ``add_33``) and its max-pool kernel
(``triton_poi_fused_ge_gt_isnan_..._3``) has the H200's source character for character.

Each region's request goes through the farm worker's graph stage
(``workers.pipeline.compile_sources``, target sm_90 with 132 SMs); the wrapper and kernels
are written to ``--out``. With ``--run`` the region runs under ``TRITON_INTERPRET=1`` on
CPU tensors: every buffer the wrapper allocates is filled with NaN (integers with -12345)
and sits between two 64 KiB guard zones, so a value read before it is written, a write
past either end of a buffer and each wrong output show; each output is compared with the
region's ATen graph run eagerly on the same inputs.

    TRITON_INTERPRET=1 python3 bench/region_interp.py --run             # batch 2
    TRITON_INTERPRET=1 python3 bench/region_interp.py --run --batch 8   # inputs tiled
    python3 bench/region_interp.py --run --batch 32 --device cuda         # on a GPU

``--watch`` (default: the max-pool kernel's contiguous copy, region 0's output that the
H200 got wrong under deferred regions) traces the wrapper line by line and names each
line of the wrapper (as written to ``--out``) after which that buffer changed. On a GPU
the same region runs compiled for it in a plain process (no farm, no deferral, no threads,
heuristic configs): wrong there, the watch names the writer; right there, the fault is in
the deferred path's context. On the H200 (18:44) the CUDA mode found 9020 wrong values
written by the max-pool kernel itself: a race between threads of one program, which the
interpreter (one program's lanes together) cannot show; see tests/unit/test_store_load_order.py.

Batch 2 runs in about 80 s on 2 idle cores (``--watch ''``), 5 to 6 min with the watch
under load; batch 8 about 7 min. Kernels and wrapper are the same as at batch 32 but for
the sizes (``--batch 32`` writes those without ``--run``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from coldstart_models import ResNet50  # noqa: E402

GUARD = 1 << 16
FILL = 0x5A


def training_forward(batch: int, size: int) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """AOTAutograd's forward graph of one training step (loss, fp16 autocast) and its
    inputs: image, labels, parameters, buffers."""
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    torch.manual_seed(0)
    m = ResNet50().eval()  # torchvision's layout and op order (coldstart_models)
    for mod in m.modules():
        if isinstance(mod, nn.BatchNorm2d):
            with torch.no_grad():
                mod.running_mean.normal_(0, 0.1)
                mod.running_var.uniform_(0.5, 1.5)
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.normal_(0, 0.1)
    params, buffers = dict(m.named_parameters()), dict(m.named_buffers())
    names = list(params) + list(buffers)

    def step(x: torch.Tensor, labels: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            out = torch.func.functional_call(m, dict(zip(names, tensors)), (x,))
        return F.cross_entropy(out.float(), labels)

    captured: dict[str, Any] = {}

    def keep(gm: torch.fx.GraphModule, _: Any) -> Any:
        captured.setdefault("forward", gm)
        return gm

    fn = aot_function(step, fw_compiler=keep, bw_compiler=keep,
                      partition_fn=min_cut_rematerialization_partition)
    args = [torch.randn(batch, 3, size, size), torch.randint(0, 1000, (batch,))]
    args += [p.detach().clone().requires_grad_(True) for p in params.values()]
    args += [b.clone() for b in buffers.values()]
    fn(*args).backward()
    return captured["forward"], [a.detach() for a in args]


def fake_cuda(tensors: list[torch.Tensor], batch: int | None = None) -> list[torch.Tensor]:
    """Fake CUDA tensors like ``tensors``; with ``batch``, dim 0 of each activation (2
    dims or more, dim 0 the traced batch of 2) becomes ``batch``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    out = []
    with FakeTensorMode():
        for t in tensors:
            shape, stride = list(t.shape), list(t.stride())
            if batch is not None and t.dim() > 1 and t.shape[0] == 2:
                shape[0] = batch
                stride = _like_strides(shape, stride)
            out.append(torch.empty_strided(shape, stride, dtype=t.dtype, device="cuda"))
    return out


def _like_strides(shape: list[int], stride: list[int]) -> list[int]:
    order = sorted(range(len(shape)), key=lambda i: stride[i])
    new, acc = [0] * len(shape), 1
    for i in order:
        new[i] = acc
        acc *= shape[i]
    return new


def guarded_allocations() -> tuple[Any, list[tuple[torch.Tensor, tuple[int, ...], int]]]:
    """An ``empty_strided`` whose buffers are NaN (integers -12345) between guard zones."""
    made: list[tuple[torch.Tensor, tuple[int, ...], int]] = []

    def empty_strided(size: Any, stride: Any, dtype: torch.dtype | None = None,
                      **_: Any) -> torch.Tensor:
        dtype = dtype or torch.float32
        numel = 1 + sum((s - 1) * st for s, st in zip(size, stride)) if all(size) else 0
        nbytes = numel * dtype.itemsize
        raw = torch.full((nbytes + 2 * GUARD,), FILL, dtype=torch.uint8)
        t = raw[GUARD:GUARD + nbytes].view(dtype).as_strided(size, stride)
        t.fill_(float("nan") if dtype.is_floating_point else -12345)
        made.append((raw, tuple(size), nbytes))
        return t

    return empty_strided, made


def max_pool_copy(wrapper: str) -> str | None:
    """The buffer the max-pool kernel copies its output to (its third argument)."""
    found = re.search(r"triton_poi_fused_ge_gt_isnan\w*\.run\((\w+), (\w+), (\w+)", wrapper)
    return found.group(3) if found else None


class Watch:
    """Traces the wrapper's ``call`` line by line: once buffer ``name`` exists, a copy of
    it, then after each later line a comparison (the GPU synchronized first). Each line
    that changed it is reported: the kernel that writes it, and any later writer."""

    def __init__(self, name: str) -> None:
        self.name, self.saved, self.made_at = name, None, ""
        self.changed: list[str] = []

    def __call__(self, frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            wrapper = frame.f_code.co_name == "call" and "DEVICE" in frame.f_globals
            return self._line if wrapper else None
        return None

    def _line(self, frame: Any, event: str, arg: Any) -> Any:
        if event not in ("line", "return"):
            return self._line
        value = frame.f_locals.get(self.name)
        if isinstance(value, torch.Tensor):
            if value.is_cuda:
                torch.cuda.synchronize()
            here = f"line {frame.f_lineno}"
            if self.saved is None:
                self.saved, self.made_at = value.detach().clone(), here
            elif not torch.equal(_bits(value), _bits(self.saved)):
                self.changed.append(f"changed by the line before {here}")
                self.saved = value.detach().clone()
        return self._line


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bytes (NaN equal to itself)."""
    return t.contiguous().view(torch.uint8)


def run_region(compiled: Any, gm: torch.fx.GraphModule, inputs: list[torch.Tensor],
               device: torch.device, watch: str | None) -> int:
    from kiln.compiler.compiled_graph import load

    original = torch.empty_strided
    empty, made = guarded_allocations()
    fn = load(compiled, device=device)
    watcher = Watch(watch) if watch else None
    start = time.perf_counter()
    if device.type == "cpu":
        torch.empty_strided = empty  # type: ignore[assignment]
    if watcher is not None:
        sys.settrace(watcher)
    try:
        outs = list(fn([a.clone() for a in inputs]))
    finally:
        sys.settrace(None)
        torch.empty_strided = original  # type: ignore[assignment]
    if watcher is not None:
        print(f"watch {watch} (allocated by the line before {watcher.made_at}): " +
              ("; ".join(watcher.changed) or "never changed"))
    print(f"ran in {time.perf_counter() - start:.1f} s, {len(made)} buffers allocated")
    bad = 0
    for raw, size, nbytes in made:
        hit = int((raw[:GUARD] != FILL).sum()) + int((raw[GUARD + nbytes:] != FILL).sum())
        if hit:
            bad += 1
            print(f"guard zone written: buffer {list(size)}, {hit} bytes")
    with torch.no_grad():
        refs = gm(*[a.clone() for a in inputs])
    outs = [o.cpu() if isinstance(o, torch.Tensor) else o for o in outs]
    refs = [r.cpu() if isinstance(r, torch.Tensor) else r for r in refs]
    for i, (o, r) in enumerate(zip(outs, refs)):
        if not isinstance(o, torch.Tensor) or o.shape != r.shape or o.numel() == 0:
            continue
        of, rf = o.float(), r.float()
        wrong = (~torch.isfinite(of) & torch.isfinite(rf)) | (
            (of - rf).abs() > 0.05 * rf.abs().max().clamp_min(1e-3))
        if int(wrong.sum()) or o.stride() != r.stride():
            bad += 1
            print(f"output {i} {list(o.shape)} {o.dtype}: {int(wrong.sum())} wrong, "
                  f"{int(of.isnan().sum())} NaN, strides {o.stride()} / eager {r.stride()}")
    print(f"{len(outs)} outputs, {bad} problems")
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--region", type=int, default=0)
    parser.add_argument("--batch", type=int, default=2, help="batch of the compiled region")
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--region-nodes", type=int, default=100)
    parser.add_argument("--run", action="store_true", help="run it under the interpreter")
    parser.add_argument("--out", default="region_interp_out")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: kernels compiled and run on this GPU (no interpreter)")
    parser.add_argument("--watch", default="max-pool-copy",
                        help="buffer to watch while the wrapper runs ('' for none)")
    args = parser.parse_args(argv)
    from kiln.compiler.decompositions import trace_aten
    from kiln.compiler.keys import compute_key
    from kiln.compiler.regions import split_graph
    from kiln.frontend.core.serialize import make_request
    from kiln.workers.pipeline import compile_sources

    forward, real = training_forward(2, args.size)
    split = split_graph(trace_aten(forward, fake_cuda(real)), fake_cuda(real),
                        args.region_nodes)
    assert split is not None, "the graph did not cut"
    region = split.regions[args.region]
    print(f"{len(split.regions)} regions; {region.describe()}, {region.num_outputs} outputs")
    gm, example = region.gm, region.example_inputs
    if args.batch != 2:
        example = fake_cuda(example, args.batch)
        gm = trace_aten(region.gm, example)
    target = {"kind": "cuda", "backend": "cuda", "arch": 90, "warp_size": 32,
              "sm_count": 132}
    request = make_request(gm, example, options={}, target=target)
    compiled = compile_sources(request.to_bytes(), compute_key(request).key)
    if args.device == "cuda":
        from kiln.compiler.driver import compile_all

        compile_all(compiled, target)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"region{args.region}_b{args.batch}_wrapper.py").write_text(compiled.wrapper_source)
    for k in compiled.kernels:
        (out / f"region{args.region}_b{args.batch}_{k.name}.py").write_text(k.source)
        print(f"kernel {k.name} xnumel {k.xnumel} sha256 "
              f"{hashlib.sha256(k.source.encode()).hexdigest()[:12]}")
    if not args.run:
        return 0
    if args.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("--run needs TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    inputs = [real[s.index] for s in region.inputs]
    if any(s.kind != "input" for s in region.inputs):
        print("--run takes a region whose inputs are all graph inputs (region 0)",
              file=sys.stderr)
        return 2
    if args.batch != 2:
        inputs = [torch.cat([a] * (args.batch // 2)) if a.dim() > 1 and a.shape[0] == 2 else a
                  for a in inputs]
    watch = max_pool_copy(compiled.wrapper_source) if args.watch == "max-pool-copy" \
        else args.watch
    device = torch.device(args.device)
    inputs = [a.to(device) for a in inputs]
    return 1 if run_region(compiled, region.gm, inputs, device, watch) else 0


if __name__ == "__main__":
    sys.exit(main())
