"""`kiln farm up` / `kiln farm down`: a Ray cluster on this machine for every local
client (``KILN_FARM=local`` finds it through the farm file); `kiln farm status`."""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kiln.workers.farm_api import host_port, probe, process_ended
from kiln.workers.gpu_share import SHARED_GPU_ENV
from kiln.workers.ray_farm import LOOPBACK, RAY_LOOPBACK_ENV, is_loopback
from kiln.workers.serve.farm_files import (
    farm_file,
    farm_token,
    farm_token_file,
    read_farm_file,
    write_farm_file,
)
from kiln.workers.serve.gateway import ready_address

log = logging.getLogger("kiln.farm")
GATEWAY_START_S = 30.0


def _ray_executable() -> str:
    beside = Path(sys.executable).parent / "ray"
    found = str(beside) if beside.exists() else shutil.which("ray")
    if not found:
        raise FileNotFoundError("the `ray` command is not installed (pip install ray)")
    return found


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def check_port(port: int) -> None:
    """OSError naming the port unless it is valid and free on this machine."""
    if not 0 < port < 65536:
        raise OSError(f"port {port} is out of range (1 to 65535)")
    with socket.socket() as sock:
        try:
            sock.bind(("", port))
        except OSError as e:
            raise OSError(f"port {port} is in use on this machine ({e.strerror}); pick "
                          "another with --port, or leave --port out for a free one") from None


def start_local_cluster(*, num_cpus: int | None = None, num_gpus: int | None = None,
                        port: int | None = None, host: str | None = None,
                        timeout: float = 120.0, join_now: bool = True) -> dict[str, Any]:
    """`ray start --head` in the background, with Ray's token authentication on (the
    token in a private file, ``farm_token_file()``); its address and token file go to
    the farm file, which ``local`` clients read. ``host``: the address other machines
    join it by (Ray's node IP), and Ray then listens on every interface: the token, and
    a firewall for the ports, keep strangers out. Without it every Ray port of the farm
    listens on 127.0.0.1 only (RAY_LOOPBACK_ENV). A cluster already up is returned as
    it is."""
    info = read_farm_file()
    if info is not None and probe(str(info["address"])) is None:
        problem = temp_dir_problem(str(info.get("temp_dir") or ""))
        if problem is not None:
            log.warning("kiln farm: the running farm's Ray folder is not private: %s; "
                        "other users may reach its sockets. Run `kiln farm down` and "
                        "`kiln farm up` again", problem)
        if not info.get("gateway") or probe(str(info["gateway"])) is not None:
            info.update(start_gateway(str(info["address"]), int(info.get("pid", 0)),
                                      str(info.get("host") or LOOPBACK), join_now=join_now))
            write_farm_file(info)  # a gateway that had died, started again
        asked = {"num_cpus": num_cpus, "num_gpus": num_gpus, "port": port, "host": host}
        return {**info, "already_running": True, "differs": differences(info, asked)}
    log_path = farm_file().with_name("farm-head.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    if port is not None:
        check_port(port)
    port = port or _free_port()
    temp_dir, ray_temp = private_ray_temp()
    command = [_ray_executable(), "start", "--head", "--block", f"--port={port}",
               f"--temp-dir={ray_temp}",
               f"--num-cpus={num_cpus or os.cpu_count()}", "--include-dashboard=false",
               "--disable-usage-stats", f"--dashboard-agent-listen-port={_free_port()}",
               f"--node-ip-address={host or LOOPBACK}"]
    if num_gpus is not None:
        command.append(f"--num-gpus={num_gpus}")
    farm_token(create=True)
    env = {k: v for k, v in os.environ.items()
           if k not in ("TRITON_INTERPRET", "RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(farm_token_file()))
    if not host:
        env[RAY_LOOPBACK_ENV] = "0"
    if not host and (num_gpus if num_gpus is not None else _gpu_count()) == 1:
        # A farm for this host's programs on its only GPU: the Autotuner takes turns
        # with them (``workers.gpu_share.DutyCycle``) instead of stalling their calls.
        env.setdefault(SHARED_GPU_ENV, "1")
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    # The gateway starts while the head does (its imports overlap the head's start-up) and
    # joins once the head answers, at the address the head is started with.
    expected = f"{host or LOOPBACK}:{port}"
    gateway = launch_gateway(expected, proc.pid, host or LOOPBACK, join_now=join_now)
    try:
        address = _wait_for_head(proc, log_path, timeout, f"{LOOPBACK}:{port}")
    except (RuntimeError, TimeoutError):
        _kill_started(gateway)
        shutil.rmtree(temp_dir, ignore_errors=True)
        raise
    if address != expected:  # Ray named another address to join by: the gateway follows
        _kill_started(gateway)
        gateway = launch_gateway(address, proc.pid, host or LOOPBACK, join_now=join_now)
    info = {"address": address, "pid": proc.pid, "port": port, "log": str(log_path),
            "temp_dir": temp_dir, "num_cpus": num_cpus or os.cpu_count(),
            "num_gpus": num_gpus, "started": time.time(), "auth": "token",
            "token_file": str(farm_token_file()), "host": host or ""}
    write_farm_file(info)
    info.update(await_gateway(gateway))
    write_farm_file(info)
    return info


def _gpu_count() -> int:
    """NVIDIA GPUs this host shows (its device files; no CUDA context is made)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([v for v in visible.split(",") if v.strip() and v.strip() != "-1"])
    return len([p for p in Path("/dev").glob("nvidia[0-9]*")])


def differences(info: dict[str, Any], asked: dict[str, Any]) -> list[str]:
    """The settings a `farm up` asked for that the farm already up does not have (each
    as ``--flag running (asked: value)``); a setting not given is no difference."""
    found = []
    for name, value in asked.items():
        if value is None:
            continue
        running = info.get(name)
        if name == "host":
            running = running or ""
        if running is None and name == "num_gpus":
            running = "Ray's count"
        if str(running) != str(value):
            found.append(f"--{name.replace('_', '-')} {running} (asked: {value})")
    return found


def private_ray_temp() -> tuple[str, str]:
    """(a new folder of this user's alone, Ray's temp folder inside it). Ray makes its
    temp and session folders 0777 so that users may share them; the 0700 folder around
    them keeps other users from its sockets (a raylet socket replaced by another user's
    is a farm that user runs). Short, since Ray's socket paths must fit 107 bytes;
    removed by `kiln farm down`. RuntimeError if the folder is not private after all."""
    parent = tempfile.mkdtemp(prefix="kiln-ray-")  # mode 0700
    problem = temp_dir_problem(parent)
    if problem is not None:
        shutil.rmtree(parent, ignore_errors=True)
        raise RuntimeError(f"kiln farm up: Ray's folder would not be private: {problem}")
    return parent, os.path.join(parent, "r")


def temp_dir_problem(temp_dir: str) -> str | None:
    """Why other users could reach into the farm's folder ``temp_dir``: it is not this
    user's 0700 folder, or a folder above it is writable by others (not sticky) or
    another user's. None when they cannot; "" names no folder and is not checked."""
    if not temp_dir:
        return None
    from kiln.artifact_store.trust import writable_by_others

    try:
        info = os.lstat(temp_dir)
    except OSError as e:
        return f"{temp_dir} cannot be checked ({e.strerror})"
    if not stat.S_ISDIR(info.st_mode):
        return f"{temp_dir} is not a folder"
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        return f"{temp_dir} is owned by uid {info.st_uid}, not this user"
    if info.st_mode & 0o077:
        return f"{temp_dir} has mode {stat.filemode(info.st_mode)}, not drwx------"
    return writable_by_others(os.path.dirname(temp_dir))


def start_gateway(address: str, head_pid: int, host: str, *, join_now: bool = True,
                  timeout: float = GATEWAY_START_S) -> dict[str, Any]:
    """Start the farm's gateway (``workers.serve.gateway``: clients reach the farm through it
    without Ray) next to the head; its address, pid and log for the farm file. A gateway
    that does not come up costs clients only the gateway (they join Ray instead)."""
    return await_gateway(launch_gateway(address, head_pid, host, join_now=join_now),
                         timeout)


def launch_gateway(address: str, head_pid: int, host: str, *, join_now: bool = True
                   ) -> subprocess.Popen[bytes]:
    """The gateway's process, started; ``await_gateway`` waits for it to listen."""
    log_path = farm_file().with_name("farm-gateway.log")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "kiln.workers.serve.gateway", "--ray", address,
               "--host", host, "--head-pid", str(head_pid)] + (["--join-now"] * join_now)
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    with log_path.open("w") as log_file:
        return subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def await_gateway(proc: subprocess.Popen[bytes], timeout: float = GATEWAY_START_S
                  ) -> dict[str, Any]:
    """The gateway's address, pid and log once it listens; {} (and a warning) if it
    does not within ``timeout``."""
    log_path = farm_file().with_name("farm-gateway.log")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        found = ready_address(log_path)
        if found is not None:
            return {"gateway": found, "gateway_pid": proc.pid, "gateway_log": str(log_path)}
        time.sleep(0.05)
    _kill_started(proc)
    print(f"kiln farm: the gateway did not start (see {log_path}); clients join Ray",
          file=sys.stderr)
    return {}


def _kill_started(proc: subprocess.Popen[bytes]) -> None:
    """Kill a process group this module started (and reap its leader)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def _wait_for_head(proc: subprocess.Popen[bytes], log_path: Path, timeout: float,
                   loopback: str) -> str:
    """The head's address once Ray says it started: the one it tells other nodes to
    join by, or ``loopback`` where it names none (a node on 127.0.0.1)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace")
        if "Ray runtime started" in text:
            found = re.search(r"ray start --address='([^']+)'", text)
            return found.group(1) if found else loopback
        if proc.poll() is not None:
            raise RuntimeError(f"ray start failed: {_last_error_line(text)} (see {log_path})")
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    raise TimeoutError(f"ray start did not come up in {timeout:g}s (see {log_path})")


def _last_error_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["it exited before it was up"])[-1][:300]


def head_process_problem(info: dict[str, Any]) -> str | None:
    """Why the process named by the farm file cannot be proved to be that farm's Ray
    head (`ray start --head` on the recorded port, by its command line); None if it is."""
    try:
        pid = int(info.get("pid", 0))
    except (TypeError, ValueError):
        pid = 0
    if pid <= 0:
        return "it names no process"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return f"process {pid} is not running"
    target = host_port(str(info.get("address", "")))
    port = info.get("port") or (target[1] if target else None)
    is_ray = any(Path(arg).name == "ray" for arg in argv[:3])
    if not (is_ray and "start" in argv and "--head" in argv):
        return f"process {pid} is not a Ray head ({' '.join(argv)[:80]})"
    if port is None or f"--port={port}" not in argv:
        return f"process {pid} is a Ray head on another port than the farm's {port}"
    return None


# A head given SIGTERM drains for up to 30 s before it exits; a farm going down need not
# wait for that: a second for a head that ends at once, then SIGKILL.
STOP_GRACE_S = 1.0


def stop_local_cluster(grace_s: float = STOP_GRACE_S) -> dict[str, Any] | None:
    """Stop the cluster of `kiln farm up` and forget its address. Only a process proved
    to be that farm's head is stopped (with its process group); a stale farm file is
    removed, and the returned info's ``stale`` says why. None when there is no file."""
    path = farm_file()
    if not path.exists():
        return None
    info = read_farm_file() or {"address": "?", "stale": "the farm file is unreadable"}
    problem = info.get("stale") or head_process_problem(info)
    if problem is None:
        _stop_gateway(info)
        _kill_group(int(info["pid"]), grace_s)
        if str(info.get("temp_dir", "")).startswith(os.path.join(tempfile.gettempdir(),
                                                                 "kiln-ray-")):
            shutil.rmtree(str(info["temp_dir"]), ignore_errors=True)
    else:
        info["stale"] = problem
    path.unlink(missing_ok=True)
    return info


def _stop_gateway(info: dict[str, Any]) -> None:
    """Stop the farm's gateway: only a process proved to be one (by its command line)."""
    try:
        pid = int(info.get("gateway_pid", 0))
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if pid > 0 else []
    except (TypeError, ValueError, OSError):
        return
    if b"kiln.workers.serve.gateway" in argv:
        _kill_group(pid, 1.0)


def _kill_group(pid: int, grace_s: float) -> None:
    try:
        os.killpg(pid, signal.SIGTERM)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and not process_ended(pid):
        time.sleep(0.05)
    try:  # the rest of the group, and a head still draining (see STOP_GRACE_S)
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def auth_instructions(info: dict[str, Any]) -> str:
    """What `kiln farm up` prints: how clients send the farm's Ray token, and which
    interfaces the farm's Ray ports listen on."""
    token_file = info.get("token_file") or farm_token_file()
    lines = [f"Ray token authentication is on; the token is in {token_file} (mode 0600).",
             f"  clients on this machine (KILN_FARM=local) read it from {farm_file()}"]
    if is_loopback(str(info.get("address", ""))):
        lines += ["  Every Ray port listens on 127.0.0.1 only: other machines cannot reach "
                  "the farm (start it",
                  "  with --host ADDRESS to serve them); other users of this machine can, "
                  "and the token refuses them."]
    else:
        lines += [f"  clients elsewhere: export RAY_AUTH_MODE=token "
                  f"RAY_AUTH_TOKEN=\"$(cat {token_file})\" KILN_FARM={info.get('address')}",
                  "  Ray listens on every interface (--host): the GCS port, the raylet's and "
                  "each worker's gRPC",
                  "  ports are open to the network, guarded by the token: keep them behind "
                  "a firewall too."]
    lines += ["  Ray access runs code on the farm, which holds the signing key: give the "
              "token to trusted",
              "  builders and clients only (infra/README.md)."]
    return "\n".join(lines)
