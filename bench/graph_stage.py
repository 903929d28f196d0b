"""The graph stage of a large model (a benchmark, not a test): how long lowering,
scheduling and fusion, memory planning and codegen take for the forward graph of a
decoder-only transformer of N layers, traced on fake CUDA tensors (no GPU needed: this is
the farm's CPU-side work), against the number of layers.

    .venv/bin/python bench/graph_stage.py --layers 2,6,12,24
    .venv/bin/python bench/graph_stage.py --layers 24 --d 1024 --seq 1024

It prints one row per size: nodes in the ATen graph, kernels generated, a hash of the
output code (wrapper and every kernel source: a refactor of the graph stage must leave
it unchanged), and milliseconds per pass (the compiler's own stage timings), so one can
see whether the graph stage grows faster than the graph (a reason to split it into
regions on workers).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from coldstart_models import DecoderLM  # noqa: E402

from kiln.compiler.decompositions import trace_aten  # noqa: E402
from kiln.compiler.driver import compile_graph  # noqa: E402


def measure(layers: int, d: int, heads: int, seq: int, batch: int, vocab: int
            ) -> dict[str, float]:
    model = DecoderLM(vocab, d, layers, heads, seq).eval()
    params = dict(model.named_parameters())
    with FakeTensorMode():
        fake_params = {n: torch.empty_strided(p.shape, p.stride(), dtype=p.dtype,
                                              device="cuda") for n, p in params.items()}
        ids = torch.empty((batch, seq), dtype=torch.int64, device="cuda")

    def forward(ids: torch.Tensor, *flat: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(model, dict(zip(params, flat)), (ids,))

    args = [ids, *fake_params.values()]
    start = time.perf_counter()
    with torch.no_grad():
        gm = trace_aten(forward, args)
    traced = time.perf_counter() - start
    compiled = compile_graph(gm, args, {}, name=f"deep{layers}", compile_kernels=False)
    code = hashlib.sha256(compiled.wrapper_source.encode())
    for spec in compiled.kernels:
        code.update(spec.source.encode())
    return {"layers": layers, "nodes": len(gm.graph.nodes), "kernels": len(compiled.kernels),
            "code": code.hexdigest()[:16], "trace_ms": traced * 1e3,
            **{f"{k}_ms": v * 1e3 for k, v in compiled.timings.items()}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="2,6,12,24")
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    args = p.parse_args()
    rows = [measure(int(n), args.d, args.heads, args.seq, args.batch, args.vocab)
            for n in args.layers.split(",")]
    stages = [k for k in rows[0] if k.endswith("_ms")]
    print(f"{'layers':>6} {'nodes':>6} {'kernels':>7} {'output code':>16} "
          + " ".join(f"{s[:-3]:>12}" for s in stages))
    for r in rows:
        print(f"{r['layers']:>6} {r['nodes']:>6} {r['kernels']:>7} {r['code']:>16} "
              + " ".join(f"{r[s]:>12.0f}" for s in stages))
    return 0


if __name__ == "__main__":
    sys.exit(main())
