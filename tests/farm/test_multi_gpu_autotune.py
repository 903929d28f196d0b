"""Autotuning spread over several GPUs (issue 17), on a CPU machine: a real Ray cluster
with four fake GPUs (`ray start --num-gpus 4`), one ``Autotuner`` actor bound to each,
and the deterministic fake benchmark holding its GPU a fixed time per candidate (the
stand-in for GPU time). The compiles, the fan-out, the store and the scheduling are real.

One max-autotune graph of 8 distinct matmul problems is compiled three times, each by a
new coordinator: on all four GPUs (cold: the template configs compile on the CPU workers
and land in the farm's kernel store), then on one GPU and again on four, with the choices
removed from the store in between (so each benchmarks all 8 again) while the kernels
stay (so the benchmarks, not the compiles, decide the time). A scheduling check with a
wide margin, not a performance figure."""

from __future__ import annotations

from pathlib import Path

from farm_helpers import RayHead, python_env, run_python

# Two problems per GPU at four GPUs; each problem's template configs compile in the cold
# run, so the count sets the test's cost, while FAKE_MS sets the (fake) GPU time.
PROBLEMS = 8
FAKE_MS = 120  # per candidate: 8 problems of 3 or more candidates, about 3 s on one GPU

SCRIPT = """
import glob, json, os, time
import ray
import torch
from farm_helpers import cuda_request
from kiln.frontend.core.compile import request_options
from kiln.frontend.config import KilnConfig
from kiln.workers.ray_farm import use_auth_token
from kiln.frontend.trace import gpu_usage, spans_from_events
from kiln.workers.coordinator import get_farm_actor

def ladder(x, *ws):
    for w in ws:
        x = torch.tanh(x @ w)
    return x

shapes = [(16, 8)] + [(8 + i, 9 + i) for i in range({PROBLEMS})]
config = KilnConfig.resolve().with_mode("max-autotune")
request = cuda_request(ladder, shapes=shapes, options=request_options(config))
use_auth_token()
ray.init(address="{ADDRESS}", log_to_driver=False)

def run(name, max_gpus):
    farm = get_farm_actor(1, name=name, max_gpus=max_gpus)
    ray.get(farm.wait_warm.remote(), timeout=600)
    answer = ray.get(farm.compile.remote(request.to_bytes(), 0.0, None, False), timeout=900)
    events = ray.get(farm.tuning_trace.remote())
    lanes = [(e["tid"], e["ts"], e["ts"] + e["dur"]) for e in events
             if e["name"] == "gemm benchmark"]
    out = {"selection": answer["compiled"]["stats"]["gemm_selection"],
            "usage": gpu_usage(spans_from_events(events)), "lanes": lanes,
            "actors": ray.get(farm.gpu_usage.remote()), "stats": ray.get(farm.stats.remote())}
    ray.kill(farm)  # its autotuners die with it: their GPUs are free for the next
    for path in glob.glob(os.path.join("{STORE}", "ac", "*", "choice-*")):
        os.remove(path)  # the next coordinator benchmarks every problem again
    return out

print(json.dumps({"runs": [run("cold-4", None), run("warm-1", 1), run("warm-4", None)]}))
"""


def test_benchmarks_spread_over_four_fake_gpus_and_finish_sooner_than_on_one(
        tmp_path: Path) -> None:
    store = tmp_path / "store"
    # One CPU: each coordinator starts one kernel worker, not two (the cold run's template
    # configs compile one after another); the GPUs are what this test schedules.
    head = RayHead(tmp_path / "head.log", num_cpus=1, num_gpus=4,
                   env={"KILN_TEST_FAKE_AUTOTUNE": "1", "KILN_TEST_FAKE_AUTOTUNE_MS": str(FAKE_MS),
                        "KILN_STORE": str(store), "KILN_LOCAL_CACHE": "off",
                        "XDG_CACHE_HOME": str(tmp_path / "workers")})
    try:
        script = SCRIPT.replace("{PROBLEMS}", str(PROBLEMS)).replace(
            "{ADDRESS}", head.address).replace("{STORE}", str(store))
        env = python_env(KILN_STORE=str(store), KILN_LOCAL_CACHE="off",
                         XDG_CACHE_HOME=str(tmp_path / "client"))
        cold, one, four = run_python(script, env, timeout=900)["runs"]
    finally:
        head.stop()
    for run, gpus in ((cold, 4), (one, 1), (four, 4)):
        assert run["selection"] == {"problems": PROBLEMS, "cached": 0,
                                    "benchmarked": PROBLEMS, "untuned": 0}
        jobs = [g["jobs"] for g in run["usage"]["gpus"]]
        assert len(jobs) == gpus and sum(jobs) == PROBLEMS and min(jobs) >= 1, run["usage"]
        # One autotuner per GPU, each bound by Ray to its own (fake) GPU.
        ids = [a["gpu_ids"] for a in run["actors"]]
        assert len(ids) == gpus and all(len(i) == 1 for i in ids)
        assert len({i[0] for i in ids}) == gpus
        _assert_one_benchmark_at_a_time_per_gpu(run["lanes"])
    # The timed runs found every template config in the kernel store: no compile.
    assert cold["stats"]["kernel_compiles"] > 0
    assert one["stats"]["kernel_compiles"] == four["stats"]["kernel_compiles"] == 0
    wall1, wall4 = one["usage"]["wall_ms"], four["usage"]["wall_ms"]
    assert wall1 >= PROBLEMS * 3 * FAKE_MS * 0.9  # serial: at least 3 candidates each
    assert wall4 < 0.6 * wall1, (wall4, wall1)


def _assert_one_benchmark_at_a_time_per_gpu(lanes: list[list[float]]) -> None:
    by_gpu: dict[int, list[tuple[float, float]]] = {}
    for gpu, start, end in lanes:
        by_gpu.setdefault(int(gpu), []).append((start, end))
    for spans in by_gpu.values():
        spans.sort()
        assert all(a_end <= b_start + 1.0 for (_, a_end), (b_start, _) in zip(spans,
                                                                              spans[1:]))
