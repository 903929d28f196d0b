"""A few child processes that run the compiler's graph stage (stages 1 to 6) for a client
compiling in process: the graph stage is pure Python and holds the GIL, so threads would
take turns; processes run side by side. Kernels still compile in the client (its kernel
cache and store are there), from the sources a child returns.

Children are ``python -m kiln.workers.stage_pool``: they never import the user's main
module (as multiprocessing's spawn would, re-running a script without a main guard).
A child reads pickled jobs on stdin and writes pickled answers on stdout (its own output
goes to stderr); it exits when stdin closes, so it never outlives the client. The pipe
joins two processes of one user, started here, like multiprocessing's own pipes.

    pool = StagePool(processes)                  children start in the background
    pool.compile_sources(request_bytes, key)      -> CompiledGraph (waits for a free child)
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
from typing import IO, Any

from kiln.compiler import trace
from kiln.compiler.compiled_graph import CompiledGraph

log = logging.getLogger("kiln.stage_pool")

_HEADER = struct.Struct("<Q")
READY = "ready"


class StagePoolError(RuntimeError):
    """A child died or could not start: the graph stage runs in the client instead."""


def _write(stream: IO[bytes], obj: Any) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read(stream: IO[bytes]) -> Any:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError("the pipe closed")
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the pipe closed mid-message")
    return pickle.loads(data)


class _Child:
    def __init__(self) -> None:
        env = {k: v for k, v in os.environ.items() if k != "KILN_TRACE"}
        self.proc = subprocess.Popen([sys.executable, "-m", "kiln.workers.stage_pool"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout

    def ask(self, job: dict[str, Any]) -> Any:
        _write(self.stdin, job)
        return _read(self.stdout)

    def close(self) -> None:
        try:
            self.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class StagePool:
    """``processes`` children running graph stages; see the module docstring."""

    def __init__(self, processes: int) -> None:
        self.processes = processes
        self._idle: queue.Queue[_Child | None] = queue.Queue()
        self._children: list[_Child] = []
        self._lock = threading.Lock()
        self.broken: str | None = None
        self.jobs = 0  # graph stages the children ran
        for _ in range(processes):
            threading.Thread(target=self._start_one, daemon=True,
                             name="kiln-stage-pool-start").start()

    def _start_one(self) -> None:
        try:
            child = _Child()
            with self._lock:
                self._children.append(child)
            if _read(child.stdout) != READY:
                raise StagePoolError("a graph-stage process said something unexpected")
            self._idle.put(child)
        except Exception as e:  # the client compiles in its own process instead
            self.broken = f"a graph-stage process did not start: {type(e).__name__}: {e}"
            log.warning("kiln: %s", self.broken)
            self._idle.put(None)

    def compile_sources(self, request_bytes: bytes, key: str, *, delay: float = 0.0,
                        extra_options: dict[str, Any] | None = None) -> CompiledGraph:
        """Stages 1 to 6 of one request in a child; compile errors come back as raised
        here (``CompileFailure``); ``StagePoolError`` if the child itself failed."""
        child = self._idle.get()
        if child is None:
            self._idle.put(None)  # wake the next waiter too
            raise StagePoolError(self.broken or "the graph-stage processes are gone")
        job = {"request": request_bytes, "key": key, "delay": delay,
               "extra_options": extra_options, "traced": trace.recording()}
        try:
            answer = child.ask(job)
        except (EOFError, OSError, pickle.UnpicklingError) as e:
            child.close()
            self.broken = f"a graph-stage process died ({type(e).__name__}: {e})"
            self._idle.put(None)
            raise StagePoolError(self.broken) from e
        self._idle.put(child)
        with self._lock:
            self.jobs += 1
        if "error" in answer:
            raise answer["error"]
        trace.merge(answer.get("trace"))
        return CompiledGraph.from_dict(answer["compiled"])

    def close(self) -> None:
        with self._lock:
            children, self._children = self._children, []
        for child in children:
            child.close()


def _serve(stdin: IO[bytes], stdout: IO[bytes]) -> None:
    from .pipeline import CompileFailure, compile_sources

    trace.set_process_name("graph-stage process")
    _write(stdout, READY)
    while True:
        try:
            job = _read(stdin)
        except EOFError:
            return
        try:
            with trace.capture(bool(job.get("traced"))) as events:
                compiled = compile_sources(job["request"], job["key"], delay=job["delay"],
                                           extra_options=job["extra_options"])
            answer: dict[str, Any] = {"compiled": compiled.to_dict(), "trace": events}
        except Exception as e:  # sent back as data: compiler errors do not unpickle
            answer = {"error": CompileFailure.wrap(e, job["key"])}
        _write(stdout, answer)


def main() -> None:
    """A child: the pipe is the original stdout; anything printed goes to stderr."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    import kiln.compiler.driver  # noqa: F401  (imports before saying ready)

    _serve(sys.stdin.buffer, out)


if __name__ == "__main__":
    main()
