"""Compile C++ kernels into shared objects with the system compiler, and launch them.

The compiler is ``$KILN_CXX``, else ``$CXX``, else ``g++``. A shared object is cached
under ``<private cache>/cpp`` by a hash of the source, the prelude, the flags, the ISA level
and the compiler's version, so a kernel compiles once per machine. The instruction-set
level comes from the target (``{"kind": "cpu", "isa": "x86-64-v3"}``) and is always a
named x86-64 level, never ``-march=native``: the same target gives the same binary on
any machine that builds it. Targets that name no level get the level of the machine that
asks (``$KILN_CPU_ISA`` pins one, e.g. for a fleet of mixed machines to share kernels).
Launching loads the bytes with ``ctypes`` and calls the one ``extern "C"`` function with
each tensor's data pointer.
"""

from __future__ import annotations

import ctypes
import difflib
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from ...errors import KilnCompileError
from ...runtime.local_cache import (
    open_verified,
    private_dir,
    seal,
    sealed_bytes,
    verified_file,
)
from ..kernel_spec import KernelSpec
from .prelude import PRELUDE_NAME, prelude_source

log = logging.getLogger("kiln.cpp")

FALLBACK_ISA = "x86-64-v3"
# Flags that keep IEEE semantics (no -ffast-math: NaN and signed zeros matter). Loops
# vectorize through ``#pragma omp simd``; -fno-math-errno lets sqrt and friends inline,
# -fno-trapping-math lets masked code be if-converted, -fwrapv makes integer overflow wrap
# as eager's does, and -ffp-contract=off rounds every operation as eager does.
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno",
              "-fno-trapping-math", "-fwrapv", "-ffp-contract=off", "-fno-plt")
COMPILE_TIMEOUT_S = 300
# Flags that x86-64 levels need on the host, by /proc/cpuinfo name.
_LEVEL_FLAGS = {
    "x86-64": set(),
    "x86-64-v2": {"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"},
    "x86-64-v3": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"},
    "x86-64-v4": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
_LEVELS = list(_LEVEL_FLAGS)


@functools.lru_cache(maxsize=1)
def host_isa_level() -> str | None:
    """The highest x86-64 level this machine runs, or None when it cannot tell."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags: set[str] = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    level = "x86-64"
    for name in _LEVELS[1:]:
        if not _LEVEL_FLAGS[name] <= flags:
            break
        level = name
    return level


def default_isa() -> str:
    """The ISA level CPU targets get unless they name one: ``$KILN_CPU_ISA``, else the
    highest x86-64 level this machine runs (a named level, so the binary is the same on
    any machine that builds it), else x86-64-v3; on other machines, their name."""
    chosen = os.environ.get("KILN_CPU_ISA", "").strip()
    if chosen and isa_problem(chosen) is None:
        return chosen
    if chosen:  # the client's configuration warns about it once; the kernels still build
        log.debug("KILN_CPU_ISA=%r: %s; using this machine's level", chosen,
                  isa_problem(chosen))
    if platform.machine() not in ("x86_64", "AMD64"):
        return platform.machine().lower() or FALLBACK_ISA
    return host_isa_level() or FALLBACK_ISA


def isa_problem(isa: str) -> str | None:
    """Why `isa` is not a level CPU kernels can be built for; None when it is (a named
    x86-64 level, or this machine's own name where it is not x86)."""
    known = [*_LEVELS]
    if platform.machine() not in ("x86_64", "AMD64"):
        known.append(platform.machine().lower())
    if isa in known:
        return None
    close = difflib.get_close_matches(isa, known, n=1, cutoff=0.75)
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"expected one of {', '.join(known)}{hint}"


DEFAULT_ISA = default_isa()


def compiler_path() -> str:
    """The C++ compiler: ``$KILN_CXX``, else ``$CXX``, else ``g++`` on the PATH."""
    return os.environ.get("KILN_CXX") or os.environ.get("CXX") or "g++"


@functools.lru_cache(maxsize=8)
def compiler_version(cxx: str) -> str:
    """The compiler's ``--version`` line; a missing compiler is a clear compile error."""
    exe = shutil.which(cxx)
    if exe is None:
        raise FileNotFoundError(f"C++ compiler {cxx!r} not found (set KILN_CXX or CXX to a "
                                "C++ compiler, or use cpu_backend='triton-interpret')")
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise FileNotFoundError(f"C++ compiler {cxx!r} does not run: {out.stderr.strip()}")
    return out.stdout.splitlines()[0].strip()


def isa_flags(isa: str) -> list[str]:
    """``-march`` for an x86-64 level; another machine's name (``aarch64``) means the
    compiler's baseline for it."""
    if isa.startswith("x86-64"):
        if isa not in _LEVELS:  # never a flag the compiler would reject after a long wait
            raise KilnCompileError(f"CPU target ISA {isa!r}: {isa_problem(isa)}",
                                   stage="kernel compile")
        return [f"-march={isa}", "-mtune=generic"]
    return []


@functools.lru_cache(maxsize=8)
def has_libmvec(cxx: str, isa: str) -> bool:
    """Whether glibc's vector math library links here (glibc 2.35+ has erf, tanh, ...)."""
    probe = ('#include <math.h>\nextern "C" float erff(float) '
             '__attribute__((__simd__("notinbranch")));\n'
             'extern "C" void f(float* x) {\n#pragma omp simd\n'
             "for (int i = 0; i < 64; ++i) x[i] = erff(x[i]) + expf(x[i]);\n}\n")
    with tempfile.TemporaryDirectory(prefix="kiln_probe_") as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text(probe)
        cmd = [cxx, *BASE_FLAGS, *isa_flags(isa), str(src), "-o", str(Path(tmp) / "p.so"),
               "-lmvec", "-Wl,--no-undefined", "-lm", "-lgomp"]
        try:
            ok = subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            return False
    return ok


def build_flags(cxx: str, isa: str) -> list[str]:
    flags = [*BASE_FLAGS, *isa_flags(isa)]
    if has_libmvec(cxx, isa):
        flags.append("-DKILN_HAVE_LIBMVEC")
    return flags


def link_flags(flags: list[str]) -> list[str]:
    return (["-lmvec"] if "-DKILN_HAVE_LIBMVEC" in flags else []) + ["-lm"]


def cache_key(source: str, flags: list[str], version: str, isa: str) -> str:
    """sha256 over the named parts that decide the binary."""
    parts = {"source": source, "prelude": prelude_source(), "flags": flags,
             "compiler": version, "isa": isa, "format": 1}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def compile_cpp(spec: KernelSpec, target: dict[str, Any]) -> tuple[bytes, dict[str, Any]]:
    """The shared object of ``spec`` for ``target`` and its metadata (cached by content)."""
    cxx = compiler_path()
    isa = str(target.get("isa") or DEFAULT_ISA)
    try:
        version = compiler_version(cxx)
    except (FileNotFoundError, OSError, subprocess.SubprocessError) as e:
        raise KilnCompileError(f"no usable C++ compiler: {e}", stage="kernel compile",
                               kernel=spec.name) from e
    flags = build_flags(cxx, isa)
    key = cache_key(spec.source, flags, version, isa)
    path = private_dir("cpp", key[:2]) / f"{key}.so"
    meta = {"cache_key": key, "compiler": version, "cxx": cxx, "flags": flags, "isa": isa,
            "symbol": spec.name}
    data = sealed_bytes(path)  # these bytes get published: only what this user built
    if data is None:
        data = _build(spec, cxx, flags, path)
    return data, meta


def _build(spec: KernelSpec, cxx: str, flags: list[str], path: Path) -> bytes:
    """Compile ``spec`` into the shared object at ``path`` (sealed); its bytes."""
    include = _prelude_dir()
    with tempfile.TemporaryDirectory(prefix="kiln_cpp_", dir=path.parent) as tmp:
        src = Path(tmp) / "kernel.cpp"
        src.write_text(spec.source)
        out = Path(tmp) / "kernel.so"
        cmd = [cxx, *flags, f"-I{include}", str(src), "-o", str(out), *link_flags(flags)]
        try:
            result = subprocess.run(cmd, capture_output=True, text=True,
                                    timeout=COMPILE_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError) as e:
            raise KilnCompileError(f"C++ compiler {cxx!r} failed to run: {e}",
                                   stage="kernel compile", kernel=spec.name) from e
        if result.returncode != 0:
            tail = "\n".join(result.stderr.strip().splitlines()[-20:])
            raise KilnCompileError(f"C++ compile failed ({' '.join(cmd[:1])} exit "
                                   f"{result.returncode}):\n{tail}", stage="kernel compile",
                                   kernel=spec.name)
        data = out.read_bytes()
        os.replace(out, path)
    seal(path, data)
    return data


def _prelude_dir() -> Path:
    """A folder holding ``kiln_prelude.h``, named by the prelude's hash."""
    text = prelude_source()
    digest = hashlib.sha256(text.encode()).hexdigest()[:24]
    folder = private_dir("cpp", "include", digest)
    verified_file(folder / PRELUDE_NAME, text.encode())
    return folder


def runnable_isa(isa: str) -> str:
    """``isa`` if this machine runs it, else the highest level it does run."""
    host = host_isa_level()
    if host is None or isa not in _LEVELS or _LEVELS.index(isa) <= _LEVELS.index(host):
        return isa
    return host


_loaded: dict[str, ctypes.CDLL] = {}
# Descriptors of loaded libraries stay open: the dynamic loader knows a library by the
# name it was opened with (/proc/self/fd/N), and a reused N would name the old one.
_open_fds: list[int] = []


def load_library(binary: bytes) -> ctypes.CDLL:
    """dlopen a shared object from its bytes, through a file named by their hash:
    compared with them through a descriptor, and loaded through that descriptor
    (``runtime.local_cache.open_verified``), so what runs is what was compared."""
    digest = hashlib.sha256(binary).hexdigest()
    if digest in _loaded:
        return _loaded[digest]
    path = verified_file(private_dir("cpp", "loaded", digest[:2]) / f"{digest}.so", binary)
    if not os.path.isdir("/proc/self/fd"):
        lib = ctypes.CDLL(str(path))
    else:
        fd = open_verified(path, binary)
        try:
            lib = ctypes.CDLL(f"/proc/self/fd/{fd}")
        except BaseException:
            os.close(fd)
            raise
        _open_fds.append(fd)
    _loaded[digest] = lib
    return lib


class CppLauncher:
    """``run(*tensors)`` calls the kernel with each tensor's data pointer."""

    def __init__(self, spec: KernelSpec, binary: Any = None) -> None:
        self.spec = spec
        data = binary.binary if binary is not None else b""
        isa = str((binary.target if binary is not None else {}).get("isa") or DEFAULT_ISA)
        if not data or runnable_isa(isa) != isa:
            if data:
                log.warning("kiln: kernel %s was built for %s, which this machine lacks; "
                            "recompiling for %s", spec.name, isa, runnable_isa(isa))
            data, _ = compile_cpp(spec, {"kind": "cpu", "isa": runnable_isa(isa)})
        try:
            library = load_library(data)
        except OSError as e:  # built for another machine or libc: build it for this one
            log.warning("kiln: kernel %s did not load (%s); recompiling for %s", spec.name,
                        e, DEFAULT_ISA)
            library = load_library(compile_cpp(spec, {"kind": "cpu", "isa": DEFAULT_ISA})[0])
        fn = getattr(library, spec.name)
        fn.argtypes = [ctypes.c_void_p] * len(spec.arg_buffers) + \
            [ctypes.c_int64] * len(spec.size_args)
        fn.restype = None
        self._fn = fn
        self._buffers = len(spec.arg_buffers)

    def run(self, *args: Any) -> None:
        """Buffers' data pointers, then the size arguments (ints) of a dynamic kernel."""
        n = self._buffers
        self._fn(*[t.data_ptr() for t in args[:n]], *args[n:])
