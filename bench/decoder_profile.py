"""Where a decoder's call time goes, Kiln against Inductor: a CPU+CUDA profile per call.

The decoder of ``tests.models`` (d=1024, 4 layers, fp16, batch 4) is compiled static and with
``dynamic=True`` by both compilers; at each sequence length it prints the wall time per
call (CUDA events), the GPU busy time (the union of the kernels' intervals), the GPU span,
the ops with the most self CPU time and the kernels with the most GPU time, and writes
Chrome traces (gzip) for the first and last lengths to ``--traces``. This found the
scalar loads of dynamic kernels (issue 11) and the boxed extern calls (issue 12).

    KILN_FARM=inprocess python3 bench/decoder_profile.py --lengths 512,2048 --traces /tmp/t
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _busy_ms(events: list[Any], calls: int) -> tuple[float, float, float]:
    """(busy, span, events) per call over the GPU events of ``calls`` calls."""
    import torch

    spans = sorted((e.time_range.start, e.time_range.end) for e in events
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        return 0.0, 0.0, 0.0
    busy, (start, end) = 0, spans[0]
    for s, e in spans[1:]:
        if s > end:
            busy, start = busy + end - start, s
        end = max(end, e)
    busy += end - start
    return busy / calls / 1e3, (spans[-1][1] - spans[0][0]) / calls / 1e3, len(spans) / calls


def profile_one(fn: Any, x: Any, tag: str, traces: Path | None, calls: int = 5) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from bench.gpu_bench import time_fn

    wall = time_fn(fn, [[x]], 20)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn(x)
        torch.cuda.synchronize()
    busy, span, count = _busy_ms(list(prof.events()), calls)
    print(f"## {tag}: wall {wall:.3f} ms; GPU busy {busy:.3f} ms; GPU span {span:.3f} ms; "
          f"{count:.0f} GPU events a call", flush=True)
    averages = prof.key_averages()
    for k in sorted(averages, key=lambda k: k.self_cpu_time_total, reverse=True)[:14]:
        print(f"#  cpu {k.key[:70]:70s} x{k.count / calls:.0f} "
              f"{k.self_cpu_time_total / calls / 1e3:.3f} ms")
    for k in sorted(averages, key=lambda k: getattr(k, "self_device_time_total", 0),
                    reverse=True)[:10]:
        print(f"#  gpu {k.key[:70]:70s} x{k.count / calls:.0f} "
              f"{getattr(k, 'self_device_time_total', 0) / calls / 1e3:.3f} ms")
    if traces is not None:
        traces.mkdir(parents=True, exist_ok=True)
        path = traces / f"trace-{tag}.json"
        prof.export_chrome_trace(str(path))
        with open(path, "rb") as f, gzip.open(f"{path}.gz", "wb") as g:
            g.write(f.read())
        path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="512,2048")
    parser.add_argument("--traces", default=None, help="folder for Chrome traces")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp()
    for var, sub in (("KILN_CACHE_DIR", "k"), ("TRITON_CACHE_DIR", "t"),
                     ("TORCHINDUCTOR_CACHE_DIR", "i")):
        os.environ.setdefault(var, f"{scratch}/{sub}")
    os.environ.setdefault("KILN_STORE", f"file://{scratch}/s")
    os.environ.setdefault("KILN_FARM", "inprocess")
    import torch

    from tests.models import Decoder

    torch.manual_seed(0)
    model = Decoder(vocab=32000, d=1024, heads=16, layers=4).cuda().half().eval()
    lengths = [int(n) for n in args.lengths.split(",")]
    xs = {n: torch.randint(0, 32000, (4, n), device="cuda") for n in lengths}
    traces = Path(args.traces) if args.traces else None
    from kiln import KilnFallbackWarning

    for backend, dynamic in (("inductor", False), ("kiln", False), ("inductor", True),
                             ("kiln", True)):
        torch._dynamo.reset()
        fn = torch.compile(model, backend=backend, dynamic=dynamic)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", KilnFallbackWarning)  # eager is not Kiln's
            for n in lengths:
                torch.testing.assert_close(fn(xs[n]), model(xs[n]), rtol=3e-2, atol=3e-2)
            if backend == "kiln":
                from kiln.frontend.core.client import wait_for_background

                wait_for_background(600)
            for n in lengths:
                tag = f"{backend}-{'dynamic' if dynamic else 'static'}-{n}"
                keep = traces if n in (lengths[0], lengths[-1]) else None
                profile_one(fn, xs[n], tag, keep)


if __name__ == "__main__":
    main()
