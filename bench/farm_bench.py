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

3. ``--gpus 1,2,4``: autotuning spread over N GPUs instead (issue 17). Each run is a
   fresh process with an embedded Ray of this machine's CPUs and N GPUs (one ``Autotuner``
   actor each) that compiles, in max-autotune mode, G graphs of P matmuls of distinct
   shapes (each a GEMM problem of its own, each followed by a bias and an activation the
   template fuses): every template config is compiled on the CPU workers and every
   problem timed on whichever GPU frees first. Per N: the first answer (the farm answers
   after the GEMM choices), the time until the tuned artifacts are in the store, the
   benchmarks' wall time (first start to last end, from the farm's timeline) against
   1 GPU, and each GPU's busy time and benchmarks. A warm-up run first fills Triton's
   cache, so the timed runs isolate the benchmarks (``--cold-kernels``: no warm-up).
   ``--fake-gpus`` (a machine without GPUs): Ray's fake GPU resources, and the tests'
   deterministic fake benchmark, each candidate holding its GPU ``--fake-ms``.

    .venv/bin/python bench/farm_bench.py --workers 1,2 --target cuda
    .venv/bin/python bench/farm_bench.py --workers 1,4,8,16 --target cuda   # a GPU host
    python3 bench/farm_bench.py --gpus 1,2,4                        # a multi-GPU host
    .venv/bin/python bench/farm_bench.py --gpus 1,4 --fake-gpus      # scheduling, on CPU

Targets: fan-out speedup >= 0.7 x workers (up to the machine's cores); warm start
<= 50 ms per graph of 50 kernels; autotune wall time with 4 GPUs <= 0.35x that with 1.
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


def gemm_ladder(layers: int) -> Any:
    """A function of (x, w0, b0, w1, b1, ...): ``layers`` matmuls, each followed by its
    bias and an activation (gelu, tanh in turn), which a template fuses into its store."""
    import torch
    import torch.nn.functional as F

    def ladder(x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        for i in range(layers):
            h = x @ params[2 * i] + params[2 * i + 1]
            x = F.gelu(h) if i % 2 == 0 else torch.tanh(h)
        return x

    return ladder


# (rows, first width, width step, dtype) of the ladders: GPU-sized, or tiny for the fake
# GPUs of a CPU machine (what is measured there is scheduling, not kernels).
LADDER_SIZES = {"full": (4096, 1024, 128, "float16"), "small": (16, 8, 1, "float32")}


def build_ladders(graphs: int, problems: int, size: str) -> list[tuple[Any, list[Any]]]:
    """(gm, CUDA input metas) per graph: every matmul of every graph a distinct problem
    (widths grow by a step, so no two share K and N)."""
    import dataclasses

    import torch

    from kiln.compiler.decompositions import trace_aten
    from kiln.compiler.request import TensorMeta

    rows, first, step, dtype_name = LADDER_SIZES[size]
    dtype = getattr(torch, dtype_name)
    out: list[tuple[Any, list[Any]]] = []
    for g in range(graphs):
        widths = [first + step * (g * (problems + 1) + j) for j in range(problems + 1)]
        args = [torch.randn(rows, widths[0], dtype=dtype)]
        for k, n in zip(widths, widths[1:]):
            args += [torch.randn(k, n, dtype=dtype), torch.randn(n, dtype=dtype)]
        gm = trace_aten(gemm_ladder(problems), args)
        out.append((gm, [dataclasses.replace(TensorMeta.from_tensor(a), device_type="cuda")
                         for a in args]))
    return out


# ---------------------------------------------------------------------------------------
# Child processes: one cold run, or one warm run.


def child_cold(args: argparse.Namespace) -> dict[str, Any]:
    """Compile every graph at once through the farm (``--mode``: N CPUs or inprocess)."""
    import ray

    from kiln.frontend.config import KilnConfig
    from kiln.frontend.core.client import KilnClient
    from kiln.frontend.core.compile import build_request
    from kiln.frontend.transports.inprocess import InProcessFarm
    from kiln.workers.ray_farm import RayFarm

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


def child_tune(args: argparse.Namespace) -> dict[str, Any]:
    """Max-autotune of the ladders through an embedded farm with ``--mode`` GPUs."""
    import ray

    from kiln.frontend.config import KilnConfig
    from kiln.frontend.core.client import KilnClient
    from kiln.frontend.core.compile import build_request
    from kiln.frontend.core.keys import compute_key
    from kiln.frontend.trace import gpu_usage, spans_from_events
    from kiln.workers.ray_farm import RayFarm

    size = args.size or ("small" if args.fake_gpus else "full")
    config = KilnConfig.resolve({}).with_mode("max-autotune")
    requests = [build_request(gm, metas, config, target=target_dict("cuda"))
                for gm, metas in build_ladders(args.graphs, args.problems, size)]
    farm = RayFarm(None, num_cpus=args.cpus or None, num_gpus=int(args.mode))
    ray.get(farm.actor().wait_warm.remote(), timeout=600)
    client = KilnClient(config, farm=farm)
    start = time.perf_counter()
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(client.compile, requests))
    first_s = time.perf_counter() - start
    for request in requests:  # kernels other than templates tune after the answer
        farm.tuned(compute_key(request).key, timeout=1800)
    stored_s = time.perf_counter() - start
    assert all(r.source == "farm" for r in results), [r.source for r in results]
    usage = gpu_usage(spans_from_events(ray.get(farm.actor().tuning_trace.remote())))
    selections = [r.compiled.stats.get("gemm_selection") or {} for r in results]
    return {"gpus": int(args.mode), "first_answer_s": first_s, "in_store_s": stored_s,
            "selection_s": max(r.compiled.timings.get("gemm_selection", 0.0)
                               for r in results),
            "bench_wall_s": usage["wall_ms"] / 1e3, "usage": usage["gpus"],
            "actors": ray.get(farm.actor().gpu_usage.remote()), "size": size,
            "benchmarked": sum(s.get("benchmarked", 0) for s in selections),
            "problems": sum(s.get("problems", 0) for s in selections),
            "published": sum(bool(r.compiled.published_to) for r in results)}


def child_warm(args: argparse.Namespace) -> dict[str, Any]:
    """Every graph again, from the store: backend time per graph, split by step."""
    import torch

    from kiln.compiler.compiled_graph import load
    from kiln.frontend.config import KilnConfig
    from kiln.frontend.core.client import client_for
    from kiln.frontend.core.compile import build_request
    from kiln.frontend.core.graphs import graph_constants

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
              fresh_caches: bool, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KILN_") and k not in ("RAY_ADDRESS", "TRITON_INTERPRET")}
    path = os.pathsep.join(p for p in (str(src), os.environ.get("PYTHONPATH", "")) if p)
    env.update(PYTHONPATH=path, KILN_STORE=str(store), KILN_STATS_FILE="off",
               XDG_CACHE_HOME=str(work / "cache"), TRITON_CACHE_DIR=str(work / "triton"),
               **(extra_env or {}))
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


def run_gpu_sweep(src: Path, work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One tune run per GPU count (after a warm-up run unless ``--cold-kernels``)."""
    counts = [int(n) for n in args.gpus.split(",") if n]
    extra = {"KILN_LOCAL_CACHE": "off", "KILN_AUTOTUNE_EXIT_WAIT": "0"}
    if args.fake_gpus:
        extra.update(KILN_TEST_FAKE_AUTOTUNE="1", KILN_TEST_FAKE_AUTOTUNE_MS=str(args.fake_ms))
    common = ["--graphs", str(args.graphs), "--problems", str(args.problems),
              "--cpus", str(args.cpus)] + (["--size", args.size] if args.size else []) + \
        (["--fake-gpus"] if args.fake_gpus else [])
    runs = [] if args.cold_kernels else [("warm-up", max(counts))]
    runs += [(str(n), n) for n in counts]
    rows = []
    for i, (label, n) in enumerate(runs):
        row = run_child(src, work, ["--child", "tune", "--mode", str(n), *common],
                        store=work / f"store-tune-{i}", fresh_caches=i == 0, extra_env=extra)
        print(f"tune {label}: {n} GPU(s), benchmarks {row['bench_wall_s']:.2f} s, first "
              f"answer {row['first_answer_s']:.2f} s", file=sys.stderr)
        if label != "warm-up":
            rows.append(row)
    return rows


def report_gpus(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    one = next((r for r in rows if r["gpus"] == 1), None)
    fake = f"fake GPUs, {args.fake_ms} ms per candidate" if args.fake_gpus else "real GPUs"
    print(f"# {machine()}; {fake}; {args.graphs} graphs x {args.problems} GEMM problems "
          f"({rows[0]['size']} sizes), max-autotune, {args.cpus or os.cpu_count()} CPUs; "
          f"{'cold' if args.cold_kernels else 'warm'} Triton cache")
    print("| GPUs | benchmarks wall | vs 1 GPU | first answer | tuned in store | "
          "GEMM selection | benchmarked | per GPU: busy s (benchmarks) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        vs = f"{r['bench_wall_s'] / one['bench_wall_s']:.2f}x" if one and \
            one["bench_wall_s"] else ""
        per = ", ".join(f"{u['busy_ms'] / 1e3:.2f} ({u['jobs']})" for u in r["usage"])
        print(f"| {r['gpus']} | {r['bench_wall_s']:.2f} s | {vs} | {r['first_answer_s']:.2f} s"
              f" | {r['in_store_s']:.2f} s | {r['selection_s']:.2f} s | "
              f"{r['benchmarked']}/{r['problems']} | {per} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="1,2", help="CPU worker counts, e.g. 1,4,8,16")
    parser.add_argument("--target", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--graphs", type=int, default=4)
    parser.add_argument("--kernels", type=int, default=50)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--live", action="store_true", help="run the live tree, no snapshot")
    parser.add_argument("--gpus", default="", help="autotune over N GPUs, e.g. 1,2,4")
    parser.add_argument("--problems", type=int, default=16, help="GEMM problems per graph")
    parser.add_argument("--cpus", type=int, default=0, help="Ray CPUs (default: all)")
    parser.add_argument("--size", choices=sorted(LADDER_SIZES), default="")
    parser.add_argument("--fake-gpus", action="store_true",
                        help="Ray's fake GPUs and the fake benchmark (a CPU machine)")
    parser.add_argument("--fake-ms", type=float, default=50.0)
    parser.add_argument("--cold-kernels", action="store_true",
                        help="no warm-up run: kernel compiles are in the figures")
    parser.add_argument("--child", choices=["cold", "warm", "tune"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", default="inprocess", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.child:
        children = {"cold": child_cold, "warm": child_warm, "tune": child_tune}
        print(json.dumps(children[args.child](args)))
        return
    src = snapshot_sources(args.live)
    shutil.copy(Path(__file__), src / "bench_child.py")
    work = Path(tempfile.mkdtemp(prefix="kiln-farm-bench-"))
    if args.gpus:
        rows = run_gpu_sweep(src, work, args)
        if args.json:
            print(json.dumps({"machine": machine(), "gpus": rows}, indent=2))
        else:
            report_gpus(rows, args)
        if not args.live:
            shutil.rmtree(src, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)
        return
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
