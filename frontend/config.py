"""One configuration surface: ``KILN_*`` environment variables, and the same names in
lower case as ``torch.compile(..., options={...})`` keys (options win).

Every setting is declared once in :data:`SETTINGS`: its name, a parser (types, ranges,
known values), its default, what it means, and whether it changes compiled code. Only
those that do (``in_key``) reach the compiler and so the cache key; logging, paths,
timeouts, the farm's address and the store's settings never do.

Values are checked here, once. A bad value never raises into the user's program: it is
one :class:`KilnConfigWarning` naming the variable (or option), what was expected and the
default used instead. An unknown option or ``KILN_*`` variable is a warning with the
nearest known name ("did you mean ..."), and is ignored. The CLI is stricter with its own
``--option`` flags: :func:`option_problems` lists what is wrong, and the CLI refuses them.
"""

from __future__ import annotations

import difflib
import json
import os
import threading
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from kiln.artifact_store.config import (
    DEFAULT_LOCAL_CACHE_MAX_BYTES,
    DEFAULT_TIMEOUT_S,
    parse_size,
)

DEFAULT_FARM_TIMEOUT = 300.0
MAX_AUTOTUNE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")
FARM_MODES = ("local", "inprocess", "embedded", "auto")
CPU_BACKENDS = ("cpp", "triton-interpret")
LOG_NAMES = ("output_code",)
REGION_AUTO_NODES = 2000  # KILN_REGIONS=auto cuts graphs of this many ATen nodes or more

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
_OFF = ("off", "none", "disabled")


class KilnConfigWarning(UserWarning):
    """A Kiln setting that was ignored or replaced by its default; the message says why."""


# ---------------------------------------------------------------------------------------
# Parsers: each takes the raw value (a string from the environment, or any option value)
# and returns the typed value, or raises ValueError saying what was expected.


def parse_flag(raw: Any) -> bool:
    if isinstance(raw, bool):
        return raw
    text = str(raw).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueError("expected 1 or 0 (also true/false, yes/no, on/off)")


def parse_seconds(raw: Any) -> float:
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise ValueError("expected a number of seconds, such as 30 or 2.5") from None
    if not value > 0 or value == float("inf"):
        raise ValueError("expected a positive, finite number of seconds")
    return value


def parse_count(raw: Any) -> int:
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ValueError("expected a whole number, such as 200") from None
    if value < 0:
        raise ValueError("expected a whole number, 0 or more")
    return value


def parse_processes(raw: Any) -> str:
    """``auto`` or a count of processes."""
    text = str(raw).strip().lower()
    if text == "auto":
        return text
    try:
        return str(parse_count(text))
    except ValueError:
        raise ValueError("expected auto or a number of processes (0: this process)") from None


def parse_text(raw: Any) -> str:
    text = str(raw).strip()
    if not text:
        raise ValueError("expected a value (unset the variable for the default)")
    return text


def parse_bytes(raw: Any) -> int:
    try:
        return parse_size(raw if isinstance(raw, int) else str(raw))
    except ValueError:
        raise ValueError("expected a size such as 10G, 512M or 1000000") from None


def parse_json_object(raw: Any) -> dict[str, Any]:
    if isinstance(raw, Mapping):
        return dict(raw)
    try:
        value = json.loads(str(raw))
    except json.JSONDecodeError as e:
        raise ValueError(f"expected a JSON object ({e})") from None
    if not isinstance(value, dict):
        raise ValueError("expected a JSON object of fsspec storage options")
    return value


def choice(*names: str) -> Callable[[Any], str]:
    def parse(raw: Any) -> str:
        text = str(raw).strip().lower()
        if text in names:
            return text
        raise ValueError(f"expected one of {', '.join(names)}{did_you_mean(text, names)}")

    return parse


def parse_isa(raw: Any) -> str:
    """A CPU ISA level kernels can be built for; a bad one is warned about and the
    compiler uses this machine's level instead."""
    from kiln.compiler.codegen.cpp.build import isa_problem

    text = str(raw).strip()
    problem = isa_problem(text)
    if problem is not None:
        raise ValueError(f"{problem}; this machine's level is used")
    return text


def parse_logs(raw: Any) -> str:
    parts = [p.strip() for p in str(raw).split(",") if p.strip()]
    for part in parts:
        if part not in LOG_NAMES:
            raise ValueError(f"unknown log {part!r}: expected a comma list of "
                             f"{', '.join(LOG_NAMES)}{did_you_mean(part, LOG_NAMES)}")
    return ",".join(parts)


def parse_farm(raw: Any) -> str:
    """``local``, ``inprocess``, ``embedded``, ``auto``, or a Ray address
    ``[ray://]host:port``."""
    text = str(raw).strip()
    if text.lower() in FARM_MODES:
        return text.lower()
    host, sep, port = text.removeprefix("ray://").rpartition(":")
    if not sep:
        raise ValueError(f"expected local, inprocess, embedded, or a Ray address host:port"
                         f"{did_you_mean(text.lower(), FARM_MODES)}")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError("expected a Ray address host:port with a port from 1 to 65535")
    return text


def did_you_mean(name: str, known: Any) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


# ---------------------------------------------------------------------------------------
# The settings.


@dataclass(frozen=True)
class Setting:
    """One setting: ``KILN_<NAME>`` in the environment, ``name`` as an option."""

    name: str
    parse: Callable[[Any], Any]
    default: Any
    meaning: str
    in_key: bool = False  # changes compiled code: reaches the compiler and the key
    env_only: bool = False  # read from the environment by another layer (not an option)

    @property
    def env(self) -> str:
        return f"KILN_{self.name.upper()}"


SETTINGS: dict[str, Setting] = {s.name: s for s in (
    Setting("store", parse_text, None, "artifact store URL or path"),
    Setting("store_options", parse_json_object, None, "fsspec storage options (JSON)"),
    Setting("store_timeout", parse_seconds, DEFAULT_TIMEOUT_S, "seconds per store call"),
    Setting("store_read_only", parse_flag, False, "never write the store"),
    Setting("local_cache", parse_text, None, "local tier in front of a remote store"),
    Setting("local_cache_size", parse_bytes, DEFAULT_LOCAL_CACHE_MAX_BYTES,
            "bound of the local tier"),
    Setting("farm", parse_farm, "local", "where misses compile"),
    Setting("farm_timeout", parse_seconds, DEFAULT_FARM_TIMEOUT,
            "seconds before a client compiles itself"),
    Setting("signing_key", parse_text, None, "key that signs and verifies manifests"),
    Setting("require_signed", parse_flag, None, "refuse unsigned manifests"),
    Setting("trust_unsigned", parse_flag, False, "accept unsigned artifacts and packages "
            "from stores others can write (warns at every start)", env_only=True),
    Setting("cpu_backend", choice(*CPU_BACKENDS), "cpp", "kernels for CPU graphs",
            in_key=True),
    Setting("autotune", parse_flag, True, "autotune GPU kernels", in_key=True),
    # In the key when on (``frontend.core.compile.request_options``): off leaves keys as they were.
    Setting("max_autotune", parse_flag, False,
            "tune matmuls over GEMM templates and the library call"),
    Setting("deterministic", parse_flag, False,
            "scatters with float sums run ATen's deterministic kernels, not atomics",
            in_key=True),
    Setting("cudagraphs", parse_flag, False,
            "replay each GPU graph's launches as one CUDA graph (reduce-overhead)"),
    # Regional compilation (``frontend.core.regions``): a graph's compiled form, not its code.
    Setting("regions", choice("auto", "on", "off"), "auto",
            f"cut large graphs into regions compiled in parallel (auto: from "
            f"{REGION_AUTO_NODES} ATen nodes; on: any graph of two regions or more)"),
    Setting("region_nodes", parse_count, 100, "target ATen nodes per region"),
    Setting("region_processes", parse_processes, "auto",
            "processes for regions' graph stages when compiling here (0: this process)"),
    Setting("aot_cache", parse_flag, True,
            "a warm start skips AOTAutograd through a cache keyed on Dynamo's graph"),
    Setting("inference_direct", parse_flag, True,
            "an inference graph AOTAutograd's runtime would only call is called directly"),
    Setting("warm_first_call", parse_flag, True,
            "while a GPU graph compiles, run its library calls once (first-call costs)"),
    Setting("stats_file", parse_text, None, "counters file; off to disable"),
    Setting("logs", parse_logs, "", "output_code prints wrappers and kernels"),
    Setting("debug", parse_flag, False, "write a debug folder per graph"),
    Setting("debug_dir", parse_text, None, "where debug folders go"),
    Setting("cpu_isa", parse_isa, None, "x86-64 level of CPU kernels (in the target)",
            env_only=True),
    Setting("cxx", parse_text, None, "C++ compiler for CPU kernels", env_only=True),
    Setting("cache_dir", parse_text, None, "kernel sources and binaries cache",
            env_only=True),
    Setting("farm_file", parse_text, None, "address file of `kiln farm up`", env_only=True),
    Setting("farm_process", parse_flag, False,
            "reach a farm at a Ray address through a child process (no Ray here)",
            env_only=True),
    Setting("trace", parse_text, None, "compile timeline (Chrome trace JSON) path",
            env_only=True),
    Setting("summary", parse_flag, False,
            "print this process's cache hits, misses and compiles at exit (stderr)",
            env_only=True),
    Setting("autotune_exit_wait", parse_text, "5",
            "seconds a process waits at exit for background tuning", env_only=True),
    Setting("autotune_share", parse_text, "0.25",
            "with no farm up: the part of the GPU background tuning may hold", env_only=True),
    Setting("autotune_slice_ms", parse_text, "2",
            "the longest one tuning turn holds the GPU (ms)", env_only=True),
    Setting("autotune_gpu_shared", parse_flag, None,
            "a farm's autotuner shares its GPU with its host's programs", env_only=True),
    Setting("static_launcher", parse_flag, True,
            "launch cubins with torch's static CUDA launcher", env_only=True),
    Setting("cubin_loader", choice("driver", "torch"), "driver",
            "load cubins from memory through the CUDA driver, or torch's launcher",
            env_only=True),
    Setting("cubin_load_threads", parse_count, 4,
            "helper threads loading a graph's cubins (0: each at its first launch)",
            env_only=True),
    Setting("farm_kernel_store", parse_text, None,
            "on a farm: off stops kernel sharing through its store", env_only=True),
    # Claims in the store (``artifact_store.claims``): one compile per key across processes.
    Setting("claims", parse_flag, True,
            "a miss compiled here claims its key in the store; others wait for it",
            env_only=True),
    Setting("claim_ttl", parse_seconds, 30.0,
            "seconds a claim lives unless renewed (its holder renews it while compiling)",
            env_only=True),
    Setting("claim_wait", parse_seconds, 600.0,
            "seconds a process waits on another's claim before compiling itself",
            env_only=True),
    Setting("kernel_threads", parse_count, 0,
            "threads compiling one graph's kernels in process (0: the CPUs, at most 16)",
            env_only=True),
    Setting("tune_compile_processes", parse_count, None,
            "child processes compiling background tuning's GPU kernels (0: threads here)",
            env_only=True),
)}

# Variables of tests, demos and benchmarks: known, so never "unknown", but not settings.
INTERNAL_VARIABLES = frozenset({"KILN_TEST_COMPILE_DELAY", "KILN_TEST_FAKE_AUTOTUNE",
                                "KILN_TEST_FAKE_AUTOTUNE_MS", "KILN_DEMO_DIR",
                                "KILN_FUZZ_GRAPHS", "KILN_FUZZ_SEED", "KILN_FUZZ_SHARDS",
                                "KILN_FUZZ_LOG", "KILN_OPINFO_JSON", "KILN_FUZZ_EXAMPLES",
                                "KILN_FUZZ_REQUEST_EXAMPLES"})


def known_variables() -> list[str]:
    return [s.env for s in SETTINGS.values()] + sorted(INTERNAL_VARIABLES)


def option_problems(options: Mapping[str, Any]) -> list[str]:
    """What is wrong with these options (unknown names, bad values), one line each: the
    CLI refuses its ``--option`` flags with these."""
    problems = unknown_options(options)
    for raw_name, value in options.items():
        setting = SETTINGS.get(str(raw_name).lower())
        if setting is None or setting.env_only:
            continue
        try:
            setting.parse(value)
        except ValueError as e:
            problems.append(f"option {setting.name}={value!r}: {e}")
    return problems


def unknown_options(options: Mapping[str, Any]) -> list[str]:
    problems = []
    for raw_name in options:
        name = str(raw_name).lower()
        setting = SETTINGS.get(name)
        if setting is None or setting.env_only:
            problems.append(_unknown_option(name, setting))
    return problems


def _unknown_option(name: str, setting: Setting | None) -> str:
    if setting is not None:
        return f"option {name} is set by the environment only ({setting.env})"
    names = [s.name for s in SETTINGS.values() if not s.env_only]
    return f"unknown option {name!r}{did_you_mean(name, names)}"


def variable_problems(env: Mapping[str, str]) -> list[str]:
    """Unknown ``KILN_*`` variables, and env-only settings with bad values."""
    known = set(known_variables())
    problems = []
    for var in sorted(v for v in env if v.startswith("KILN_")):
        if var not in known:
            problems.append(f"{var} is not a Kiln variable{did_you_mean(var, known)}; "
                            "it is ignored")
    for setting in SETTINGS.values():
        raw = env.get(setting.env)
        if setting.env_only and raw is not None:
            try:
                setting.parse(raw)
            except ValueError as e:
                problems.append(f"{setting.env}={raw!r}: {e}")
    return problems


_warned: set[str] = set()
_warned_lock = threading.Lock()


def warn_once(message: str) -> None:
    """One warning per distinct message per process (configs resolve once per graph)."""
    with _warned_lock:
        if message in _warned:
            return
        _warned.add(message)
    warnings.warn(f"kiln: {message}", KilnConfigWarning, stacklevel=3)


@dataclass(frozen=True)
class KilnConfig:
    """Every Kiln setting, resolved from options and the environment and checked."""

    store: str | None = None
    store_options: dict[str, Any] | None = None
    store_timeout: float = DEFAULT_TIMEOUT_S
    store_read_only: bool = False
    local_cache: str | None = None
    local_cache_size: int = DEFAULT_LOCAL_CACHE_MAX_BYTES
    farm: str = "local"
    farm_timeout: float = DEFAULT_FARM_TIMEOUT
    signing_key: str | None = field(default=None, repr=False)
    require_signed: bool | None = None  # None: required exactly when a key is set
    cpu_backend: str = "cpp"
    autotune: bool = True
    max_autotune: bool = False
    deterministic: bool = False
    cudagraphs: bool = False  # a runtime choice: not in the key
    regions: str = "auto"
    region_nodes: int = 100
    region_processes: str = "auto"
    aot_cache: bool = True  # skip AOTAutograd on a warm start (frontend.core.aot.cache)
    inference_direct: bool = True  # skip AOTAutograd's runtime wrappers where they only call
    warm_first_call: bool = True  # frontend.core.warmup: not in the key
    stats_file: str | None = None
    logs: str = ""
    debug: bool = False
    debug_dir: str | None = None
    problems: tuple[str, ...] = ()  # what was ignored or replaced (each warned once)

    @staticmethod
    def resolve(options: Mapping[str, Any] | None = None, *,
                env: Mapping[str, str] | None = None, warn: bool = True) -> KilnConfig:
        """Options first, then ``KILN_*`` variables, then defaults; every bad value or
        unknown name is a problem, warned about once (``warn``) and never raised."""
        env = os.environ if env is None else env
        options = {str(k).lower(): v for k, v in (options or {}).items()}
        problems = [f"{p}; it is ignored" for p in unknown_options(options)]
        problems += variable_problems(env)
        values: dict[str, Any] = {}
        for setting in SETTINGS.values():
            if setting.env_only:
                continue
            value, problem = _resolve_one(setting, options, env)
            values[setting.name] = value
            if problem:
                problems.append(problem)
        if "farm" not in options and not env.get("KILN_FARM") and env.get("RAY_ADDRESS"):
            values["farm"] = env["RAY_ADDRESS"]
        problems = list(dict.fromkeys(problems))
        if warn:
            for problem in problems:
                warn_once(problem)
        return KilnConfig(**values, problems=tuple(problems))

    def compiler_options(self) -> dict[str, Any]:
        """The options that change compiled code: the only ones that reach the compiler
        (and so the cache key)."""
        return {s.name: getattr(self, s.name) for s in SETTINGS.values() if s.in_key}

    def with_mode(self, mode: str | None) -> KilnConfig:
        """``torch.compile``'s ``mode``: "reduce-overhead" replays GPU graphs as CUDA
        graphs; "max-autotune" (and its no-cudagraphs form) tunes matmuls over GEMM
        templates and the library call; other modes change nothing."""
        if mode == "reduce-overhead" and not self.cudagraphs:
            return replace(self, cudagraphs=True)
        if mode in MAX_AUTOTUNE_MODES and not self.max_autotune:
            return replace(self, max_autotune=True)
        return self

    def debug_options(self) -> dict[str, Any]:
        return {"debug": "1" if self.debug else "", "debug_dir": self.debug_dir,
                "logs": self.logs}

    def store_kwargs(self) -> dict[str, Any]:
        """``open_store``'s arguments: every store setting, already checked."""
        stats_file: str | bool | None = self.stats_file
        if self.stats_file is not None and self.stats_file.lower() in _OFF:
            stats_file = False
        require = self.require_signed
        return {"url": self.store, "local_cache": self.local_cache,
                "local_cache_max_bytes": self.local_cache_size,
                "signing_key": self.signing_key,
                "require_signed": require if require is not None else
                self.signing_key is not None,
                "read_only": self.store_read_only, "storage_options": self.store_options or {},
                "timeout": self.store_timeout, "stats_file": stats_file}


def _resolve_one(setting: Setting, options: Mapping[str, Any], env: Mapping[str, str]
                 ) -> tuple[Any, str | None]:
    """(value, problem): the option if given, else the variable, else the default; a value
    that does not parse falls back to the variable (for an option), then the default."""
    candidates = []
    if setting.name in options:
        candidates.append((f"option {setting.name}", options[setting.name]))
    raw_env = env.get(setting.env)
    if raw_env is not None and raw_env.strip() != "":
        candidates.append((setting.env, raw_env))
    for source, raw in candidates:
        try:
            return setting.parse(raw), None
        except ValueError as e:
            return setting.default, (f"{source}={raw!r}: {e}; using the default "
                                     f"{_show_default(setting)}")
    return setting.default, None


def _show_default(setting: Setting) -> str:
    default = setting.default
    if default is None:
        return "(unset)"
    if isinstance(default, bool):
        return "1" if default else "0"
    if setting.name == "local_cache_size":
        return f"{default // 2**30}G"
    return f"{default:g}" if isinstance(default, float) else repr(default)
