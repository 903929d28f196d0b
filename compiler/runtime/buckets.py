"""Size buckets of kernels with dynamic shapes: one launch config per bucket.

A kernel of a graph with symbolic sizes takes ``xnumel`` (and ``rnumel``) as arguments.
Its bucket at a launch is those numels rounded up to powers of two (``"65536x1024"``);
autotuning picks a config per bucket from the sizes actually seen, the artifact records
the configs by bucket (``CompiledGraph.buckets``), and ``BucketedLauncher`` picks the
bucket's launcher from each launch's numels (a small lookup). A bucket with no config yet
runs the heuristic config and is reported once, so that it can be tuned in the
background.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any

from ..codegen.kernel_spec import KernelSpec
from ..kernel_compile import ALIGN_KEY, CONSTEXPR_KEYS, symbolic_positions

_BUCKET_RE = re.compile(r"([0-9]{1,12})x([0-9]{1,12})")
_CONFIG_INTS = (*CONSTEXPR_KEYS, "num_warps", "num_stages", "num_ctas", ALIGN_KEY)
MAX_BUCKETS = 64  # per kernel, in a stored artifact
MAX_BLOCK = 2**20
MAX_REMEMBERED = 4096  # size sets a launcher remembers its choice for


def pow2_ceil(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def bucket_name(xnumel: int, rnumel: int = 1) -> str:
    """The bucket of a launch over ``xnumel`` x ``rnumel`` elements."""
    return f"{pow2_ceil(xnumel)}x{pow2_ceil(rnumel)}"


def _exponent(n: int) -> int:
    return (n - 1).bit_length() if n > 1 else 0


def bucket_index(xnumel: int, rnumel: int = 1) -> int:
    """The bucket of a launch as one small integer (the launcher's lookup key)."""
    return _exponent(xnumel) << 8 | _exponent(rnumel)


def index_of(name: str) -> int:
    """The integer key of a bucket name (``check_bucket``'ed)."""
    x, r = (int(part) for part in check_bucket(name).split("x"))
    return bucket_index(x, r)


def check_bucket(name: object) -> str:
    """``name`` if it is a bucket name (powers of two, ``"4096x1"``); ValueError else."""
    match = _BUCKET_RE.fullmatch(name) if isinstance(name, str) else None
    if match is None or any(pow2_ceil(int(g)) != int(g) for g in match.groups()):
        raise ValueError(f"invalid size bucket {name!r}: expected two powers of two such "
                         "as 4096x1")
    return name  # type: ignore[return-value]


def check_config(config: object, where: str) -> dict[str, int]:
    """A launch config from a store: known keys, small positive integers; ValueError
    naming ``where`` otherwise."""
    if not isinstance(config, dict) or not config:
        raise ValueError(f"{where}: a launch config must be a non-empty map, not {config!r}")
    out: dict[str, int] = {}
    for key, value in config.items():
        if key not in _CONFIG_INTS or type(value) is not int or not 0 < value <= MAX_BLOCK:
            raise ValueError(f"{where}: invalid launch config entry {key!r}: {value!r}")
        out[key] = value
    return out


def check_buckets(kernel: str, buckets: object) -> dict[str, dict[str, int]]:
    """A kernel's configs by bucket, as read from a manifest, checked."""
    if not isinstance(buckets, dict) or len(buckets) > MAX_BUCKETS:
        raise ValueError(f"kernel {kernel}: size buckets must be a map of at most "
                         f"{MAX_BUCKETS} entries")
    return {check_bucket(name): check_config(config, f"kernel {kernel} bucket {name}")
            for name, config in buckets.items()}


def numel_positions(spec: KernelSpec) -> tuple[int, int | None]:
    """Where ``xnumel`` and ``rnumel`` are among the kernel's arguments (rnumel: None for a
    pointwise kernel, or where the row is a compile-time constant)."""
    names = list(spec.signature)
    r_at = names.index("rnumel") if spec.signature.get("rnumel") not in (None, "constexpr") \
        else None
    return names.index("xnumel"), r_at


def launch_sizes(args: tuple[Any, ...]) -> tuple[list[int], list[int]]:
    """Of one launch's arguments: each tensor's extent in bytes (from its data pointer)
    and the integer size arguments: what a tuner needs to launch the kernel alone on
    scratch buffers at this size. No tensor is kept."""
    nbytes, sizes = [], []
    for a in args:
        if isinstance(a, int):
            sizes.append(a)
        elif hasattr(a, "stride"):
            extent = 1 + sum((n - 1) * s for n, s in zip(a.shape, a.stride())) \
                if a.numel() else 0
            nbytes.append(max(1, extent) * a.element_size())
    return nbytes, sizes


def aligned_sizes(spec: KernelSpec, sizes: list[int]) -> bool:
    """Whether a launch's integer size arguments (``launch_sizes``) fit the kernel's
    ``ALIGN`` variant: every symbolic one a multiple of 16."""
    exprs = spec.size_args
    return all(v % 16 == 0 for v, e in zip(sizes, exprs) if not e.isdigit())


def generic_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The config of the generic variant of an ``ALIGN`` config (None: it is generic)."""
    if not config.get(ALIGN_KEY):
        return None
    return {k: v for k, v in config.items() if k != ALIGN_KEY}


NewBucket = Callable[[str, str, list[int], list[int]], None]
# A bucket's name (None: the heuristic config) -> the launcher of its config's generic
# variant, or None where that config is generic already.
GenericFactory = Callable[[str | None], Any]


class BucketedLauncher:
    """``run(*args)``: the launcher of the launch's size bucket, else the heuristic one
    (and ``on_new(kernel, bucket, arg_bytes, sizes)`` once per unseen bucket).

    Launchers compiled with ``ALIGN`` run only launches whose symbolic size arguments
    are all multiples of 16; any other launch runs the generic variant of the same
    config, from ``generic`` (built on first need).

    The choice (bucket, variant, report) is made once per distinct set of size
    arguments and remembered: a launch at sizes seen before costs one tuple of its
    size arguments and one dict lookup before the chosen launcher runs."""

    def __init__(self, spec: KernelSpec, default: Any, by_bucket: dict[str, Any],
                 on_new: NewBucket | None = None,
                 generic: GenericFactory | None = None) -> None:
        self.name = spec.name
        self.x_at, self.r_at = numel_positions(spec)
        self.default = default
        self.by_bucket = dict(by_bucket)
        self.by_index = {index_of(name): launcher for name, launcher in by_bucket.items()}
        self.names = {index_of(name): name for name in by_bucket}
        self.on_new = on_new
        self.generic = generic
        symbolic = symbolic_positions(spec)
        self.symbolic = symbolic if generic is not None else ()
        self.unaligned: dict[int, Any] = {}  # bucket index -> its generic launcher
        self.generic_by_name: dict[str | None, Any] = {}
        self.seen: set[int] = set(self.by_index)
        # The size arguments that decide the choice: the numels and the symbolic sizes.
        keys = {self.x_at, *symbolic} | (
            {self.r_at} if self.r_at is not None else set())
        self.sizes_of = operator.itemgetter(*sorted(keys))
        self.chosen: dict[Any, Callable[..., None]] = {}  # sizes -> the launch to run
        self.run = self._runner()  # type: ignore[method-assign]

    def launcher_for(self, xnumel: int, rnumel: int = 1) -> Any:
        return self.by_index.get(bucket_index(xnumel, rnumel), self.default)

    def _runner(self) -> Callable[..., None]:
        """The launch closure: on the host path of every launch, so everything but the
        remembered choice's lookup is bound here."""
        chosen, sizes_of, choose = self.chosen, self.sizes_of, self._choose

        def run(*args: Any) -> None:
            launch = chosen.get(sizes_of(args))
            if launch is None:
                choose(args)
            else:
                launch(*args)

        return run

    def _choose(self, args: tuple[Any, ...]) -> None:
        """Launch at sizes not seen before: pick the bucket's launcher (or the generic
        variant, or the heuristic one), report a new bucket, launch, and remember the
        launcher's ``run`` (read after the launch: a static launcher binds its fast
        closure on its first launch)."""
        x = args[self.x_at]
        r = 1 if self.r_at is None else args[self.r_at]
        index = bucket_index(x, r)
        if any(args[at] & 15 for at in self.symbolic):  # the ALIGN variants do not hold
            launcher = self.unaligned.get(index) or self._generic(index)
        else:
            launcher = self.by_index.get(index, self.default)
        if index not in self.seen:
            self._report(index, x, r, args)
        launcher.run(*args)
        if len(self.chosen) >= MAX_REMEMBERED:
            self.chosen.clear()
        self.chosen[self.sizes_of(args)] = launcher.run

    def _generic(self, index: int) -> Any:
        """The generic variant for a bucket's launches (its config's, or the heuristic
        config's where the bucket has none), built once."""
        assert self.generic is not None
        name = self.names.get(index)
        launcher = self.generic_by_name.get(name)
        if launcher is None:
            launcher = self.generic_by_name[name] = self.generic(name)
        if launcher is None:  # that config is generic: its own launcher serves
            launcher = self.by_index[index] if name is not None else self.default
        self.unaligned[index] = launcher
        return launcher

    def run(self, *args: Any) -> None:  # replaced by ``_runner``'s closure
        raise NotImplementedError

    def _report(self, index: int, x: int, r: int, args: tuple[Any, ...]) -> None:
        self.seen.add(index)
        if self.on_new is not None:
            nbytes, sizes = launch_sizes(args)
            self.on_new(self.name, bucket_name(x, r), nbytes, sizes)
