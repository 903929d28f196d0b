"""The farm's conversation in a child process: a client of a farm never imports Ray.

Joining a Ray cluster in the client's own process (importing Ray, ``ray.init``, finding
the coordinator) is about a second of Python holding the GIL. Done on a thread while
AOTAutograd traced, it slowed the trace by more than it cost alone (GPT-2 through a farm
on the H200 host: AOTAutograd's own time 2.69 s, against 0.98 s in process; on the CPU
machine 2.29 s against 1.26 s), and done on the miss's path it was on the critical path.
So a client whose farm is a Ray address (``kiln farm up``'s, ``KILN_FARM=local``, is
reached through its gateway instead: ``workers.serve.gateway``) starts a child
(``python -m kiln.frontend.transports.process``) as soon as torch.compile looks the backend up;
the child imports Ray, joins and finds the coordinator on its own core while Dynamo and
AOTAutograd trace here, and then relays this process's calls
(``compile``, ``tuned``, ``stats``) to the farm through its ``RayFarm``.

The call ids, reader thread and futures are ``relay.RelayFarm``'s. Wire: 8-byte
big-endian length, then a pickled tuple; (call id, method, args) down and
(call id, ok, value, trace events) up, over a socketpair the child inherits (no name
that another process could open). The child is Kiln's own process and relays what Ray
handed it from the farm, which an in-process ``RayFarm`` unpickles the same way: the
trust line is the farm's (a builder), as before, and the compiled graph is loaded as
before. The child exits when this process closes its end (``release``, exit, or death):
leaving Ray (its teardown takes seconds) is then the child's own affair, not the user's.

Opt-in: ``KILN_FARM_PROCESS=1``. By default the client joins in its own process
(``RayFarm``, on a thread started when the backend is called), as does a process already
connected to Ray by its user (``ray.init``). On the H200 host (2026-12-02 01:35 UTC, 16
cores) the child's join took 6.5 s from its start to the coordinator's first request, against
at most 3.0 s for the thread in the same rows before: GPT-2 through a farm took 12.9 s with
the child against 8.0 and 8.3 s with the thread. Why the child is slower there is not known
yet (its nice level, Ray's driver start in a fresh interpreter); until it is measured faster,
it is not the default.
"""

from __future__ import annotations

import logging
import os
import pickle
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from kiln.artifact_store import user_cache_dir
from kiln.compiler import trace
from kiln.frontend.transports.relay import Answer, RelayFarm
from kiln.workers.farm_api import FarmUnavailable
from kiln.workers.ray_farm import RayFarm
from kiln.workers.serve.wire import read_exactly

log = logging.getLogger("kiln.farm")
ENV = "KILN_FARM_PROCESS"
CHILD_NICE = 10
_HEADER = struct.Struct(">Q")


def wanted() -> bool:
    """Whether a farm with an address is reached through a child process (see the module
    docstring): ``KILN_FARM_PROCESS`` set true, and Ray not already connected here."""
    if os.environ.get(ENV, "0").strip().lower() not in ("1", "true", "yes", "on"):
        return False
    ray = sys.modules.get("ray")
    return ray is None or not getattr(ray, "is_initialized", lambda: False)()


def send(sock: socket.socket, lock: threading.Lock, message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        sock.sendall(_HEADER.pack(len(data)) + data)


def receive(sock: socket.socket) -> Any:
    """The next message; None when the other end closed."""
    header = read_exactly(sock, _HEADER.size)
    if header is None:
        return None
    body = read_exactly(sock, _HEADER.unpack(header)[0])
    return None if body is None else pickle.loads(body)


# ---------------------------------------------------------------------------------------
# This process's side.


class ProcessFarm(RelayFarm):
    """A farm at ``address`` reached through a child process; the same calls as
    ``RayFarm`` (``compile``, ``tuned``, ``stats``, ``release``)."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Path | None = None

    @property
    def description(self) -> str:
        return f"the Ray cluster at {self.address}"

    def _open(self) -> socket.socket:
        """Start the child (it joins the farm at once); our end of its socket."""
        ours, theirs = socket.socketpair()
        folder = user_cache_dir() / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        self._log = folder / f"farm-process-{os.getpid()}.log"
        from kiln.compiler.versions import versions
        from kiln.workers.names import namespace_for

        command = [sys.executable, "-m", "kiln.frontend.transports.process", str(theirs.fileno()),
                   self.address, namespace_for(versions())]
        command += ["--trace"] if trace.recording() else []
        try:
            with self._log.open("ab") as sink:
                self._proc = subprocess.Popen(command, pass_fds=(theirs.fileno(),),
                                              stdin=subprocess.DEVNULL, stdout=sink,
                                              stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as e:
            ours.close()
            raise FarmUnavailable(f"the farm's child process did not start: {e}") from e
        finally:
            theirs.close()
        return ours

    def _send(self, sock: socket.socket, call_id: int, method: str, args: tuple[Any, ...]
              ) -> None:
        send(sock, self._send_lock, (call_id, method, args))

    def _receive(self, sock: socket.socket) -> tuple[int, Answer] | None:
        message = receive(sock)
        if message is None:
            return None
        call_id, ok, value, events = message
        return call_id, (ok, value, events)

    def _gone(self) -> FarmUnavailable:
        return FarmUnavailable(f"the farm's child process ended (its log: {self._log})")


# ---------------------------------------------------------------------------------------
# The child's side.


def serve(sock: socket.socket, address: str, namespace: str) -> None:
    """Join the farm at ``address`` now, then run the parent's calls (each on a thread of
    its own, as they wait on the farm) until the parent closes its end."""
    farm = RayFarm(address, namespace=namespace)
    threading.Thread(target=_join, args=(farm,), daemon=True).start()
    lock = threading.Lock()
    while (message := receive(sock)) is not None:
        call_id, method, args = message
        threading.Thread(target=_run, args=(sock, lock, farm, call_id, method, args),
                         daemon=True).start()
    farm.release()


def _join(farm: RayFarm) -> None:
    try:  # not on the first output's path: it runs while the parent traces
        with trace.background(), trace.span("join the farm (child process)", cat="client"):
            farm.actor()
    except Exception as e:  # the first call joins again and reports it
        log.debug("kiln farm process: joining failed: %s", e)


def _run(sock: socket.socket, lock: threading.Lock, farm: RayFarm, call_id: int,
         method: str, args: tuple[Any, ...]) -> None:
    value: Any
    if method not in ("compile_raw", "tuned_raw", "stats"):
        ok, value = False, FarmUnavailable(f"the farm's child process has no call {method!r}")
    else:
        try:
            ok, value = True, getattr(farm, method)(*args)
        except Exception as e:
            ok, value = False, e
    events = _drain_events()
    try:
        send(sock, lock, (call_id, ok, value, events))
    except (pickle.PicklingError, TypeError, AttributeError):
        send(sock, lock, (call_id, False, FarmUnavailable(f"{type(value).__name__}: "
                                                          f"{value}"), events))
    except OSError:
        pass  # the parent is gone


def _drain_events() -> list[Any]:
    if not trace.recording():
        return []
    events = trace.events()
    trace.clear()
    return events


def main(argv: list[str]) -> int:
    fd, address, namespace = int(argv[0]), argv[1], argv[2]
    # Below the client in the CPU's queue: where cores are short, joining yields to the
    # trace it overlaps; the client waits on this process only when it has nothing to run.
    try:
        os.nice(CHILD_NICE)
    except OSError:
        pass
    if "--trace" in argv[3:]:
        trace.enable(True)
        trace.set_process_name("client's farm process")
    sock = socket.socket(fileno=fd)
    serve(sock, address, namespace)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
