"""Max-autotune's matmul choices: compiled on CPU workers, timed on a GPU autotuner,
cached in the store; a second process with another model of the same GEMM shapes
benchmarks nothing. This machine has no GPU: the benchmark is the deterministic fake
(``KILN_TEST_FAKE_AUTOTUNE``), which makes the first template config the fastest; the
compiles, the fan-out, the store and the bookkeeping are real."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from farm_helpers import RayHead, python_env, run_python

from kiln.artifact_store import open_store
from kiln.compiler.codegen.triton.templates import gemm_configs
from kiln.compiler.ir.template import GemmProblem
from kiln.frontend.trace import gpu_usage, load_spans
from kiln.workers.select import StoreChoiceCache

# One model per process: NAME picks it. Both pose the same matmul (64x128 @ 128x96,
# fp32, followed by pointwise work).
CLIENT = """
import json
import os
import torch
import torch.nn.functional as F
from farm_helpers import cuda_request
from kiln.frontend.core.client import KilnClient
from kiln.frontend.core.compile import request_options
from kiln.frontend.config import KilnConfig
from kiln.frontend.trace import start_recording

if os.environ.get("KILN_TRACE"):
    start_recording()  # the timeline of the compile, written at exit

def model_a(x, w, b):
    return F.gelu(x @ w + b)

def model_b(x, w, b):
    return torch.tanh(torch.addmm(b, x, w)) * 3

def model_c(x, w, b):  # two problems: 64x96x128, then 64x128x96
    return torch.relu(x @ w + b) @ w.t()

config = KilnConfig.resolve().with_mode("max-autotune")
request = cuda_request({NAME}, shapes=((64, 128), (128, 96), (96,)),
                       options=request_options(config))
result = KilnClient(config).compile(request)
compiled = result.compiled
print(json.dumps({"source": result.source, "selection": compiled.stats.get("gemm_selection"),
                  "choices": compiled.stats.get("gemm_choices"),
                  "kernels": [k.name for k in compiled.kernels],
                  "wrapper": compiled.wrapper_source}))
"""


def _check_pair(first: dict, second: dict, store: Path) -> None:  # type: ignore[type-arg]
    assert first["selection"] == {"problems": 1, "cached": 0, "benchmarked": 1, "untuned": 0}
    assert second["selection"] == {"problems": 1, "cached": 1, "benchmarked": 0, "untuned": 0}
    for out in (first, second):
        (key, choice), = out["choices"].items()
        assert key.startswith("choice-") and choice["kind"] == "template"
        # The winner is recorded with every candidate's time: the extern call, each config.
        timings = choice["timings"]
        configs = gemm_configs(GemmProblem.from_dict(choice["problem"]))
        assert timings[0]["kind"] == "extern" and len(timings) == 1 + len(configs) > 4
        assert choice["config"] == timings[1]["config"]
        assert [k for k in out["kernels"] if k.startswith("triton_tem_fused_mm")], out["kernels"]
        assert "torch.mm(" not in out["wrapper"] and "aten.mm" not in out["wrapper"]
        assert "torch.addmm(" not in out["wrapper"] and "aten.addmm" not in out["wrapper"]
    cache = StoreChoiceCache(open_store(f"file://{store}", stats_file=False))
    (key, _), = first["choices"].items()
    assert cache.get(key) is not None and cache.get(key)["kind"] == "template"  # type: ignore[index]


def _drop_graph_artifacts(store: Path) -> int:
    """Remove every graph's manifest (those with a wrapper), keeping choices and kernels:
    the next process compiles its graph again and must find its choice."""
    dropped = 0
    for entry in (store / "ac").rglob("*"):
        if entry.is_file() and not entry.name.startswith("choice-") and \
                b"wrapper.py" in entry.read_bytes():
            entry.unlink()
            dropped += 1
    return dropped


def _gemm_stats(env: dict[str, str]) -> dict[str, int]:
    """`kiln stats --json`'s max-autotune counters (every process so far)."""
    proc = subprocess.run([sys.executable, "-m", "kiln.frontend.cli.main", "stats", "--json"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    stats = json.loads(proc.stdout)
    return {k: stats[f"gemm_{k}"] for k in ("problems", "benchmarked", "cached", "untuned")}


def test_inprocess_choices_are_cached_in_the_store(tmp_path: Path) -> None:
    env = python_env(KILN_FARM="inprocess", KILN_TEST_FAKE_AUTOTUNE="1",
                     KILN_STORE=str(tmp_path / "store"), KILN_LOCAL_CACHE="off",
                     XDG_CACHE_HOME=str(tmp_path / "client"),
                     KILN_STATS_FILE=str(tmp_path / "stats.json"))
    first = run_python(CLIENT.replace("{NAME}", "model_a"), env)
    assert _gemm_stats(env) == {"problems": 1, "benchmarked": 1, "cached": 0, "untuned": 0}
    second = run_python(CLIENT.replace("{NAME}", "model_b"), env)
    # The second process, another model with the same GEMM shape: no benchmark, as
    # `kiln stats` counts them over both processes.
    assert _gemm_stats(env) == {"problems": 2, "benchmarked": 1, "cached": 1, "untuned": 0}
    assert first["source"] == second["source"] == "local"
    _check_pair(first, second, tmp_path / "store")
    # A second process with the first model, its graph no longer stored: it compiles the
    # graph again and benchmarks nothing (the choice comes from the store).
    assert _drop_graph_artifacts(tmp_path / "store") >= 2
    again = run_python(CLIENT.replace("{NAME}", "model_a"), env)
    assert again["source"] == "local"
    assert again["selection"] == {"problems": 1, "cached": 1, "benchmarked": 0, "untuned": 0}
    assert again["choices"] == first["choices"]


def test_inprocess_selection_of_several_problems(tmp_path: Path) -> None:
    """Every problem's configs compile in one pool, then each problem is timed."""
    env = python_env(KILN_FARM="inprocess", KILN_TEST_FAKE_AUTOTUNE="1",
                     KILN_STORE=str(tmp_path / "store"), KILN_LOCAL_CACHE="off",
                     XDG_CACHE_HOME=str(tmp_path / "client"), KILN_KERNEL_THREADS="2",
                     KILN_STATS_FILE=str(tmp_path / "stats.json"))
    out = run_python(CLIENT.replace("{NAME}", "model_c"), env)
    assert out["selection"] == {"problems": 2, "cached": 0, "benchmarked": 2, "untuned": 0}
    sizes = set()
    for choice in out["choices"].values():
        p = GemmProblem.from_dict(choice["problem"])
        sizes.add((p.m, p.n, p.k))
        assert choice["kind"] == "template" and choice["config"] == gemm_configs(p)[0]
        assert len(choice["timings"]) == 1 + len(gemm_configs(p))
    assert sizes == {(64, 96, 128), (64, 128, 96)}
    assert len([k for k in out["kernels"] if k.startswith("triton_tem_fused_mm")]) == 2
    assert _gemm_stats(env) == {"problems": 2, "benchmarked": 2, "cached": 0, "untuned": 0}


def _check_farm_timeline(path: Path, choice: dict) -> None:  # type: ignore[type-arg]
    """The first farm compile's timeline: every template config compiled by kernel tasks
    in more than one worker process at once, then one benchmark on the GPU autotuner."""
    spans = load_spans(path)
    compiles = [s for s in spans if s.name == "kernel compile" and s.process == "kernel worker"]
    configs = len(choice["timings"]) - 1
    assert len(compiles) >= configs
    assert len({s.pid for s in compiles}) >= 2
    assert any(a.pid != b.pid and a.start < b.end and b.start < a.end
               for a in compiles for b in compiles)  # in parallel
    (bench,) = [s for s in spans if s.name == "gemm benchmark"]
    assert bench.gpu == "0" and bench.process.startswith("GPU autotuner")
    assert bench.start >= min(s.end for s in compiles)
    assert [s for s in spans if s.name == "gemm selection" and s.process == "farm coordinator"]
    usage = gpu_usage(spans)
    assert [(g["gpu"], g["jobs"]) for g in usage["gpus"]] == [("0", 1)]


def test_farm_benchmarks_on_its_autotuner_and_a_second_model_reuses_the_choice(
        tmp_path: Path) -> None:
    store = tmp_path / "store"
    head = RayHead(tmp_path / "gpu-head.log", num_cpus=2, num_gpus=1,
                   env={"KILN_TEST_FAKE_AUTOTUNE": "1", "KILN_STORE": str(store),
                        "KILN_LOCAL_CACHE": "off",
                        "XDG_CACHE_HOME": str(tmp_path / "workers")})
    try:
        env = python_env(KILN_FARM=head.address, KILN_STORE=str(store),
                         KILN_LOCAL_CACHE="off", XDG_CACHE_HOME=str(tmp_path / "client"),
                         KILN_STATS_FILE=str(tmp_path / "stats.json"))
        first = run_python(CLIENT.replace("{NAME}", "model_a"), env | {
            "KILN_TRACE": str(tmp_path / "first.json")}, timeout=400)
        # A new coordinator: the second model finds the choice in the store, not in memory.
        # One CPU (one kernel worker): only the first farm's compiles are checked for
        # running in parallel.
        head.stop()
        head = RayHead(tmp_path / "gpu-head2.log", num_cpus=1, num_gpus=1,
                       env={"KILN_TEST_FAKE_AUTOTUNE": "1", "KILN_STORE": str(store),
                            "KILN_LOCAL_CACHE": "off",
                            "XDG_CACHE_HOME": str(tmp_path / "workers")})
        env["KILN_FARM"] = head.address
        second = run_python(CLIENT.replace("{NAME}", "model_b"), env, timeout=400)
    finally:
        head.stop()
    assert first["source"] == second["source"] == "farm"
    assert _gemm_stats(env) == {"problems": 2, "benchmarked": 1, "cached": 1, "untuned": 0}
    _check_pair(first, second, store)
    _check_farm_timeline(tmp_path / "first.json", next(iter(first["choices"].values())))
