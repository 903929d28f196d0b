"""Helpers shared by the farm tests: a `ray start --head` cluster, CUDA-target requests
built on this CPU machine, artifact digests, and Python subprocess clients."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
# The sources the session runs (conftest's snapshot of the packages, or the live tree).
SRC = Path(os.environ.get("FARM_TEST_SRC") or ROOT)
HELPERS = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

from kiln.artifact_store import Artifact  # noqa: E402
from kiln.compiler.decompositions import trace_aten  # noqa: E402
from kiln.compiler.request import CompileRequest, TensorMeta  # noqa: E402
from kiln.frontend.core.serialize import make_request  # noqa: E402

CUDA_TARGET = {"kind": "cuda", "backend": "cuda", "arch": 90, "warp_size": 32}
BUCKET = "kiln-farm-test"
RAY = str(Path(sys.executable).parent / "ray")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def node_ip() -> str:
    import ray._private.services as services

    return str(services.get_node_ip_address())


class RayHead:
    """A Ray cluster of its own: `ray start --head --block` in a new process group."""

    def __init__(self, log: Path, *, num_cpus: int = 2, num_gpus: int = 0,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.address = f"{node_ip()}:{self.port}"
        command = [RAY, "start", "--head", "--block", f"--port={self.port}",
                   f"--num-cpus={num_cpus}", f"--num-gpus={num_gpus}",
                   "--include-dashboard=false", "--disable-usage-stats",
                   f"--dashboard-agent-listen-port={free_port()}"]
        child_env = python_env(**(env or {}))
        self.log = log
        self.proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     env=child_env, cwd=SRC, start_new_session=True)
        self.wait_ready()

    def wait_ready(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ray start exited: {self.log.read_text()[-2000:]}")
            if "Ray runtime started" in self.log.read_text():
                return
            time.sleep(0.2)
        raise TimeoutError(f"Ray head did not start: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        """Kill the cluster's process group (its GCS, raylet and workers), at once."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)


# ---------------------------------------------------------------------------------------
# Requests.


def layer_model(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Three distinct kernels around two matmuls (extern calls)."""
    h = torch.tanh(x @ w) * 0.5
    h = (h @ w).softmax(-1)
    return h * x.sum()


def complex_model(x: torch.Tensor) -> torch.Tensor:
    """Runs eagerly; Kiln's code generators have no complex dtypes."""
    return torch.view_as_real(torch.view_as_complex(x) * (1 + 2j))


def failing_lowering_request() -> CompileRequest:
    """A graph whose one op fails in lowering: aten.div with an unknown rounding mode
    (eager ATen would refuse to trace it, so it is built by hand)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kiln.compiler.request import fake_tensor_from_meta

    meta = TensorMeta((8,), (1,), "float32", "cuda", 0)
    mode = FakeTensorMode()
    graph = torch.fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    x.meta["val"] = y.meta["val"] = fake_tensor_from_meta(meta, mode)
    out = graph.call_function(torch.ops.aten.div.Tensor_mode, (x, y),
                              {"rounding_mode": "sideways"})
    out.meta["val"] = fake_tensor_from_meta(meta, mode)
    graph.output((out,))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    return make_request(gm, [meta, meta], options={}, target=CUDA_TARGET)


def cuda_request(fn: Callable[..., Any] = layer_model,
                 shapes: Sequence[tuple[int, ...]] = ((16, 32), (32, 32)),
                 options: dict[str, Any] | None = None) -> CompileRequest:
    """A request for a CUDA target, traced here on CPU: inputs say device type cuda."""
    args = [torch.randn(*shape) for shape in shapes]
    gm = trace_aten(fn, args)
    metas = [dataclasses.replace(TensorMeta.from_tensor(a), device_type="cuda") for a in args]
    return make_request(gm, metas, options=options if options is not None else {},
                        target=CUDA_TARGET)


def blob_digests(artifact: Artifact) -> dict[str, str]:
    return {name: hashlib.sha256(data).hexdigest()
            for name, data in sorted(artifact.blobs.items())}


# ---------------------------------------------------------------------------------------
# Subprocess clients.


def python_env(**extra: str) -> dict[str, str]:
    """This environment for a child Python: the session's sources first on its path."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "RAY_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HELPERS)])
    env.update(extra)
    return env


def session_ray_token() -> dict[str, str]:
    """RAY_AUTH_TOKEN for a child that joins the session's cluster: the machine's Ray
    token (``~/.ray/auth_token``, which Ray writes and uses for the clusters it starts
    with token authentication on); empty when there is none."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return {"RAY_AUTH_TOKEN": os.environ["RAY_AUTH_TOKEN"]}
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    try:
        token = path.read_text().strip()
    except OSError:
        return {}
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token} if token else {}


def run_python(code: str, env: dict[str, str], timeout: float = 240.0) -> dict[str, Any]:
    """Run ``code`` in a fresh interpreter (from the session's sources); it prints one
    JSON object as its last line."""
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=SRC,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"client failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON from the client:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    result: dict[str, Any] = json.loads(lines[-1])
    result["_stderr"] = proc.stderr
    return result


def farm_stats(farm: Any) -> dict[str, int]:
    """The coordinator's counters (compiles, de-duplicated waits, kernel cache hits)."""
    return {k: v for k, v in farm.stats().items() if isinstance(v, int)}


def s3_env(endpoint: str, prefix: str) -> dict[str, str]:
    """KILN_STORE and its options for a prefix of the test bucket. A bucket is a store
    others can write, whose unsigned artifacts a client refuses (issue 33); tests of
    other matters than trust accept them (KILN_TRUST_UNSIGNED), and tests of trust set
    KILN_SIGNING_KEY, which requires signatures whatever this says."""
    options: dict[str, Any] = {"key": "testing", "secret": "testing",
                               "client_kwargs": {"endpoint_url": endpoint,
                                                 "region_name": "us-east-1"}}
    return {"KILN_STORE": f"s3://{BUCKET}/{prefix}", "KILN_STORE_OPTIONS": json.dumps(options),
            "KILN_TRUST_UNSIGNED": "1"}
