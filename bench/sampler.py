"""What a bench row's process does while it is timed, without cProfile's distortion:
``BENCH_SAMPLE=path`` (``coldstart.py --sample DIR``) samples every thread's stack every
few milliseconds and records, through audit hooks, the programs it starts (a C compiler),
the folders it creates, the libraries it loads and the modules it imports. Written for
the question of ResNet-18's warm start on a new machine (2026-12-02, H200): "Dynamo
compile of a frame (own time)" took 1.43 s there against 0.98 s on the same machine, and
every span in it, Kiln's pure-Python hashing too, was about 1.5x slower.

    python3 bench/sampler.py A.json [B.json]    each row's threads, top frames, events;
                                                with two: the main thread's packages compared
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

INTERVAL_S = 0.002
EVENTS = ("subprocess.Popen", "os.posix_spawn", "os.system", "os.exec", "os.fork",
          "os.mkdir", "ctypes.dlopen", "import")
# Functions a thread blocks in (a pipe's `read`: pytest-xdist's and execnet's receivers).
IDLE = {"wait", "acquire", "sleep", "select", "poll", "_wait_for_tstate_lock", "get",
        "read", "readinto", "recv", "accept", "epoll", "join"}
_hooked = False
_active: Sampler | None = None


def _where(frame: Any) -> str:
    code = frame.f_code
    return f"{code.co_name} ({Path(code.co_filename).name}:{frame.f_lineno})"


def _package(filename: str) -> str:
    """Where a frame's code lives: ``torch/_dynamo``, ``triton/runtime``, ``kiln:frontend``."""
    parts = Path(filename).parts
    if "site-packages" in parts:
        rest = parts[parts.index("site-packages") + 1:]
        return "/".join(rest[:2]) if len(rest) > 2 else "/".join(rest)
    for root in ("frontend", "compiler", "workers", "artifact_store"):
        if root in parts:
            return f"kiln:{root}"
    return Path(filename).name


def _stack(frame: Any, depth: int = 6) -> str:
    parts: list[str] = []
    while frame is not None and len(parts) < depth:
        parts.append(_where(frame))
        frame = frame.f_back
    return " < ".join(parts)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    sampler = _active
    if sampler is None or event not in EVENTS:
        return
    if event == "import":
        sampler.imports.append(str(args[0]))
        return
    detail = " ".join(str(a)[:160] for a in args[:2])
    sampler.events.append({"t": round(time.perf_counter() - sampler.start, 4),
                           "event": event, "detail": detail,
                           "thread": threading.current_thread().name})


class Sampler:
    """Samples every other thread's stack on a daemon thread; audit events meanwhile."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.samples = 0
        self.by_thread: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self.busy: collections.Counter[str] = collections.Counter()
        self.packages: dict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter)
        self.events: list[dict[str, Any]] = []
        self.imports: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="bench-sampler")

    def begin(self) -> Sampler:
        global _hooked, _active
        if not _hooked:
            sys.addaudithook(_audit)
            _hooked = True
        _active = self
        self.start = time.perf_counter()
        self._thread.start()
        return self

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(INTERVAL_S):
            names = {t.ident: t.name for t in threading.enumerate()}
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                name = names.get(ident, f"thread {ident}")
                self.by_thread[name][_stack(frame)] += 1
                self.packages[name][_package(frame.f_code.co_filename)] += 1
                if frame.f_code.co_name not in IDLE:
                    self.busy[name] += 1

    def end(self) -> dict[str, Any]:
        global _active
        self._stop.set()
        self._thread.join()
        _active = None
        wall = time.perf_counter() - self.start
        threads = {name: {"busy_samples": self.busy[name],
                          "packages": self.packages[name].most_common(12),
                          "top": stacks.most_common(12)}
                   for name, stacks in self.by_thread.items()}
        return {"wall_s": wall, "samples": self.samples, "interval_s": INTERVAL_S,
                "threads": threads, "events": self.events[:400],
                "imports": len(self.imports), "first_imports": self.imports[:80]}


def begin_from_env() -> Sampler | None:
    return Sampler().begin() if os.environ.get("BENCH_SAMPLE") else None


def write(sampler: Sampler | None) -> None:
    if sampler is not None:
        Path(os.environ["BENCH_SAMPLE"]).write_text(json.dumps(sampler.end(), indent=1))


def report(path: str) -> None:
    data = json.loads(Path(path).read_text())
    print(f"## {path}: {data['wall_s']:.3f} s timed, {data['samples']} samples, "
          f"{data['imports']} imports")
    busiest = sorted(data["threads"].items(), key=lambda kv: -kv[1]["busy_samples"])
    for name, info in busiest[:4]:
        print(f"  thread {name}: busy in {info['busy_samples']} samples; by package: " +
              ", ".join(f"{p} {n}" for p, n in info["packages"][:8]))
        for stack, count in info["top"][:4]:
            print(f"    {count:5d}  {stack[:200]}")
    for event in data["events"][:25]:
        print(f"  {event['t']:8.3f}s {event['event']:18s} [{event['thread']}] "
              f"{event['detail'][:150]}")
    print("  first imports: " + ", ".join(data["first_imports"][:15]))


def compare(first: str, second: str) -> None:
    """Seconds per package on each row's main thread, most grown first."""
    rows = []
    for path in (first, second):
        data = json.loads(Path(path).read_text())
        per_sample = data["wall_s"] / max(1, data["samples"])
        main = data["threads"].get("MainThread", {"packages": []})
        rows.append({p: n * per_sample for p, n in main["packages"]})
    print(f"## main thread, seconds by package: {first} -> {second}")
    names = sorted(set(rows[0]) | set(rows[1]),
                   key=lambda p: rows[0].get(p, 0.0) - rows[1].get(p, 0.0))
    for name in names[:12]:
        print(f"  {name:50s} {rows[0].get(name, 0.0):7.3f} -> {rows[1].get(name, 0.0):7.3f}")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        report(arg)
    if len(sys.argv) == 3:
        compare(sys.argv[1], sys.argv[2])
