"""Background kernel compiles in child processes, off the program's interpreter.

A client that tunes in the background compiles each kernel's candidate configs while the
user's loop calls the graph. Compiled on threads of the user's process, Triton's front
end (the kernel's AST walked and its IR built, in Python) holds the GIL for most of each
compile, and the loop's thread waits for the GIL at each of its kernel launches: on the
H100 host (2026-12-07, ``bench/full_speed.py --models vit``) ViT-B/16's calls took up to
232 ms against 3.4 ms steady while 41 candidate compiles ran, though the tuning's GPU
turns held the GPU for 0.1 ms in all. Here each background compile goes to one of a few
child processes (``python -m kiln.workers.compile_procs``), which run ``compile_kernel``
and send the binary back; the user's interpreter only waits on a pipe.

The children compile for the explicit target the job names, as a farm's kernel workers
do, with this process's ``KILN_*`` and ``TRITON_*`` variables as they are when the job is
sent (caches, options), and see no GPU (``CUDA_VISIBLE_DEVICES`` empty): they make no
CUDA context and take no GPU memory. Messages are msgpack maps, each prefixed with its
length, on the children's standard input and output; a child's own prints go to its
standard error.

``KILN_TUNE_COMPILE_PROCESSES``: how many children (default ``min(4, CPUs // 2)``, at
least 1); ``0`` compiles on threads of this process as before. A child that cannot start
or dies sends its job (and every later one) back to this process's threads, with one
warning naming what failed.
"""

from __future__ import annotations

import logging
import os
import queue
import struct
import subprocess
import sys
import threading
from typing import IO, Any

import msgpack

from kiln.compiler.codegen.kernel_spec import KernelSpec
from kiln.compiler.errors import KilnCompileError
from kiln.compiler.kernel_compile import KernelBinary, compile_kernel

log = logging.getLogger("kiln.workers")

PROCESSES_ENV = "KILN_TUNE_COMPILE_PROCESSES"
_HEADER = struct.Struct("!I")


class CompileProcessError(RuntimeError):
    """A child process failed (did not start, died, or sent something unreadable)."""


def processes() -> int:
    """Children to start (``KILN_TUNE_COMPILE_PROCESSES``; 0: none)."""
    raw = os.environ.get(PROCESSES_ENV, "").strip()
    if raw:
        try:
            return max(0, int(raw))
        except ValueError:
            return 0
    return max(1, min(4, (os.cpu_count() or 2) // 2))


def _send(stream: IO[bytes], message: dict[str, Any]) -> None:
    data = msgpack.packb(message, use_bin_type=True)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> dict[str, Any] | None:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        return None
    message = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if not isinstance(message, dict):
        raise CompileProcessError(f"a compile process sent a {type(message).__name__}")
    return message


# The variables a compile reads (Kiln's and Triton's caches and options): each job carries
# this process's values, so a child compiles as a thread here would at that moment.
_PREFIXES = ("KILN_", "TRITON_")


def _settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k.startswith(_PREFIXES) and k != "TRITON_INTERPRET"}


def _apply(settings: dict[str, str]) -> None:
    """In a child: the sender's ``_settings`` in place of its own."""
    for name in [k for k in os.environ if k.startswith(_PREFIXES) and k not in settings]:
        del os.environ[name]
    os.environ.update({k: v for k, v in settings.items() if k.startswith(_PREFIXES)})


class _Child:
    def __init__(self) -> None:
        env = dict(os.environ)
        env["CUDA_VISIBLE_DEVICES"] = ""  # compiles for the job's target; no context
        env.pop("TRITON_INTERPRET", None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kiln.workers.compile_procs"], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=None)

    def compile(self, job: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        try:
            _send(self.proc.stdin, job)
            reply = _receive(self.proc.stdout)
        except (OSError, ValueError, msgpack.UnpackException) as e:
            raise CompileProcessError(f"compile process {self.proc.pid}: {e}") from e
        if reply is None:
            raise CompileProcessError(
                f"compile process {self.proc.pid} exited ({self.proc.poll()})")
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.close()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()


class CompileProcesses:
    """A few child processes; ``compile`` blocks the calling thread (never holding the
    GIL) until a child sent the job's binary."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._idle: queue.SimpleQueue[_Child] = queue.SimpleQueue()
        self._children: list[_Child] = []
        self._lock = threading.Lock()
        self.broken: str | None = None
        self.compiles = 0

    def _take(self) -> _Child:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if len(self._children) < self.count:
                child = _Child()
                self._children.append(child)
                return child
        while True:  # every child busy: wait for one (or for the pool to break)
            try:
                return self._idle.get(timeout=0.5)
            except queue.Empty:
                if self.broken is not None:
                    raise CompileProcessError(self.broken) from None

    def compile(self, spec: KernelSpec, config: dict[str, Any], target: dict[str, Any]
                ) -> KernelBinary:
        """``compile_kernel(spec, config, target)`` in a child: its ``KernelBinary``;
        a compile error is raised as ``KilnCompileError`` naming the kernel, as here."""
        if self.broken is not None:
            raise CompileProcessError(self.broken)
        try:
            child = self._take()
        except OSError as e:
            self.broken = f"no compile process could start: {e}"
            raise CompileProcessError(self.broken) from e
        if self.broken is not None:  # broke while this thread waited
            self._idle.put(child)
            raise CompileProcessError(self.broken)
        try:
            reply = child.compile({"spec": spec.to_dict(), "config": dict(config),
                                   "target": dict(target), "env": _settings()})
        except CompileProcessError as e:
            child.close()
            with self._lock:
                self._children.remove(child)
                self.broken = str(e)
            raise
        self._idle.put(child)
        if "error" in reply:
            raise KilnCompileError(str(reply["error"]), kernel=spec.name, stage="kernel compile")
        binary = KernelBinary.from_dict(reply["binary"])
        if binary.name != spec.name:
            raise CompileProcessError(f"asked for kernel {spec.name}, got {binary.name}")
        with self._lock:
            self.compiles += 1
        return binary

    def close(self) -> None:
        with self._lock:
            children, self._children = self._children, []
        for child in children:
            child.close()


_pool: CompileProcesses | None = None
_pool_lock = threading.Lock()


def pool() -> CompileProcesses | None:
    """This process's children (started on first use), or None where they are off or
    broken."""
    global _pool
    with _pool_lock:
        if _pool is None:
            count = processes()
            if count == 0:
                return None
            _pool = CompileProcesses(count)
            import atexit

            atexit.register(_pool.close)
        return None if _pool.broken is not None else _pool


def shutdown() -> None:
    """Stop this process's children; the next background compile reads
    ``KILN_TUNE_COMPILE_PROCESSES`` again."""
    global _pool
    with _pool_lock:
        if _pool is not None:
            _pool.close()
        _pool = None


_warned = False


def compile_in_child(spec: KernelSpec, config: dict[str, Any], target: dict[str, Any]
                     ) -> KernelBinary | None:
    """The job's binary from a child, or None where there is no child to ask (off, or
    broken: one warning, then this process compiles)."""
    global _warned
    children = pool()
    if children is None:
        return None
    try:
        return children.compile(spec, config, target)
    except CompileProcessError as e:
        if not _warned:
            _warned = True
            log.warning("kiln: background kernel compiles go back to this process's "
                        "threads: %s", e)
        return None


def main() -> int:
    """A child: compile each job read from standard input; reply on standard output."""
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # prints of the compiler never reach the pipe
    while True:
        job = _receive(stdin)
        if job is None:
            return 0
        try:
            _apply(dict(job.get("env") or {}))
            spec = KernelSpec.from_dict(job["spec"])
            binary = compile_kernel(spec, dict(job["config"]), dict(job["target"]))
            reply: dict[str, Any] = {"binary": binary.to_dict()}
        except KilnCompileError as e:  # raised there again, naming where as here
            reply = {"error": e.reason}
        except Exception as e:  # noqa: BLE001 - sent back, raised there with the kernel
            reply = {"error": f"{type(e).__name__}: {e}"}
        _send(stdout, reply)


if __name__ == "__main__":
    sys.exit(main())
