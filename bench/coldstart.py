"""Cold start on real models (a benchmark, not a test): time from ``torch.compile`` to
the first output, each measurement in a fresh process, model construction excluded.

Models (bench/coldstart_models.py): HF GPT-2 forward (config, random weights), torchvision
ResNet-18 forward, a transformer-encoder training step (embedding, 4 layers, MLM-style
loss, fwd+bwd, bf16 autocast on GPU), a 24-layer decoder-only transformer forward, and
torchvision ResNet-50 forward (``resnet50``: 53 convolutions of four widths, for a worker
sweep over layers that differ: ``--sweep-model resnet50``), and a ResNet-50 training step
(``resnet50_train``: forward, loss and backward, frozen BatchNorm, fp16 autocast; its
forward and backward graphs both compiled as regions: ``--sweep-model resnet50_train``).

Modes:
    inductor_cold    stock torch.compile, empty Inductor/Triton caches
    inductor_warm    again, same caches (same machine)
    inductor_mega    empty caches plus inductor_cold's mega-cache blob
                     (torch.compiler.save_cache_artifacts / load_cache_artifacts; loading
                     it is inside the timing): a new machine
    kiln_inprocess   KILN_FARM=inprocess, empty store and caches
    kiln_farm        through a farm already up and warm (`kiln farm up`), empty store
    kiln_default     KILN_FARM=local with no farm up (must compile here at once)
    kiln_warm        kiln_inprocess's store and caches (same machine)
    kiln_warm_new    kiln_inprocess's store only; empty Kiln, Triton and XDG caches
The large model (deep24, 24 layers; ``--sweep-model``) is compiled as regions
(``KILN_REGIONS=on``, unless ``--kiln-env`` says otherwise; its rows fail if it was
not) and the worker sweep (``--workers 1,4,8,16``: a farm of that many CPUs each)
compiles its distinct regions on the farm's workers at once. On a 16-core host the
sweep takes about 4 to 6 minutes (per worker count: the farm's start and warm-up, 20 to
40 s, then one fresh-process run).
A warm mode runs its cold mode first when that was not asked for (its row is shown).
The ``kiln_farm`` rows run first (one farm up for every model), then the sweep, then
each model's modes in order. ``--budget SECONDS`` keeps the whole run within that time: a
row is not started with less than ``--row-min`` seconds left (a farm: plus its start),
a row still running at the end is stopped, and the table says which (``skip``);
``--results`` is written after every row, so a run cut short from outside keeps them.
Kiln's packages are byte-compiled before the first row (as a wheel install does).
Each Kiln row checks the client's counters and `kiln stats --json` (a hit is a hit, a
farm compile went to the farm through its gateway, and the client never imported Ray;
the default compiled here without waiting for a farm),
fails on KilnFallbackWarning, and compares the output with eager.

    python bench/coldstart.py --smoke --device cpu                 # this CPU machine
    python bench/coldstart.py --models gpt2 --modes inductor_cold,kiln_farm
    python bench/coldstart.py --models deep24 --workers 1,4,8,16 --modes none
    python bench/coldstart.py --models deep24 --workers 1,16 --modes kiln_inprocess \
        --kiln-env KILN_REGIONS=off          # the same without regional compilation
    python bench/coldstart.py --results r.json ...  then  --table r.json

``--results`` appends rows to a JSON file so that runs split over several calls print
one table (``--table``). ``--trace DIR`` writes each Kiln run's timeline (KILN_TRACE) and
shows its top critical-path stages, and where GPU autotuners ran benchmarks, each GPU's
busy time.

``--compile-mode max-autotune`` compiles every row (Inductor's and Kiln's) with that
``torch.compile`` mode; Kiln rows then also check that the matmuls were tuned (on a GPU:
every GEMM problem benchmarked or found cached, none left untuned) and report how many.
With ``kiln_farm`` the template configs compile on the farm's CPU workers and each
problem is timed on the farm's GPU autotuners (``--farm-cpus``, ``--farm-gpus``):

    python3 bench/coldstart.py --models gpt2 --modes inductor_cold,kiln_farm \
        --compile-mode max-autotune --farm-cpus 16 --trace /tmp/traces
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODES = ("inductor_cold", "inductor_warm", "inductor_mega", "kiln_inprocess", "kiln_farm",
         "kiln_default", "kiln_warm", "kiln_warm_new")
PRIMING = {"inductor_warm": "inductor_cold", "inductor_mega": "inductor_cold",
           "kiln_warm": "kiln_inprocess", "kiln_warm_new": "kiln_inprocess"}
RESULT = "COLDSTART_RESULT "
FARM_UP_S = 40.0  # `kiln farm up` with its warm-up, on the 16-core host (for --budget)
# Training steps: their graphs take the AOT path warm too.
TRAINING_MODELS = frozenset({"encoder_train", "resnet50_train"})


# ---------------------------------------------------------------------------------------
# The child: one measurement.


def child(model: str, mode: str, device: str, smoke: bool,
          compile_mode: str | None = None) -> dict[str, Any]:
    import warnings

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from coldstart_models import MODELS, compare

    torch.manual_seed(0)
    case = MODELS[model](device, smoke)
    ref = [t.detach().clone() for t in case.step(case.module)]
    _sync(device)
    kiln = mode.startswith("kiln")
    torch._dynamo.reset()  # before Kiln's import: a reset drops its Dynamo timing hook
    selections: list[dict[str, Any]] = []
    graphs: list[dict[str, Any]] = []  # each graph's key and what its lookup found
    if kiln:
        from kiln.frontend.core import compile as kiln_compile
        from kiln.frontend.core.fallback import KilnFallbackWarning

        warnings.simplefilter("error", KilnFallbackWarning)
        kiln_compile.observers.append(lambda name, result: selections.append(
            result.compiled.stats.get("gemm_selection") or {}))
        kiln_compile.observers.append(lambda name, result: graphs.append(
            {"name": name, "key": result.key.key, "parts": result.key.parts,
             "source": result.source, "lookup": result.lookup,
             "autotuned": bool(result.compiled.autotuned)}))
    from sampler import begin_from_env, write

    profile, sampler = _profiler(), begin_from_env()
    start, start_us = time.perf_counter(), time.time_ns() / 1000.0
    mega_load = os.environ.get("BENCH_MEGA_LOAD")
    if mega_load:
        torch.compiler.load_cache_artifacts(Path(mega_load).read_bytes())
    compiled = torch.compile(case.module, backend="kiln" if kiln else "inductor",
                             mode=compile_mode)
    out = case.step(compiled)
    _sync(device)
    seconds = time.perf_counter() - start
    write(sampler)
    if profile is not None:
        profile.disable()
        profile.dump_stats(os.environ["BENCH_PROFILE"])
    if kiln:
        _mark_first_output(start_us)
    mega_save = os.environ.get("BENCH_MEGA_SAVE")
    if mega_save:
        saved = torch.compiler.save_cache_artifacts()
        if saved is not None:
            Path(mega_save).write_bytes(saved[0])
    checked = compare([t.detach() for t in out], ref, case.tol, case.outputs)
    result: dict[str, Any] = {"seconds": seconds, "numerics_ok": checked.ok,
                              "max_scaled_err": checked.worst, "outputs": checked.summary(),
                              "numerics_problem": checked.problem(), "note": case.note}
    if kiln:
        result["counters"] = _kiln_counters()
        result["graphs"] = graphs
        result["ray_in_client"] = "ray" in sys.modules  # the farm is reached through its gateway
        result["gemm"] = {k: sum(int(s.get(k, 0)) for s in selections)
                          for k in ("problems", "cached", "benchmarked", "untuned")}
        result["note"] = "; ".join(filter(None, [case.note, aot_note(result["counters"])]))
    return result


def aot_note(counters: dict[str, Any]) -> str:
    """What the AOT cache did: Dynamo graphs served with no AOTAutograd trace, graphs
    traced, and why the cache did not serve those it could not."""
    why = ", ".join(f"{k.removeprefix('aot_uncached_')} {v}" for k, v in sorted(counters.items())
                    if k.startswith("aot_uncached_"))
    return (f"aot: {counters.get('aot_hits', 0)} served, {counters.get('aot_traces', 0)} "
            f"traced" + (f" (not cacheable: {why})" if why else ""))


def _profiler() -> Any:
    """``BENCH_PROFILE=path`` (``--profile DIR``): cProfile the timed part to that path
    (it slows the row: a profiled row's seconds are not a measurement)."""
    if not os.environ.get("BENCH_PROFILE"):
        return None
    import cProfile

    profile = cProfile.Profile()
    profile.enable()
    return profile


def _mark_first_output(start_us: float) -> None:
    """The measured time as one span of the timeline: its critical path then ends at
    the first output, and the first call's own work shows as this span's own time."""
    from kiln.compiler import trace
    from kiln.frontend.trace import flush

    if trace.recording():
        trace.complete("torch.compile to first output", start_us, time.time_ns() / 1000.0,
                       cat="bench")
        flush()


def precompile_bytecode() -> None:
    """Byte-compile Kiln's packages once before measuring, as installing a wheel does:
    an editable checkout would otherwise compile them inside the first Kiln row."""
    import compileall

    for package in ("compiler", "frontend", "workers", "artifact_store"):
        compileall.compile_dir(str(ROOT / package), quiet=1, workers=0)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _kiln_counters() -> dict[str, Any]:
    from kiln.frontend.core.client import _clients, process_counters

    totals = process_counters()
    for client in list(_clients.values()):
        client.counters.flush()
    return totals


# ---------------------------------------------------------------------------------------
# The parent: environments, farms, checks, the table.


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.root = Path(args.workdir or tempfile.mkdtemp(prefix="kiln-coldstart-"))
        self.farm_file = self.root / "farm" / "farm.json"
        self.rows: list[dict[str, Any]] = []
        self.done: set[tuple[str, str]] = set()
        self.deadline = time.monotonic() + args.budget if args.budget else None
        results = Path(args.results) if args.results else None
        self.earlier = json.loads(results.read_text()) if results and results.exists() else []

    def add_row(self, row: dict[str, Any]) -> None:
        """Keep a row, and write the results file at once (a run cut short keeps it)."""
        self.rows.append(row)
        if self.args.results:
            Path(self.args.results).write_text(json.dumps(self.earlier + self.rows, indent=1))

    def time_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()

    def out_of_time(self, model: str, what: str, needs: float) -> bool:
        """True (and a row saying so) when less than ``needs`` seconds of ``--budget``
        are left: the row is not started, so the run ends inside its budget."""
        left = self.time_left()
        if left is None or left >= needs:
            return False
        self.add_row({"model": model, "mode": what, "ok": False, "skipped": True,
                      "problem": f"not run: {max(left, 0):.0f} s of --budget left, "
                                 f"{needs:.0f} s needed"})
        self.done.add((model, what))  # a warm row does not try its cold row again
        print(f"[coldstart] {model} {what}: not run (budget)", file=sys.stderr, flush=True)
        return True

    def base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KILN_", "TORCHINDUCTOR_", "TRITON_", "BENCH_"))
               and k not in ("RAY_ADDRESS", "XDG_CACHE_HOME")}
        if self.args.ray_bin and Path(self.args.ray_bin).is_dir():
            env["PATH"] = f"{self.args.ray_bin}{os.pathsep}{env.get('PATH', '')}"
        return env

    def caches(self, folder: Path, fresh: bool) -> dict[str, str]:
        if fresh and folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True, exist_ok=True)
        return {"XDG_CACHE_HOME": str(folder / "xdg"), "TRITON_CACHE_DIR": str(folder / "triton"),
                "TORCHINDUCTOR_CACHE_DIR": str(folder / "inductor"),
                "KILN_CACHE_DIR": str(folder / "kiln")}

    def env_for(self, model: str, mode: str, farm_file: Path | None = None,
                tag: str = "") -> dict[str, str]:
        m = self.root / model
        env = self.base_env()
        if mode == "inductor_cold":
            env.update(self.caches(m / "inductor-a", fresh=True),
                       BENCH_MEGA_SAVE=str(m / "mega.bin"))
        elif mode == "inductor_warm":
            env.update(self.caches(m / "inductor-a", fresh=False))
        elif mode == "inductor_mega":
            env.update(self.caches(m / "inductor-b", fresh=True),
                       BENCH_MEGA_LOAD=str(m / "mega.bin"))
        elif mode in ("kiln_inprocess", "kiln_warm"):
            if mode == "kiln_inprocess" and (m / "store").exists():
                shutil.rmtree(m / "store")
            env.update(self.caches(m / "kiln-a", fresh=mode == "kiln_inprocess"),
                       KILN_STORE=str(m / "store"), KILN_AUTOTUNE_EXIT_WAIT="900",
                       KILN_FARM="inprocess" if mode == "kiln_inprocess" else "local",
                       KILN_FARM_FILE=str(m / "no-farm.json"))
        elif mode == "kiln_warm_new":
            env.update(self.caches(m / "kiln-b", fresh=True), KILN_STORE=str(m / "store"),
                       KILN_FARM="local", KILN_FARM_FILE=str(m / "no-farm.json"))
        elif mode in ("kiln_default", "kiln_farm"):
            folder = m / f"{mode}{tag}"
            # Exit waits for background tuning (not timed) rather than cut it short.
            env.update(self.caches(folder, fresh=True), KILN_STORE=str(folder / "store"),
                       KILN_FARM="local", KILN_AUTOTUNE_EXIT_WAIT="900",
                       KILN_FARM_FILE=str(farm_file or m / "no-farm.json"))
        if mode.startswith("kiln"):
            if model == self.args.sweep_model:  # whatever its size (smoke is small)
                env["KILN_REGIONS"] = "on"
            env.update(kv.split("=", 1) for kv in self.args.kiln_env)
            if env.get("KILN_DEBUG", "") not in ("", "0") and "KILN_DEBUG_DIR" not in env:
                debug = m / f"debug-{mode}{tag}"  # each row's own (explain_warm_miss)
                shutil.rmtree(debug, ignore_errors=True)
                env["KILN_DEBUG_DIR"] = str(debug)
        env["KILN_STATS_FILE"] = str(m / f"stats-{mode}{tag}.json")
        Path(env["KILN_STATS_FILE"]).unlink(missing_ok=True)
        if self.args.profile:
            Path(self.args.profile).mkdir(parents=True, exist_ok=True)
            env["BENCH_PROFILE"] = str(Path(self.args.profile).resolve() /
                                       f"{model}-{mode}{tag}.prof")
        if self.args.sample:  # every thread's stacks and the process's events, timed part
            Path(self.args.sample).mkdir(parents=True, exist_ok=True)
            env["BENCH_SAMPLE"] = str(Path(self.args.sample).resolve() /
                                      f"{model}-{mode}{tag}.json")
        if self.args.trace and mode.startswith("kiln"):
            Path(self.args.trace).mkdir(parents=True, exist_ok=True)
            env["KILN_TRACE"] = str(Path(self.args.trace).resolve() / f"{model}-{mode}{tag}.json")
        return env

    def measure(self, model: str, mode: str, env: dict[str, str], label: str = "") -> None:
        command = [sys.executable, __file__, "--child", model, mode, "--device",
                   self.args.device] + (["--smoke"] if self.args.smoke else []) + \
            (["--compile-mode", self.args.compile_mode] if self.args.compile_mode else [])
        if self.out_of_time(model, label or mode, self.args.row_min):
            return
        left = self.time_left()
        limit = min(self.args.timeout, left) if left is not None else self.args.timeout
        print(f"[coldstart] {model} {label or mode} ...", file=sys.stderr, flush=True)
        wall = time.perf_counter()
        try:
            proc = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=limit)
        except subprocess.TimeoutExpired:
            cut = limit < self.args.timeout  # --budget ran out, not the row's own limit
            self.add_row({"model": model, "mode": label or mode, "ok": False,
                          "skipped": cut, "process_s": time.perf_counter() - wall,
                          "problem": f"{'stopped: --budget ran out' if cut else 'timed out'} "
                                     f"after {limit:.0f} s"})
            self.done.add((model, label or mode))
            print(f"[coldstart] {model} {label or mode}: stopped after {limit:.0f} s",
                  file=sys.stderr, flush=True)
            return
        row: dict[str, Any] = {"model": model, "mode": label or mode,
                               "device": self.args.device, "smoke": self.args.smoke,
                               "compile_mode": self.args.compile_mode or "",
                               "process_s": time.perf_counter() - wall}
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT)]
        if proc.returncode != 0 or not lines:
            row.update(ok=False, problem=f"exit {proc.returncode}: {proc.stderr[-1500:]}")
        else:
            row.update(json.loads(lines[-1][len(RESULT):]))
            problems = [] if row["numerics_ok"] else [
                f"output differs from eager (scaled error {row['max_scaled_err']:.3g}: "
                f"{row.get('numerics_problem', '')})"]
            if mode.startswith("kiln"):
                problems += check_kiln(mode, row["counters"], kiln_stats(env), model)
                if problems and mode.startswith("kiln_warm"):
                    problems += self.explain_warm_miss(model, mode, row, env)
                problems += check_gemm(row, self.args.compile_mode)
                if mode == "kiln_farm" and row.get("ray_in_client"):
                    problems.append("the client imported Ray: it should reach the farm "
                                    "through the farm's gateway")
                row["regions"] = regions_note(row["counters"])
                if model == self.args.sweep_model and env.get("KILN_REGIONS") != "off" \
                        and not row["regions"]:
                    problems.append(f"{model} was not compiled as regions")
                elif model == self.args.sweep_model and model in TRAINING_MODELS \
                        and env.get("KILN_REGIONS") != "off" \
                        and row["counters"].get("regional_graphs", 0) < 2 \
                        and not row["counters"].get("region_plan_hits") \
                        and row["counters"].get("aot_region_plans", 0) < 2:
                    problems.append(f"{model}: its forward and backward graphs were not "
                                    f"both compiled as regions")
            if problems:  # what Kiln said about it (a farm given up, a fallback)
                said = [ln for ln in proc.stderr.splitlines()
                        if "kiln:" in ln.lower() or "kiln artifact store" in ln.lower()]
                problems += said[-3:]
            row.update(ok=not problems, problem="; ".join(problems))
        if env.get("KILN_TRACE") and Path(env["KILN_TRACE"]).exists():
            row["trace"] = env["KILN_TRACE"]
            row["critical_path"] = trace_top(env["KILN_TRACE"])
            row["gpu_usage"] = trace_gpus(env["KILN_TRACE"])
        self.add_row(row)
        self.done.add((model, label or mode))
        status = "ok" if row["ok"] else f"FAILED: {row['problem']}"
        print(f"[coldstart] {model} {label or mode}: {row.get('seconds', float('nan')):.2f} s "
              f"{status}", file=sys.stderr, flush=True)

    def explain_warm_miss(self, model: str, mode: str, row: dict[str, Any],
                          env: dict[str, str]) -> list[str]:
        """For a warm row that compiled: each graph that was not a hit, by name, with
        its key, what the store lookup found, the cold run's key for that graph and which
        key parts differ (``kiln explain-miss`` on both runs' KILN_DEBUG folders where
        they are there), and what the store holds under the warm key now."""
        cold = next((r for r in reversed(self.rows) if r["model"] == model
                     and r["mode"] == PRIMING[mode] and r.get("graphs")), None)
        cold_graphs = {g["name"]: g for g in (cold or {}).get("graphs", [])}
        c = row.get("counters", {})
        lines = [f"counters: repairs {c.get('repairs', 0)}, load_errors "
                 f"{c.get('load_errors', 0)}, hits_autotuned {c.get('hits_autotuned', 0)}"]
        for graph in row.get("graphs", []):
            if graph["source"] == "hit":
                continue
            said = (f"graph {graph['name']} was not a hit ({graph['source']}; lookup: "
                    f"{graph['lookup']}), key {graph['key'][:16]}")
            before = cold_graphs.get(graph["name"])
            if before is None:
                said += f"; no graph of that name in the {PRIMING[mode]} row"
            elif before["key"] == graph["key"]:
                said += f"; the {PRIMING[mode]} row had the same key"
            else:
                from kiln.frontend.core.keys import explain_miss

                differ = explain_miss(before.get("parts", {}), graph.get("parts", {}))
                said += (f"; the {PRIMING[mode]} row's key was {before['key'][:16]}: "
                         + " | ".join(differ))
                said += self.explain_debug(model, PRIMING[mode], mode, graph["name"], env)
            said += "; the store now: " + inspect_key(graph["key"], env)
            lines.append(said)
        return lines

    def explain_debug(self, model: str, cold_mode: str, warm_mode: str, name: str,
                      env: dict[str, str]) -> str:
        """``kiln explain-miss`` on the two runs' KILN_DEBUG requests of graph ``name``."""
        folders = [sorted((self.root / model / f"debug-{m}").glob(f"{name}_request_*"))
                   for m in (cold_mode, warm_mode)]
        if not all(folders):
            return " (run with --kiln-env KILN_DEBUG=1 for the requests in detail)"
        proc = subprocess.run([sys.executable, "-m", "kiln.frontend.cli.main", "explain-miss",
                               str(folders[0][-1]), str(folders[1][-1])], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        return " | explain-miss: " + " | ".join((proc.stdout or proc.stderr).splitlines())

    def run_mode(self, model: str, mode: str) -> None:
        if (model, mode) in self.done:
            return
        if mode in PRIMING and (model, PRIMING[mode]) not in self.done:
            self.run_mode(model, PRIMING[mode])
        if mode in PRIMING and not any(r.get("ok") for r in self.rows
                                       if (r["model"], r["mode"]) == (model, PRIMING[mode])):
            self.add_row({"model": model, "mode": mode, "ok": False, "skipped": True,
                          "problem": f"not run: its {PRIMING[mode]} row did not pass"})
            self.done.add((model, mode))
            return
        if mode == "kiln_farm":
            return  # run by run_farm, with the farm up
        self.measure(model, mode, self.env_for(model, mode))

    def run_farm(self, models: list[str], workers: int | None, tag: str = "") -> None:
        """Bring a farm up (warm), compile each model through it once, bring it down."""
        if self.out_of_time(",".join(models), f"kiln_farm{tag}",
                            self.args.row_min + FARM_UP_S):
            return
        farm_env = self.base_env()
        farm_env.update(self.caches(self.root / f"farm{tag}", fresh=True),
                        KILN_FARM_FILE=str(self.farm_file))
        command = [sys.executable, "-m", "kiln.frontend.cli.main", "farm", "up"]
        if workers or self.args.farm_cpus:
            command += ["--num-cpus", str(workers or self.args.farm_cpus)]
        if self.args.device == "cuda":
            command += ["--num-gpus", str(self.args.farm_gpus)]
        up = subprocess.run(command, env=farm_env, cwd=ROOT, capture_output=True, text=True,
                            timeout=600)
        if up.returncode != 0:
            for model in models:
                self.add_row({"model": model, "mode": f"kiln_farm{tag}", "ok": False,
                                  "problem": f"kiln farm up failed: {up.stderr[-1500:]}"})
            return
        try:
            for model in models:
                env = self.env_for(model, "kiln_farm", self.farm_file, tag)
                self.measure(model, "kiln_farm", env, label=f"kiln_farm{tag}")
        finally:
            subprocess.run([sys.executable, "-m", "kiln.frontend.cli.main", "farm", "down"],
                           env=farm_env, cwd=ROOT, capture_output=True, timeout=120)


def inspect_key(key: str, env: dict[str, str]) -> str:
    """What the store holds under ``key`` (``kiln inspect --json``), in a few words."""
    proc = subprocess.run([sys.executable, "-m", "kiln.frontend.cli.main", "inspect", key,
                           "--json"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    if proc.returncode != 0:
        return (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
    try:
        manifest = json.loads(proc.stdout)
    except ValueError:
        return proc.stdout[:200]
    meta = manifest.get("meta") or {}
    if meta.get("kind") == "regions":
        return "a regions plan"
    graph = meta.get("graph") or {}
    return (f"an artifact ({len(meta.get('kernels') or [])} kernels, autotuned "
            f"{graph.get('autotuned')}, made {meta.get('compile', {}).get('mode')})")


def kiln_stats(env: dict[str, str]) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "kiln.frontend.cli.main", "stats", "--json"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    return json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr}


def check_kiln(mode: str, counters: dict[str, Any], stats: dict[str, Any],
               model: str = "") -> list[str]:
    """Whether a Kiln run did what its mode says (from its counters and `kiln stats`)."""
    c = {k: counters.get(k, 0) for k in ("graphs", "hits", "compiles", "compiles_local",
                                         "compiles_farm", "farm_fallbacks", "farm_not_up",
                                         "aot_hits", "aot_misses", "aot_rejected",
                                         "aot_uncached_regions",
                                         "aot_uncached_training")}
    # A warm start skips AOTAutograd for every Dynamo graph the AOT cache serves: none
    # missed or was rejected (graphs it cannot serve are traced, counted by reason), and
    # every model has at least one served: training models too (their graphs are served
    # since frontend/core/aot/training.py; one recorded "training" means a forward whose
    # backward never came), and graphs compiled as regions (their plans are served since
    # the AOT cache names a plan's key: one recorded "regions" means a regional graph
    # whose plan was not stored, or a region failed).
    aot_skipped = c["aot_misses"] == 0 and c["aot_rejected"] == 0 and c["aot_hits"] >= 1 \
        and c["aot_uncached_training"] == 0 and c["aot_uncached_regions"] == 0
    want = {
        "kiln_inprocess": c["compiles_local"] >= 1 and c["hits"] == 0,
        "kiln_default": c["compiles_local"] >= 1 and c["farm_not_up"] >= 1
        and c["compiles_farm"] == 0,
        "kiln_farm": c["compiles_farm"] >= 1 and c["compiles_local"] == 0
        and c["farm_fallbacks"] == 0,
        "kiln_warm": c["hits"] == c["graphs"] >= 1 and c["compiles"] == 0 and aot_skipped,
        "kiln_warm_new": c["hits"] == c["graphs"] >= 1 and c["compiles"] == 0
        and aot_skipped,
    }[mode]
    problems = [] if want else [f"counters do not match mode {mode}: {c}"]
    if mode.startswith("kiln_warm") and "error" not in stats \
            and stats.get("aot_hits") != c["aot_hits"]:
        problems.append(f"kiln stats --json says aot_hits {stats.get('aot_hits')}, the "
                        f"client {c['aot_hits']}")
    if "error" in stats:
        problems.append(f"kiln stats --json failed: {stats['error'][-500:]}")
    elif (stats.get("graphs"), stats.get("compiles")) != (c["graphs"], c["compiles"]):
        problems.append(f"kiln stats --json says graphs {stats.get('graphs')} compiles "
                        f"{stats.get('compiles')}, the client {c['graphs']} / {c['compiles']}")
    return problems


def check_gemm(row: dict[str, Any], compile_mode: str | None) -> list[str]:
    """Max-autotune on a GPU: the matmuls were tuned (benchmarked, or cached), not left
    to the library call untuned."""
    gemm = row.get("gemm") or {}
    if not compile_mode or "max-autotune" not in compile_mode or row["device"] != "cuda":
        return []
    if not gemm.get("problems"):
        return [f"{compile_mode}: no GEMM problem was tuned ({gemm})"]
    if gemm.get("untuned"):
        return [f"{compile_mode}: {gemm['untuned']} GEMM problem(s) left untuned: no GPU "
                f"autotuner measured them ({gemm})"]
    return []


def trace_gpus(path: str) -> str:
    """Each GPU autotuner's busy seconds and benchmarks, from the timeline."""
    from kiln.frontend.trace import gpu_usage, load_spans

    try:
        usage = gpu_usage(load_spans(path))
    except ValueError as e:
        return f"unreadable: {e}"
    return "; ".join(f"GPU {u['gpu']} {u['busy_ms'] / 1000:.2f}s ({u['jobs']})"
                     for u in usage["gpus"])
def regions_note(counters: dict[str, Any]) -> str:
    """What regional compilation did in a Kiln row ("" if no graph was cut)."""
    if counters.get("aot_region_plans"):
        return f"regions: {counters['aot_region_plans']} plan(s) served by the AOT cache"
    if counters.get("region_plan_hits"):
        return f"regions: {counters['region_plan_hits']} plan(s) from the store"
    if not counters.get("regional_graphs"):
        return ""
    return (f"regions: {counters['regional_graphs']} graph(s) cut into "
            f"{counters.get('regions', 0)}, {counters.get('regions_distinct', 0)} distinct")


def trace_top(path: str, n: int = 4) -> str:
    from kiln.frontend.trace import load_spans, summarize

    try:
        rows = summarize(load_spans(path))["critical_path"][:n]
    except ValueError as e:
        return f"unreadable: {e}"
    return ", ".join(f"{r['stage']} {r['ms'] / 1000:.2f}s" for r in rows)


# ---------------------------------------------------------------------------------------
# The table.


def table(rows: list[dict[str, Any]]) -> str:
    def base(mode: str) -> dict[tuple[str, str], Any]:
        return {(r["model"], r.get("compile_mode", "")): r.get("seconds") for r in rows
                if r["mode"] == mode and r.get("ok")}

    cold, mega, warm = base("inductor_cold"), base("inductor_mega"), base("inductor_warm")
    lines = [f"{'model':<14} {'mode':<30} {'seconds':>8} {'vs ind.':>8}  check  note",
             "-" * 100]
    for r in rows:
        ref = {"kiln_warm": warm, "kiln_warm_new": mega}.get(r["mode"], cold).get(
            (r["model"], r.get("compile_mode", "")))
        secs = r.get("seconds")
        ratio = f"{secs / ref:.2f}x" if secs and ref and r["mode"].startswith("kiln") else ""
        check = "ok" if r.get("ok") else "skip" if r.get("skipped") else "FAIL"
        note = r.get("problem") or " | ".join(x for x in (r.get("note"), r.get("regions"))
                                              if x)
        if r.get("gemm", {}).get("problems"):
            g = r["gemm"]
            note = (f"{note} | GEMM problems {g['problems']}: benchmarked {g['benchmarked']}, "
                    f"cached {g['cached']}, untuned {g['untuned']}").strip(" |")
        if r.get("critical_path"):
            note = f"{note} | path: {r['critical_path']}".strip(" |")
        if r.get("gpu_usage"):
            note = f"{note} | {r['gpu_usage']}".strip(" |")
        shown = f"{secs:8.2f}" if isinstance(secs, (int, float)) else f"{'-':>8}"
        mode = r["mode"] + (f" [{r['compile_mode']}]" if r.get("compile_mode") else "")
        lines.append(f"{r['model']:<14} {mode:<30} {shown} {ratio:>8}  {check:<5}  "
                     f"{note[:300]}")
    lines.append("vs ind.: Kiln cold rows against inductor_cold, kiln_warm against "
                 "inductor_warm, kiln_warm_new against inductor_mega")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="gpt2,resnet18,encoder_train,deep24")
    p.add_argument("--modes", default=",".join(MODES), help="comma list, or none")
    p.add_argument("--workers", default="", help="farm sweep on deep24, e.g. 1,4,8,16")
    p.add_argument("--sweep-model", default="deep24",
                   help="the large model: its Kiln rows must be compiled as regions")
    p.add_argument("--kiln-env", action="append", default=[], metavar="KILN_X=VALUE",
                   help="a setting for every Kiln row (repeatable), e.g. KILN_REGIONS=off "
                        "to compare with whole-graph compiles, KILN_REGION_NODES=100")
    p.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    p.add_argument("--smoke", action="store_true", help="tiny sizes (a CPU check)")
    p.add_argument("--farm-gpus", type=int, default=1)
    p.add_argument("--farm-cpus", type=int, default=0,
                   help="CPUs of the kiln_farm row's farm (default: all of this machine)")
    p.add_argument("--compile-mode", default=None,
                   help="torch.compile mode of every row, e.g. max-autotune")
    p.add_argument("--ray-bin", default="/tmp/site/bin", help="where `ray` is, if not on PATH")
    p.add_argument("--workdir", default=None)
    p.add_argument("--timeout", type=float, default=900, help="seconds per row")
    p.add_argument("--budget", type=float, default=0,
                   help="seconds for the whole run: a row is not started when less than "
                        "--row-min is left (a farm row: plus the farm's start), and a row "
                        "running at the end is stopped; the table shows them as skip")
    p.add_argument("--row-min", type=float, default=40.0,
                   help="seconds a row needs at least, for --budget")
    p.add_argument("--trace", default=None, help="folder for each Kiln run's timeline")
    p.add_argument("--results", default=None, help="append rows to this JSON file")
    p.add_argument("--profile", default=None,
                   help="folder for a cProfile of each row's timed part (pstats files; "
                        "profiled seconds are not measurements)")
    p.add_argument("--sample", default=None,
                   help="folder for each row's stack samples and events (bench/sampler.py)")
    p.add_argument("--table", default=None, help="print the table of a results file")
    p.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        model, mode = args.child
        print(RESULT + json.dumps(child(model, mode, args.device, args.smoke,
                                        args.compile_mode)), flush=True)
        return 0
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return 0
    bench = Bench(args)
    precompile_bytecode()
    models = [m for m in args.models.split(",") if m]
    modes = [m for m in args.modes.split(",") if m and m != "none"]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        print(f"unknown modes {unknown}; choose from {', '.join(MODES)}", file=sys.stderr)
        return 2
    if "kiln_farm" in modes:  # first: the rows a --budget must not leave out
        bench.run_farm(models, None)
    for n in [int(w) for w in args.workers.split(",") if w]:
        bench.run_farm([args.sweep_model], n, tag=f"_w{n}")
    for model in models:
        for mode in modes:
            bench.run_mode(model, mode)
    print(table(bench.earlier + bench.rows))
    skipped = sum(1 for r in bench.rows if r.get("skipped"))
    if skipped:
        print(f"{skipped} row(s) not run: --budget {args.budget:g} s ran out", file=sys.stderr)
    return 0 if all(r.get("ok") or r.get("skipped") for r in bench.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
