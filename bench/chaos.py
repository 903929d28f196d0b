"""Chaos run (not a test): the farm and the store under faults, with the trust model of a
fleet, on this machine. Real parts: a `kiln farm up` Ray cluster (token auth on) whose
processes are the builder (they hold the private Ed25519 key and publish to the store),
an S3 API server (moto, loopback) as the store, and client processes that hold only the
public key with KILN_REQUIRE_SIGNED=1 and reach the farm through its gateway (`--via ray`:
they join its Ray cluster instead).

Scenarios, one after another on the same cluster and store (after a store fault, the next
starts once the farm's store cool-down, 30 s, has passed: its publishes are tried again):

    same-key        20 clients ask for one key at once
    distinct-keys   20 clients ask for 20 keys at once
    kill-worker     5 clients mid-compile; the CompileWorker processes are SIGKILLed
    store-outage    5 clients mid-compile; the S3 server stops until they are done
    disk-full       5 clients mid-compile; the S3 server's disk fills up (its last free
                    byte taken by another file) until they are done: the farm's publishes
                    fail; then space returns
    disk-freed      the same 5 graphs and 5 new ones: the farm publishes all 10 (the 5
                    again from its memory, no compile)
    kill-coordinator 5 clients mid-compile; the KilnFarm actor is killed (restarts empty)
    kill-head       5 clients mid-compile; the Ray head's process group is SIGKILLed (the
                    clients then live 75 s more, as a user's program would: they must
                    not be aborted by Ray for having joined the farm)

Each job is one graph (CPU target, C++ kernels): the client looks it up, has it compiled
(farm, or itself when the farm fails), loads it, runs it on fresh random inputs and
compares with eager. Reported per scenario: jobs completed, wrong results, compiles (the
coordinator's graph compiles started, finished or not, plus clients' local ones) against
distinct keys (`dup` is the excess), and how many artifacts the farm published. Clients
hold only the public key: what they compile themselves (the farm gone) is used, not
published, and compiled again by the next client that asks. At the end every artifact
published during the run is read back through a fresh public-key client: any that fails
is an artifact lost; and every manifest in the bucket is read and verified: one that is
visible but fails (a partial artifact) counts as damaged.

The S3 server keeps every object in a file on a disk of its own: a 64 MiB tmpfs mounted
in a user namespace (tests/smallfs.py, no root needed), where moto's object buffers go.
disk-full fills that disk with a filler file (a real ENOSPC in the server, which moto
answers with HTTP 500) and reads back every artifact published so far while it is full.

    .venv/bin/python bench/chaos.py                     # about 10 minutes on 2 CPUs
    .venv/bin/python bench/chaos.py --clients-per-process 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.smallfs import SmallFilesystem, moto_tempfile  # noqa: E402

BUCKET = "kiln-chaos"
SCENARIOS = ("same-key", "distinct-keys", "kill-worker", "store-outage", "disk-full",
             "disk-freed", "kill-coordinator", "kill-head")
STORE_DISK = 64 << 20
READ_BACK_TIMEOUT_S = 60.0
COOLDOWN_S = 30.0  # the store's circuit breaker after a fault (artifact_store.faults)

# One client process: builds its jobs' requests, compiles them on threads (one
# KilnClient per job: separate clients, as separate machines would be), loads and runs
# each against eager. Prints one JSON list.
CLIENT = r"""
import json, sys, threading, warnings
import torch
from kiln.compiler.compiled_graph import load
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import DEFAULT_TARGETS
from kiln.frontend.core.client import KilnClient
from kiln.frontend.config import KilnConfig
from kiln.frontend.core.serialize import make_request

warnings.simplefilter("ignore")
jobs = json.loads(sys.argv[1])

def graph(seed):
    def fn(a, b):
        return ((a * b + seed / 7.0).relu() * (a - b).sigmoid()).sum(-1)
    return fn

built = []
for job in jobs:
    fn = graph(job["graph"])
    example = [torch.randn(16, 64), torch.randn(16, 64)]
    request = make_request(trace_aten(fn, example), example, options={},
                           target=dict(DEFAULT_TARGETS["cpu"]))
    built.append((job, fn, request))
print("READY", flush=True)

def run(item):
    job, fn, request = item
    out = {"job": job["id"], "graph": job["graph"]}
    try:
        result = KilnClient(KilnConfig.resolve()).compile(request, f"g{job['graph']}")
        args = [torch.randn(16, 64), torch.randn(16, 64)]
        got = load(result.compiled)(list(args))[0]
        out.update(key=result.key.key, source=result.source,
                   published=bool(result.compiled.published_to),
                   ray_in_client="ray" in sys.modules,
                   correct=bool(torch.allclose(got, fn(*args), rtol=1e-5, atol=1e-5)))
    except Exception as e:
        out.update(error=f"{type(e).__name__}: {e}"[:300])
    return out

threads, results = [], [None] * len(built)
def worker(i):
    results[i] = run(built[i])
for i in range(len(built)):
    threads.append(threading.Thread(target=worker, args=(i,)))
    threads[-1].start()
for t in threads:
    t.join()
print(json.dumps(results), flush=True)
# A user's program lives on after its graphs compiled: it must survive the farm's end.
import time
time.sleep(float(sys.argv[2]))
print("ALIVE", flush=True)
"""


class Chaos:
    """The cluster, the store and the clients of one run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tmp = Path(tempfile.mkdtemp(prefix="kiln-chaos-"))
        self.graph_seed = 1000 * (os.getpid() % 1000)
        self.published: dict[str, int] = {}  # key -> graph seed, for the final read
        self.results: list[dict[str, Any]] = []
        self.struck: dict[str, int] | None = None  # the coordinator's counters at a fault
        self.store_fault_ended = -COOLDOWN_S  # when the store last came back

    # -- the store ------------------------------------------------------------------

    def start_store(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        # (a full disk makes moto log each failed PUT's traceback at ERROR)
        logging.getLogger("werkzeug").setLevel(logging.CRITICAL)
        if not hasattr(self, "disk"):
            import moto.s3.models as moto_models

            self.disk = SmallFilesystem(STORE_DISK)
            moto_models.tempfile = moto_tempfile(self.disk.path)  # type: ignore[attr-defined]
        if not hasattr(self, "port"):
            import socket

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                self.port = int(sock.getsockname()[1])
        self.s3 = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.s3.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def store_env(self) -> dict[str, str]:
        options = {"key": "testing", "secret": "testing",
                   "client_kwargs": {"endpoint_url": self.endpoint,
                                     "region_name": "us-east-1"}}
        return {"KILN_STORE": f"s3://{BUCKET}/chaos", "KILN_STORE_OPTIONS": json.dumps(options),
                "KILN_STORE_TIMEOUT": "3"}

    # -- the farm ---------------------------------------------------------------------

    def start_farm(self) -> None:
        """`kiln farm up` with the builder's environment (store and private key)."""
        from kiln.artifact_store import generate_ed25519_key
        from kiln.workers import ray_farm as farm
        from kiln.workers.serve import cluster as farm_cluster

        if not hasattr(self, "public"):
            self.private, self.public = generate_ed25519_key()
            import boto3

            boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                         aws_secret_access_key="testing", region_name="us-east-1"
                         ).create_bucket(Bucket=BUCKET)
        os.environ.update(self.store_env(), KILN_SIGNING_KEY=self.private,
                          KILN_FARM_FILE=str(self.tmp / "farm.json"), KILN_STATS_FILE="off",
                          XDG_CACHE_HOME=str(self.tmp / "builder-cache"),
                          PYTHONPATH=str(ROOT))
        self.farm_info = farm_cluster.start_local_cluster(num_cpus=self.args.cpus)
        farm.use_farm_token(self.farm_info)
        farm.use_loopback_ray(self.farm_info["address"])
        import ray

        ray.init(address=self.farm_info["address"], log_to_driver=False)
        self.actor = self.coordinator()
        ray.get(self.actor.wait_warm.remote(), timeout=600)

    def coordinator(self) -> Any:
        from kiln.workers.coordinator import get_farm_actor

        return get_farm_actor()

    def farm_stats(self) -> dict[str, int]:
        import ray

        if not ray.is_initialized():
            return {}
        try:
            stats = ray.get(self.coordinator().stats.remote(), timeout=60)
        except Exception:
            return {}
        return {k: v for k, v in stats.items() if isinstance(v, int)}

    # -- clients ----------------------------------------------------------------------

    def client_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("KILN_", "RAY_AUTH_TOKEN"))}
        env.update(self.store_env(), KILN_SIGNING_KEY=self.public, KILN_REQUIRE_SIGNED="1",
                   KILN_FARM=self.farm_info["address"] if self.args.via == "ray" else "local",
                   KILN_FARM_FILE=str(self.tmp / "farm.json"), KILN_FARM_TIMEOUT="300",
                   KILN_STATS_FILE="off", RAY_AUTH_MODE="token",
                   RAY_AUTH_TOKEN_PATH=self.farm_info["token_file"], PYTHONPATH=str(ROOT),
                   XDG_CACHE_HOME=str(self.tmp / "client-cache"))
        env.pop("TRITON_INTERPRET", None)
        return env

    def run_clients(self, graphs: list[int], delay: float = 0.0,
                    during: Any = None, linger: float = 0.0) -> list[dict[str, Any]]:
        """One job per graph seed, spread over client processes; ``during`` runs once
        every process has built its requests (the jobs are then starting)."""
        per = self.args.clients_per_process
        chunks = [graphs[i:i + per] for i in range(0, len(graphs), per)]
        env = self.client_env()
        if delay:
            env["KILN_TEST_COMPILE_DELAY"] = str(delay)
        procs: list[subprocess.Popen[str]] = []
        for chunk in chunks:
            jobs = [{"id": len(procs) * per + i, "graph": g} for i, g in enumerate(chunk)]
            procs.append(subprocess.Popen([sys.executable, "-c", CLIENT, json.dumps(jobs),
                                           str(linger)],
                                          env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        for proc in procs:
            assert proc.stdout is not None and proc.stderr is not None
            line = proc.stdout.readline()
            if line.strip() != "READY":
                raise RuntimeError(f"client did not start: {line}{proc.stderr.read()[-2000:]}")
        if during is not None:
            threading.Thread(target=during, daemon=True).start()
        out: list[dict[str, Any]] = []
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=1200)
            lines = [x for x in stdout.splitlines() if x.startswith("[")]
            if proc.returncode != 0 or not lines or "ALIVE" not in stdout:
                out.append({"error": f"client process exited {proc.returncode}: "
                                     f"{stderr[-1500:]}"})
                continue
            out.extend(json.loads(lines[-1]))
        return out

    # -- scenarios --------------------------------------------------------------------

    def new_graphs(self, n: int) -> list[int]:
        self.graph_seed += 1000
        return [self.graph_seed + i for i in range(n)]

    def scenario(self, name: str, graphs: list[int], delay: float = 0.0,
                 during: Any = None, linger: float = 0.0, after_jobs: Any = None
                 ) -> dict[str, Any]:
        # A store fault stops the farm's writes for the store's cool-down: no scenario
        # starts inside it, or its publishes would be skipped for the last one's fault.
        time.sleep(max(0.0, self.store_fault_ended + COOLDOWN_S + 1.0 - time.monotonic()))
        before = self.farm_stats()
        self.struck = None
        self.notes: dict[str, Any] = {}
        start = time.perf_counter()
        jobs = self.run_clients(graphs, delay, during, linger)
        if after_jobs is not None:
            after_jobs()
        wall = time.perf_counter() - start
        after = self.farm_stats()
        done = [j for j in jobs if "error" not in j]
        local = sum(1 for j in done if j["source"] == "local")
        farm_compiles = self.farm_compiles(before, after)
        keys = {j["key"] for j in done}
        for job in done:
            if job["published"]:
                self.published[job["key"]] = job["graph"]
        row = {"scenario": name, "jobs": len(graphs), "completed": len(done),
               "wrong": sum(1 for j in done if not j["correct"]),
               "keys": len(keys), "farm_compiles": farm_compiles, "local_compiles": local,
               "duplicate_compiles": max(0, farm_compiles + local - len(keys)),
               "sources": dict(Counter(j["source"] for j in done)),
               "clients_with_ray": sum(1 for j in done if j["ray_in_client"]),
               "published": sum(1 for j in done if j["published"]),
               "errors": [j["error"] for j in jobs if "error" in j][:3],
               "republished": self.counted(before, after, "republished"),
               "wall_s": round(wall, 1), **self.notes}
        print(json.dumps(row), flush=True)
        self.results.append(row)
        return row

    def farm_compiles(self, before: dict[str, int], after: dict[str, int]) -> int:
        """Graph compiles over the scenario, across a coordinator that restarted empty
        (or died with the head) at the fault."""
        if self.struck is None:
            return max(0, after.get("graph_compiles", 0) - before.get("graph_compiles", 0))
        done = self.struck.get("graph_compiles", 0) - before.get("graph_compiles", 0)
        restarted = after.get("requests", 0) < self.struck.get("requests", 0)
        return done + (after.get("graph_compiles", 0) if restarted else
                       after.get("graph_compiles", 0) - self.struck.get("graph_compiles", 0))

    @staticmethod
    def counted(before: dict[str, int], after: dict[str, int], name: str) -> int:
        """A coordinator counter's growth over a scenario; all of it where the counter
        went back (the coordinator restarted empty)."""
        grown = after.get(name, 0) - before.get(name, 0)
        return grown if grown >= 0 else after.get(name, 0)

    def wait_inflight(self) -> None:
        """Until the coordinator is compiling something (then a second more): the fault
        must hit compiles in flight, not clients still starting."""
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and self.farm_stats().get("inflight", 0) == 0:
            time.sleep(0.2)
        time.sleep(1.0)
        self.struck = self.farm_stats()

    def kill_workers(self) -> None:
        import ray

        self.wait_inflight()
        for pid in ray.get(self.coordinator().worker_pids.remote(), timeout=60):
            os.kill(pid, signal.SIGKILL)

    def store_outage(self) -> None:
        """The S3 server stops mid-compile, and stays down until the clients are done
        (`restart_store`): every publish of the scenario meets it down."""
        self.wait_inflight()
        self.struck = None  # the coordinator lives on
        self.s3.stop()

    def restart_store(self) -> None:
        self.start_store()
        self.store_fault_ended = time.monotonic()

    def fill_disk(self) -> None:
        """The S3 server's disk fills while the compiles run (they publish into it); every
        artifact published before is read back while it is full."""
        self.wait_inflight()
        self.struck = None  # the coordinator lives on
        self.disk.fill()
        self.notes["free_bytes_when_full"] = self.disk.available()
        self.notes["lost_while_full"] = self.artifacts_lost()["lost"]

    def free_disk(self) -> None:
        """Space returns once the clients are done; the farm's warning about it."""
        self.disk.free()
        self.store_fault_ended = time.monotonic()
        self.notes["farm_warning"] = self.farm_log_line(("rejected a write", "is full"))

    def disk_freed(self, graphs: list[int]) -> dict[str, Any]:
        """Past the store's cool-down after a fault (30 s), the graphs whose publish hit
        the full disk and as many new ones: all published."""
        return self.scenario("disk-freed", graphs + self.new_graphs(len(graphs)),
                             self.args.delay)

    def farm_log_line(self, needles: tuple[str, ...]) -> str:
        """The first line of the farm's Ray logs that holds one of `needles`."""
        for path in sorted(Path(self.farm_info["temp_dir"]).rglob("*")):
            if not path.is_file() or path.suffix not in (".err", ".out", ".log"):
                continue
            for line in path.read_text(errors="replace").splitlines():
                if any(needle in line for needle in needles):
                    return line.strip()[:400]
        return ""

    def kill_coordinator(self) -> None:
        import ray

        self.wait_inflight()
        ray.kill(self.coordinator(), no_restart=False)

    def kill_head(self) -> None:
        import ray

        self.wait_inflight()
        # A driver that loses the head is aborted by Ray 60 s later: leave first.
        ray.shutdown()
        os.killpg(int(self.farm_info["pid"]), signal.SIGKILL)

    def reader(self) -> Any:
        """A fresh fleet client of the store: public key, signatures required, no local
        tier, never writing (what it finds damaged stays for the next check). Its timeout
        is long: it asks whether the bytes are there, not how fast a loaded moto answers
        (one timeout would open its circuit breaker and count every later read lost)."""
        from kiln.artifact_store import open_store

        return open_store(storage_options=json.loads(self.store_env()["KILN_STORE_OPTIONS"]),
                          url=self.store_env()["KILN_STORE"], signing_key=self.public,
                          require_signed=True, local_cache=False, stats_file=False,
                          read_only=True, timeout=READ_BACK_TIMEOUT_S)

    def artifacts_lost(self) -> dict[str, int]:
        """Read back every artifact the farm published, as a fresh fleet client."""
        store = self.reader()
        lost = [key for key in self.published if store.get(key) is None]
        return {"published": len(self.published), "lost": len(lost)}

    def audit(self) -> dict[str, int]:
        """Every manifest in the bucket, read and verified: any that is visible but does
        not verify (a partial or corrupt artifact) is damaged."""
        store = self.reader()
        keys = store.keys()
        statuses = Counter(store.lookup(key).status for key in keys)
        return {"manifests": len(keys), "damaged": len(keys) - statuses["found"]}

    def run(self) -> dict[str, Any]:
        self.start_store()
        self.start_farm()
        n, delay = self.args.clients, self.args.delay
        full_graphs = self.new_graphs(5)
        plan = {
            "same-key": lambda: self.scenario("same-key", [self.new_graphs(1)[0]] * n, delay),
            "distinct-keys": lambda: self.scenario("distinct-keys", self.new_graphs(n)),
            "kill-worker": lambda: self.scenario("kill-worker", self.new_graphs(5), delay,
                                                 self.kill_workers),
            "store-outage": lambda: self.scenario("store-outage", self.new_graphs(5), delay,
                                                  self.store_outage,
                                                  after_jobs=self.restart_store),
            "disk-full": lambda: self.scenario("disk-full", full_graphs, delay,
                                               self.fill_disk, after_jobs=self.free_disk),
            "disk-freed": lambda: self.disk_freed(full_graphs),
            "kill-coordinator": lambda: self.scenario("kill-coordinator", self.new_graphs(5),
                                                      delay, self.kill_coordinator),
            # Clients stay up 75 s after their jobs: Ray aborts a driver 60 s after its
            # head is gone unless it left the cluster.
            "kill-head": lambda: self.scenario("kill-head", self.new_graphs(5), delay,
                                               self.kill_head, linger=75.0),
        }
        for name in self.args.scenarios.split(","):
            plan[name]()
        summary = {"scenarios": self.results, "artifacts": self.artifacts_lost(),
                   "bucket": self.audit(),
                   "cpus": self.args.cpus, "clients_per_process": self.args.clients_per_process}
        return summary

    def close(self) -> None:
        from kiln.workers.serve import cluster as farm_cluster

        try:
            import ray

            ray.shutdown()
        except Exception:
            pass
        farm_cluster.stop_local_cluster()
        self.s3.stop()
        self.disk.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--clients-per-process", type=int, default=5)
    parser.add_argument("--cpus", type=int, default=2, help="the farm's CPUs")
    parser.add_argument("--delay", type=float, default=6.0,
                        help="seconds each farm compile waits (the window faults hit)")
    parser.add_argument("--json", help="write the summary here too")
    parser.add_argument("--via", choices=("gateway", "ray"), default="gateway",
                        help="clients reach the farm through its gateway (KILN_FARM=local, "
                        "no Ray in the client) or join its Ray cluster (its address)")
    parser.add_argument("--scenarios", default=",".join(SCENARIOS),
                        help="comma-separated, in order (kill-head last: it ends the farm)")
    args = parser.parse_args()
    chaos = Chaos(args)
    try:
        summary = chaos.run()
    finally:
        chaos.close()
    rows = summary["scenarios"]
    print(f"\n{'scenario':<18}{'jobs':>5}{'done':>6}{'wrong':>6}{'keys':>6}"
          f"{'farm':>6}{'local':>6}{'dup':>5}{'pub':>5}{'wall s':>8}")
    for r in rows:
        print(f"{r['scenario']:<18}{r['jobs']:>5}{r['completed']:>6}{r['wrong']:>6}"
              f"{r['keys']:>6}{r['farm_compiles']:>6}{r['local_compiles']:>6}"
              f"{r['duplicate_compiles']:>5}{r['published']:>5}{r['wall_s']:>8}")
    print(f"artifacts published {summary['artifacts']['published']}, "
          f"lost {summary['artifacts']['lost']}; manifests in the bucket "
          f"{summary['bucket']['manifests']}, damaged {summary['bucket']['damaged']}   "
          "(farm: graph compiles started on the farm; local: compiled by clients)")
    for r in rows:
        extra = {k: r[k] for k in ("republished", "free_bytes_when_full", "lost_while_full",
                                   "farm_warning", "errors") if r.get(k) or
                 (k in r and k in ("free_bytes_when_full", "lost_while_full"))}
        if extra:
            print(f"{r['scenario']}: {json.dumps(extra)}")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
