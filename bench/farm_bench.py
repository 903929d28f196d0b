"""Farm benchmark (not a test): cold compile through the farm with 1..N CPU workers, and
warm start (a second process that hits the store) per graph.

The model: G graphs of K distinct kernels each (a chain of matmuls, each followed by its
own pointwise or reduction epilogue with its own constants, so no two kernels are alike
and fusion cannot merge them). Requests are built directly from the traced ATen graphs:
Dynamo's own tracing is not part of any figure.

1. cold: for each worker count N, a fresh process starts an embedded Ray with N CPUs,
   waits until its CompileWorkers and kernel processes are warm (imports done), then
   compiles all G graphs at once through the client (farm, publish). Every run has its
   own empty store, Triton cache and Kiln cache, so nothing is reused. The in-process
   mode (no Ray, one kernel after another) is the baseline.
2. warm: a fresh process compiles the same requests again: every graph hits. Per graph,
   the backend time = request (serialize + hash) + store fetch + decode + load; load
   runs only where the target's device exists (a CUDA target on a CPU machine is
   reported without it).

    .venv/bin/python bench/farm_bench.py --workers 1,2 --target cuda
    .venv/bin/python bench/farm_bench.py --workers 1,4,8,16 --target cuda   # a GPU host

Targets: fan-out speedup >= 0.7 x workers (up to the machine's cores); warm start
<= 50 ms per graph of 50 kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------
# The model.


def layer_chain(graph: int, kernels: int) -> Any:
    """A function of (x, w): ``kernels`` matmuls, each with a distinct epilogue."""
    import torch

    def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        for i in range(kernels):
            h = x @ w
            scale = 1.0 + (graph * kernels + i) / 997.0
            if i % 3 == 0:
                x = (h * scale).softmax(-1)
            elif i % 3 == 1:
                x = torch.tanh(h + scale) * 0.5
            else:
                x = (h - h.mean(-1, keepdim=True)) * (1.0 / scale)
        return x

    return chain


def build_graphs(graphs: int, kernels: int, target: str) -> list[tuple[Any, list[Any]]]:
    """(gm, inputs) per graph; CUDA inputs are metadata only (no GPU needed to build)."""
    import dataclasses

    import torch

    from kiln.compiler.decompositions import trace_aten
    from kiln.compiler.request import TensorMeta

    out: list[tuple[Any, list[Any]]] = []
    for g in range(graphs):
        args = [torch.randn(64, 256), torch.randn(256, 256)]
        gm = trace_aten(layer_chain(g, kernels), args)
        if target == "cuda":
            metas = [dataclasses.replace(TensorMeta.from_tensor(a), device_type="cuda")
                     for a in args]
            out.append((gm, metas))
        else:
            out.append((gm, args))
    return out


def target_dict(target: str) -> dict[str, Any]:
    from kiln.compiler.driver import DEFAULT_TARGETS

    if target == "cuda":
        import torch

        if torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            return {"kind": "cuda", "backend": "cuda", "arch": major * 10 + minor,
                    "warp_size": 32}
    return dict(DEFAULT_TARGETS[target])  # type: ignore[call-overload,no-any-return]


# ---------------------------------------------------------------------------------------
# Child processes: one cold run, or one warm run.


def child_cold(args: argparse.Namespace) -> dict[str, Any]:
    """Compile every graph at once through the farm (``--mode``: N CPUs or inprocess)."""
    import ray

    from kiln.frontend.client import KilnClient
    from kiln.frontend.compile import build_request
    from kiln.frontend.config import KilnConfig
    from kiln.frontend.farm import InProcessFarm, RayFarm

    graphs = build_graphs(args.graphs, args.kernels, args.target)
    config = KilnConfig.resolve({"autotune": False})
    requests = [build_request(gm, inputs, config, target=target_dict(args.target))
                for gm, inputs in graphs]
    if args.mode == "inprocess":
        farm: Any = InProcessFarm()
        warm_s = 0.0
    else:
        farm = RayFarm(None, num_cpus=int(args.mode))
        start = time.perf_counter()
        ray.get(farm.actor().wait_warm.remote(), timeout=600)
        warm_s = time.perf_counter() - start
    client = KilnClient(config, farm=farm)
    start = time.perf_counter()
    if args.mode == "inprocess":
        results = [client.compile(r) for r in requests]
    else:
        with ThreadPoolExecutor(len(requests)) as pool:
            results = list(pool.map(client.compile, requests))
    wall = time.perf_counter() - start
    assert all(r.source == ("local" if args.mode == "inprocess" else "farm") for r in results)
    timings = [r.compiled.timings for r in results]
    return {"mode": args.mode, "wall_s": wall, "warm_up_s": warm_s,
            "kernels": sum(len(r.compiled.binaries) for r in results),
            "graph_stage_s": sum(t.get("graph_compile", 0.0) for t in timings),
            "kernel_cpu_s": sum(t.get("kernel_compile_cpu", 0.0) for t in timings)}


def child_warm(args: argparse.Namespace) -> dict[str, Any]:
    """Every graph again, from the store: backend time per graph, split by step."""
    import torch

    from kiln.compiler.compiled_graph import load
    from kiln.frontend.client import client_for
    from kiln.frontend.compile import build_request, graph_constants
    from kiln.frontend.config import KilnConfig

    graphs = build_graphs(args.graphs, args.kernels, args.target)
    can_load = args.target == "cpu" or torch.cuda.is_available()
    device = torch.device("cuda" if args.target == "cuda" else "cpu")
    per_graph = []
    for gm, inputs in graphs:
        start = time.perf_counter()
        config = KilnConfig.resolve({"autotune": False})
        request = build_request(gm, inputs, config, target=target_dict(args.target))
        built = time.perf_counter()
        result = client_for(config).compile(request)
        fetched = time.perf_counter()
        if can_load:
            load(result.compiled, graph_constants(gm), device)
        done = time.perf_counter()
        assert result.source == "hit", result.source
        per_graph.append({"request_ms": 1e3 * (built - start),
                          "hash_ms": 1e3 * result.timings["hash_s"],
                          "fetch_ms": 1e3 * result.timings["fetch_s"],
                          "decode_ms": 1e3 * result.timings["decode_s"],
                          "load_ms": 1e3 * (done - fetched) if can_load else None,
                          "backend_ms": 1e3 * (done - start),
                          "kernels": len(result.compiled.kernels)})
    return {"loaded": can_load, "graphs": per_graph}


# ---------------------------------------------------------------------------------------
# The parent: fresh caches per run, a snapshot of the sources, the report.


def snapshot_sources(live: bool) -> Path:
    """The packages copied once, so that edits to the tree during a run change nothing."""
    if live:
        return ROOT
    sys.path.insert(0, str(ROOT))
    import kiln

    return Path(kiln.snapshot_sources(ROOT, tempfile.mkdtemp(prefix="kiln-bench-src-")))


def run_child(src: Path, work: Path, argv: list[str], *, store: Path,
              fresh_caches: bool) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KILN_") and k not in ("RAY_ADDRESS", "TRITON_INTERPRET")}
    path = os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH", "")) if p)
    env.update(PYTHONPATH=path, KILN_STORE=str(store), KILN_STATS_FILE="off",
               XDG_CACHE_HOME=str(work / "cache"), TRITON_CACHE_DIR=str(work / "triton"))
    if fresh_caches:
        shutil.rmtree(work / "cache", ignore_errors=True)
        shutil.rmtree(work / "triton", ignore_errors=True)
    proc = subprocess.run([sys.executable, str(src / "bench_child.py"), *argv], cwd=src,
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"bench child {argv} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import torch

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU"
    return f"{os.cpu_count()} CPU cores ({cpu}), {gpu}, Python {platform.python_version()}"


def report(cold: list[dict[str, Any]], warm: dict[str, Any], args: argparse.Namespace
           ) -> None:
    base = next(r for r in cold if r["mode"] == "inprocess")
    one = next((r for r in cold if r["mode"] == "1"), None)
    print(f"# {machine()}; target {args.target}; {args.graphs} graphs x {args.kernels} "
          "kernels")
    print("| mode | cold wall | vs in-process | vs 1 worker | kernel CPU | graph stage |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in cold:
        name = "in-process" if r["mode"] == "inprocess" else f"farm, {r['mode']} worker(s)"
        vs_one = f"{one['wall_s'] / r['wall_s']:.2f}x" if one and r["mode"] != "inprocess" \
            else ""
        print(f"| {name} | {r['wall_s']:.1f} s | {base['wall_s'] / r['wall_s']:.2f}x | "
              f"{vs_one} | {r['kernel_cpu_s']:.1f} s | {r['graph_stage_s']:.1f} s |")
    rows = warm["graphs"]
    print(f"\nwarm start, per graph ({'with' if warm['loaded'] else 'without'} load):")
    for name in ("request_ms", "hash_ms", "fetch_ms", "decode_ms", "load_ms", "backend_ms"):
        values = [g[name] for g in rows if g[name] is not None]
        if values:
            print(f"  {name:<11} first {values[0]:7.1f} ms, median of the rest "
                  f"{statistics.median(values[1:] or values):7.1f} ms")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2", help="CPU worker counts, e.g. 1,4,8,16")
    parser.add_argument("--target", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--graphs", type=int, default=4)
    parser.add_argument("--kernels", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--live", action="store_true", help="run the live tree, no snapshot")
    parser.add_argument("--child", choices=["cold", "warm"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="inprocess", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.child:
        result = child_cold(args) if args.child == "cold" else child_warm(args)
        print(json.dumps(result))
        return
    src = snapshot_sources(args.live)
    shutil.copy(Path(__file__), src / "bench_child.py")
    work = Path(tempfile.mkdtemp(prefix="kiln-farm-bench-"))
    common = ["--target", args.target, "--graphs", str(args.graphs),
              "--kernels", str(args.kernels)]
    cold = []
    for mode in ["inprocess", *args.workers.split(",")]:
        store = work / f"store-{mode}"
        cold.append(run_child(src, work, ["--child", "cold", "--mode", mode, *common],
                              store=store, fresh_caches=True))
        print(f"cold {mode}: {cold[-1]['wall_s']:.1f} s", file=sys.stderr)
    warm = run_child(src, work, ["--child", "warm", *common],
                     store=work / f"store-{args.workers.split(',')[-1]}", fresh_caches=False)
    if args.json:
        print(json.dumps({"machine": machine(), "cold": cold, "warm": warm}, indent=2))
    else:
        report(cold, warm, args)
    if not args.live:
        shutil.rmtree(src, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
