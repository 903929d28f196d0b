"""GEMM templates in the IR: the problem a matmul poses, the buffer a Triton template
computes, and the per-graph record of which algorithm each matmul uses.

A ``GemmProblem`` is everything that decides how fast a matmul runs (op, sizes, dtypes,
strides, TF32) and nothing about where it sits in a graph: two models with the same
shapes pose the same problems, which is what lets a choice made for one serve the other
(``compiler.select_algorithm`` keys the choices). A ``GemmTemplateBuffer`` is a
``TemplateBuffer`` whose kernel is the Triton GEMM template with one tile config; its
reads are its declared inputs, and pointwise consumers fuse into its store.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..virtualized import V
from .nodes import TemplateBuffer

EXTERN = "extern"
TEMPLATE = "template"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return value


@dataclass(frozen=True)
class GemmProblem:
    """One matmul as a tuning problem: ``out[b] = a[b] @ b[b]`` (``batch`` 1 for mm).

    Strides are (batch, row, column) in elements; ``a_dtype`` / ``b_dtype`` are the
    stored dtypes the template loads (a prologue cast converts them to ``dtype``);
    ``epilogue`` says pointwise work follows the product (it fuses into a template's
    store, while the extern call pays a round trip of the output through memory).
    """

    op: str  # "mm" or "bmm"
    batch: int
    m: int
    n: int
    k: int
    dtype: str
    a_dtype: str
    b_dtype: str
    a_stride: tuple[int, int, int]
    b_stride: tuple[int, int, int]
    epilogue: bool = False
    allow_tf32: bool = False

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["a_stride"], d["b_stride"] = list(self.a_stride), list(self.b_stride)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> GemmProblem:
        return GemmProblem(
            str(d["op"]), int(d["batch"]), int(d["m"]), int(d["n"]), int(d["k"]),
            str(d["dtype"]), str(d["a_dtype"]), str(d["b_dtype"]),
            _triple(d["a_stride"]), _triple(d["b_stride"]), bool(d.get("epilogue", False)),
            bool(d.get("allow_tf32", False)))

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    def out_size(self) -> tuple[int, ...]:
        return (self.batch, self.m, self.n) if self.op == "bmm" else (self.m, self.n)

    def flops(self) -> int:
        return 2 * self.batch * self.m * self.n * self.k


def _triple(value: Any) -> tuple[int, int, int]:
    a, b, c = (int(v) for v in value)
    return (a, b, c)


@dataclass(eq=False, repr=False)
class GemmTemplateBuffer(TemplateBuffer):
    """The output of the Triton GEMM template for ``problem`` with tile ``config``.

    ``inputs`` are ``[a, b]`` (realized buffers or strided views of them); the product
    is accumulated in fp32 and rounded to the buffer's dtype where it is stored.
    """

    problem: GemmProblem | None = None
    config: dict[str, Any] = field(default_factory=dict)

    def get_problem(self) -> GemmProblem:
        assert self.problem is not None
        return self.problem


@dataclass
class GemmSelection:
    """How this graph's matmuls are lowered (``V.graph.gemm_selection``).

    ``mode`` "default": every matmul is the extern library call (heuristics, fast
    compiles). "max-autotune": each matmul takes the choice ``decided`` holds for its
    key; a matmul with no decided choice is lowered to the extern call and listed in
    ``pending``, for the farm to benchmark and compile the graph again with the winner.
    ``templates`` is False where the graph's kernels are not Triton (C++ on CPU).
    """

    mode: str = "default"
    templates: bool = False
    target: dict[str, Any] = field(default_factory=dict)
    allow_tf32: bool = False
    decided: dict[str, dict[str, Any]] = field(default_factory=dict)
    pending: dict[str, GemmProblem] = field(default_factory=dict)
    used: dict[str, dict[str, Any]] = field(default_factory=dict)

    @staticmethod
    def from_options(options: dict[str, Any], templates: bool,
                     target: dict[str, Any] | None) -> GemmSelection:
        mode = "max-autotune" if max_autotune_requested(options) else "default"
        decided = options.get("gemm_choices") or {}
        return GemmSelection(mode, templates, dict(target or {}),
                             _truthy(options.get("allow_tf32", False)),
                             {str(k): dict(v) for k, v in dict(decided).items()})

    def choose(self, problem: GemmProblem) -> dict[str, Any] | None:
        """The template config to use for ``problem``, or None for the extern call."""
        if self.mode != "max-autotune" or not self.templates:
            return None
        from ..select_algorithm import choice_key

        key = choice_key(problem, self.target)
        choice = self.decided.get(key)
        if choice is None:
            self.pending[key] = problem
            return None
        self.used[key] = {"problem": problem.to_dict(), **choice}
        if choice.get("kind") != TEMPLATE:
            return None
        return dict(choice["config"])


def max_autotune_requested(options: dict[str, Any]) -> bool:
    return _truthy(options.get("max_autotune", False))


def _truthy(value: Any) -> bool:
    return str(value).lower() in ("1", "true", "yes", "on")


def current_selection() -> GemmSelection:
    """The graph's selection; a graph lowered outside the driver uses the defaults."""
    found = getattr(V.graph, "gemm_selection", None)
    return found if isinstance(found, GemmSelection) else GemmSelection()


def record_gemm_choices(compiled: Any, selection: GemmSelection) -> None:
    """What the artifact keeps of the selection: each matmul's choice (and timings), and
    the problems still waiting for a benchmark."""
    if selection.mode != "max-autotune":
        return
    compiled.stats["gemm_choices"] = dict(sorted(selection.used.items()))
    compiled.stats["gemm_pending"] = {k: p.to_dict() for k, p in sorted(selection.pending.items())}
