"""One configuration surface: ``KILN_*`` environment variables, and the same names in
lower case as ``torch.compile(..., options={...})`` keys (options win)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from kiln.compiler.debug import debug_enabled

DEFAULT_FARM_TIMEOUT = 300.0
MAX_AUTOTUNE_MODES = ("max-autotune", "max-autotune-no-cudagraphs")


@dataclass(frozen=True)
class KilnConfig:
    """Every Kiln setting, resolved from options and the environment."""

    store: str | None = None
    local_cache: str | None = None
    farm: str = "local"
    farm_timeout: float = DEFAULT_FARM_TIMEOUT
    signing_key: str | None = None
    require_signed: bool = False
    cpu_backend: str = "cpp"
    logs: str = ""
    debug: bool = False
    debug_dir: str | None = None
    autotune: bool = True
    max_autotune: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def resolve(options: dict[str, Any] | None = None) -> KilnConfig:
        options = {k.lower(): v for k, v in (options or {}).items()}
        values: dict[str, Any] = {}
        for f in fields(KilnConfig):
            if f.name == "extra":
                continue
            env = os.environ.get(f"KILN_{f.name.upper()}")
            raw = options.get(f.name, env)
            if raw is None:
                continue
            values[f.name] = _coerce(f.name, raw)
        if "farm" not in values and os.environ.get("RAY_ADDRESS") and "farm" not in options:
            values["farm"] = os.environ["RAY_ADDRESS"]
        known = {f.name for f in fields(KilnConfig)}
        values["extra"] = {k: v for k, v in options.items() if k not in known}
        values["debug"] = debug_enabled({"debug": values.get("debug", "")}) if "debug" in \
            values else False
        return KilnConfig(**values)

    def compiler_options(self) -> dict[str, Any]:
        """The options that reach the compiler (and so the cache key)."""
        opts: dict[str, Any] = {"cpu_backend": self.cpu_backend}
        opts.update(self.extra)
        return opts

    def with_mode(self, mode: str | None) -> KilnConfig:
        """``torch.compile``'s ``mode``: "max-autotune" (and its no-cudagraphs form) tunes
        matmuls over GEMM templates and the library call; other modes change nothing."""
        if mode in MAX_AUTOTUNE_MODES and not self.max_autotune:
            return replace(self, max_autotune=True)
        return self

    def debug_options(self) -> dict[str, Any]:
        return {"debug": "1" if self.debug else "", "debug_dir": self.debug_dir,
                "logs": self.logs}


def _coerce(name: str, raw: Any) -> Any:
    if name in ("require_signed", "autotune", "max_autotune"):
        return str(raw).lower() in ("1", "true", "yes", "on")
    if name == "farm_timeout":
        return float(raw)
    if name == "debug":
        return raw
    return str(raw)
