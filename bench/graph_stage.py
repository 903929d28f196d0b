"""The graph stage of a large model (a benchmark, not a test): how long lowering,
scheduling and fusion, memory planning and codegen take for the forward graph of a
decoder-only transformer of N layers, traced on fake CUDA tensors (no GPU needed: this is
the farm's CPU-side work), against the number of layers.

    .venv/bin/python bench/graph_stage.py --layers 2,6,12,24
    .venv/bin/python bench/graph_stage.py --layers 24 --d 1024 --seq 1024
    .venv/bin/python bench/graph_stage.py --layers 24 --regions 200 --processes 4

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


def trace(layers: int, d: int, heads: int, seq: int, batch: int, vocab: int
          ) -> tuple[torch.fx.GraphModule, list[torch.Tensor], float]:
    """The decoder's forward ATen graph on fake CUDA tensors, its inputs, seconds."""
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
    return gm, args, time.perf_counter() - start


def measure(layers: int, d: int, heads: int, seq: int, batch: int, vocab: int
            ) -> dict[str, float]:
    gm, args, traced = trace(layers, d, heads, seq, batch, vocab)
    compiled = compile_graph(gm, args, {}, name=f"deep{layers}", compile_kernels=False)
    code = hashlib.sha256(compiled.wrapper_source.encode())
    for spec in compiled.kernels:
        code.update(spec.source.encode())
    return {"layers": layers, "nodes": len(gm.graph.nodes), "kernels": len(compiled.kernels),
            "code": code.hexdigest()[:16], "trace_ms": traced * 1e3,
            **{f"{k}_ms": v * 1e3 for k, v in compiled.timings.items()}}


def measure_regions(layers: int, region_nodes: int, processes: int, **sizes: int
                    ) -> dict[str, float]:
    """The graph stage as regions: the distinct regions' graph stages one after another
    in this process, then all at once on ``processes`` graph-stage processes (warmed by
    a first round), against the whole graph's."""
    from concurrent.futures import ThreadPoolExecutor

    from kiln.compiler.driver import DEFAULT_TARGETS
    from kiln.compiler.keys import compute_key
    from kiln.compiler.regions import split_graph
    from kiln.frontend.core.serialize import make_request
    from kiln.workers.pipeline import compile_sources
    from kiln.workers.stage_pool import StagePool

    gm, args, _ = trace(layers, **sizes)
    target = dict(DEFAULT_TARGETS["cuda"])
    start = time.perf_counter()
    compile_graph(gm, args, {}, name="whole", target=target, compile_kernels=False)
    whole = time.perf_counter() - start
    split = split_graph(gm, args, region_nodes)
    assert split is not None, "the graph does not cut into regions"
    requests: dict[str, bytes] = {}
    for region in split.regions:
        request = make_request(region.gm, region.example_inputs, options={}, target=target)
        requests.setdefault(compute_key(request).key, request.to_bytes())
    start = time.perf_counter()
    for key, data in requests.items():
        compile_sources(data, key)
    serial = time.perf_counter() - start
    pool = StagePool(processes)
    try:
        with ThreadPoolExecutor(len(requests)) as threads:
            for _round in range(2):  # the first round waits for the processes to start
                start = time.perf_counter()
                list(threads.map(lambda kv: pool.compile_sources(kv[1], kv[0]),
                                 requests.items()))
                parallel = time.perf_counter() - start
    finally:
        pool.close()
    return {"layers": layers, "nodes": len(gm.graph.nodes), "regions": len(split.regions),
            "distinct": len(requests), "whole_ms": whole * 1e3, "serial_ms": serial * 1e3,
            f"pool{processes}_ms": parallel * 1e3}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", default="2,6,12,24")
    p.add_argument("--d", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--regions", type=int, default=0, metavar="NODES",
                   help="time the graph stage as regions of about NODES nodes instead")
    p.add_argument("--processes", type=int, default=4, help="graph-stage processes")
    args = p.parse_args()
    sizes = {"d": args.d, "heads": args.heads, "seq": args.seq, "batch": args.batch,
             "vocab": args.vocab}
    if args.regions:
        for n in args.layers.split(","):
            row = measure_regions(int(n), args.regions, args.processes, **sizes)
            print("  ".join(f"{k} {v:.0f}" for k, v in row.items()), flush=True)
        return 0
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
