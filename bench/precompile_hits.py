"""Count a GPU client's store hits for a model precompiled elsewhere (H200 host).

    KILN_STORE=file://$PWD/fleet_store python3 bench/precompile_hits.py \\
        tests.fleet_models:sdpa_block_half --shapes 4x16x32 --dtype float16

Runs ``torch.compile(model, backend="kiln")`` under ``torch.no_grad()`` on this GPU for
each shape set, as a serving client would, and prints one JSON object: graphs, hits, the
keys and sources, and the largest difference from eager. The target is 100% hits for a
store that ``kiln precompile --gpu h200`` (with ``--versions-from`` this host's
``kiln versions --json``) filled on a host without a GPU.
"""

from __future__ import annotations

import argparse
import json
import warnings
from typing import Any

import torch


def main() -> None:
    from kiln.frontend.cli.targets import load_entry, parse_shapes
    from kiln.frontend.core import compile as kiln_compile
    from kiln.frontend.core.fallback import KilnFallbackWarning

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target")
    parser.add_argument("--shapes", nargs="+", type=parse_shapes, required=True)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    model = load_entry(args.target)().cuda()
    seen: list[Any] = []
    kiln_compile.observers.append(lambda graph, result: seen.append(result))
    worst = 0.0
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", KilnFallbackWarning)
        for shapes in args.shapes:
            torch._dynamo.reset()
            inputs = [torch.randn(*s, device="cuda", dtype=dtype) if dtype.is_floating_point
                      else torch.randint(0, 2, s, device="cuda", dtype=dtype) for s in shapes]
            out = torch.compile(model, backend="kiln", dynamic=False)(*inputs)
            worst = max(worst, (out.float() - model(*inputs).float()).abs().max().item())
    hits = sum(r.source == "hit" for r in seen)
    print(json.dumps({"graphs": len(seen), "hits": hits, "hit_rate": hits / max(1, len(seen)),
                      "max_abs_err_vs_eager": worst,
                      "graphs_detail": [{"key": r.key.key, "source": r.source} for r in seen]},
                     indent=2))


if __name__ == "__main__":
    main()
