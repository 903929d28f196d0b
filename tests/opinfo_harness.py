"""PyTorch's OpInfo database through ``backend="kiln"``: each op's first samples compiled,
run and compared with eager.

An op passes when every sample it ran compiled with no whole-graph eager fallback (no
``KilnFallbackWarning``) and matched eager under dtype-aware tolerances. Per op the result
is one of:

- ``pass``: compiled and matched;
- ``fallback``: Kiln ran a graph eagerly (the warning's text is kept);
- ``wrong``: compiled but the values, dtype or shape differ from eager;
- ``error``: compiling or running raised;
- ``skipped``: no sample for the dtype, or eager itself failed or is nondeterministic;
- ``not_reached``: the run's time budget ran out before the op (a partial run).

``tests/cpu/test_opinfo.py`` runs a fast subset (and the whole set with ``-m opinfo_full``);
``bench/opinfo.py`` runs any set on any device and writes JSON.
"""

from __future__ import annotations

import math
import time
import traceback
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

# (rtol, atol) per dtype. Kiln computes reduced-precision values in fp32 and rounds once
# (eager rounds after each op), and reductions add in another order.
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float64: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.complex64: (1e-4, 1e-5),
    torch.complex128: (1e-7, 1e-7),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (5e-2, 5e-2),
    torch.complex32: (1e-2, 1e-2),  # an FFT of float16 on CUDA
}
REDUCED = (torch.float16, torch.bfloat16)

# Ops whose outputs are uninitialized memory: only sizes, strides and dtypes compare.
UNINITIALIZED = frozenset({
    "empty", "empty_like", "new_empty", "new_empty_strided", "empty_strided",
    "empty_permuted", "nn.functional.dropout", "torch.empty",
})
# Single outputs that are uninitialized memory, by flat output index: flash attention's
# fourth output is ``unused``, an ``at::empty({})`` the kernel never writes.
UNINITIALIZED_OUTPUTS: dict[str, frozenset[int]] = {
    "torch.ops.aten._flash_attention_forward": frozenset({3}),
}

# The CI subset: ops that exercise each category the harness found (views, complex,
# graph constants, effectful ops, meta-less ops, index lowerings, reductions, matmuls).
FAST_OPS = (
    "abs", "add", "addmm", "amax", "argmax", "atan2", "bmm", "cat", "clamp", "cumsum",
    "diagonal", "div.no_rounding_mode", "expand", "flip", "gather", "geqrf", "histogram",
    "index_select", "logical_and", "logical_xor", "masked.var",
    "linalg.inv", "log_softmax", "logsumexp", "masked.sum", "masked.amax", "matmul",
    "max.reduction_with_dim", "mean", "mul", "nn.functional.linear", "nn.functional.gelu",
    "nn.functional.layer_norm", "permute", "pow", "reshape", "roll", "rsqrt", "sigmoid",
    "softmax", "squeeze", "squeeze.multiple", "sum", "t", "topk", "tril", "var_mean",
    "view_as_complex", "cfloat", "where", "fft.fft", "nn.functional.linear_cross_entropy",
    "nn.functional.linear_cross_entropy.chunked",
)


@dataclass
class OpResult:
    """The outcome of one op (every sample that ran) for one dtype."""

    op: str
    dtype: str
    status: str
    samples: int = 0
    detail: str = ""
    seconds: float = 0.0


@dataclass
class Summary:
    """Per-op results and the counts the issue's target is stated in."""

    device: str
    dtype: str
    backend: str
    results: list[OpResult] = field(default_factory=list)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for r in self.results:
            out[r.status] = out.get(r.status, 0) + 1
        return out

    def pass_rate(self) -> float:
        counts = self.counts()
        ran = sum(v for k, v in counts.items() if k not in ("skipped", "not_reached"))
        return counts.get("pass", 0) / ran if ran else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "dtype": self.dtype, "backend": self.backend,
                "counts": self.counts(), "pass_rate": self.pass_rate(),
                "results": [asdict(r) for r in self.results]}


def select_ops(names: Iterable[str] | None = None) -> list[Any]:
    """OpInfos by ``name`` or ``name.variant`` (all of ``op_db`` when ``names`` is None)."""
    _provide_expecttest()
    from torch.testing._internal.common_methods_invocations import op_db

    if names is None:
        return list(op_db)
    wanted = set(names)
    return [op for op in op_db if full_name(op) in wanted]


def _provide_expecttest() -> None:
    """``torch.testing._internal`` imports ``expecttest`` only to subclass its ``TestCase``
    and read ``ACCEPT``; the OpInfo database itself never uses it. Where the package is
    missing (the GPU host has no network), a stand-in module offers those two names, and
    its expect-assertions raise rather than pass."""
    try:
        import expecttest  # noqa: F401
        return
    except ImportError:
        pass
    import sys
    import types
    import unittest

    class TestCase(unittest.TestCase):
        def assertExpectedInline(self, *args: Any, **kwargs: Any) -> None:  # noqa: N802
            raise NotImplementedError("expecttest is not installed (stand-in module)")

        assertExpectedRaisesInline = assertExpectedInline  # noqa: N815

    module = types.ModuleType("expecttest")
    module.ACCEPT = False  # type: ignore[attr-defined]
    module.TestCase = TestCase  # type: ignore[attr-defined]
    sys.modules["expecttest"] = module


def full_name(op: Any) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


class _Skip(Exception):
    pass


def run_op(op: Any, device: str, dtype: torch.dtype, max_samples: int = 3) -> OpResult:
    """Compile and compare ``op``'s first ``max_samples`` samples for ``dtype``."""
    name = full_name(op)
    start = time.perf_counter()
    result = OpResult(name, str(dtype).removeprefix("torch."), "skipped")
    if dtype not in op.supported_dtypes(device):
        result.detail = "dtype not supported by the op"
        return result
    try:
        samples = list(_first(op.sample_inputs(device, dtype, requires_grad=False),
                              max_samples))
    except Exception as e:  # noqa: BLE001 - the database itself failing is a skip
        result.detail = f"sample_inputs raised {type(e).__name__}: {e}"
        return result
    for sample in samples:
        status, detail = _run_sample(op, sample, dtype)
        if status == "skipped":
            result.detail = result.detail or detail
            continue
        result.samples += 1
        if status != "pass":
            result.status, result.detail = status, detail
            break
        result.status = "pass"
    result.seconds = time.perf_counter() - start
    return result


def _first(it: Iterable[Any], n: int) -> Iterable[Any]:
    for i, x in enumerate(it):
        if i >= n:
            return
        yield x


def _sample_fn(op: Any, sample: Any) -> tuple[Callable[..., Any], list[torch.Tensor]]:
    """A function of the sample's tensors (everything else is baked in) and those tensors."""
    flat, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
    slots = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]
    tensors = [flat[i] for i in slots]

    def fn(*ts: torch.Tensor) -> Any:
        values = list(flat)
        for i, t in zip(slots, ts):
            values[i] = t
        inp, args, kwargs = tree_unflatten(values, spec)
        return op(inp, *args, **kwargs)

    return fn, tensors


def _clone(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [t.clone() for t in tensors]


def _eager(fn: Callable[..., Any], tensors: Sequence[torch.Tensor]) -> tuple[Any, list[Any]]:
    """Eager outputs and the inputs after the call (in-place ops mutate them)."""
    args = _clone(tensors)
    torch.manual_seed(1234)
    return fn(*args), args


def _run_sample(op: Any, sample: Any, dtype: torch.dtype) -> tuple[str, str]:
    fn, tensors = _sample_fn(op, sample)
    try:
        expected, expected_inputs = _eager(fn, tensors)
        again, _ = _eager(fn, tensors)
    except Exception as e:  # noqa: BLE001 - eager failing is not Kiln's failure
        return "skipped", f"eager raised {type(e).__name__}: {e}"
    uninitialized = full_name(op) in UNINITIALIZED or op.name in UNINITIALIZED
    if not uninitialized and not _same(again, expected, exact=True):
        return "skipped", "eager is nondeterministic"
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="kiln", dynamic=False)
    args = _clone(tensors)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            torch.manual_seed(1234)
            actual = compiled(*args)
        except Exception as e:  # noqa: BLE001 - recorded as the op's failure
            return "error", _short(e)
    from kiln import KilnFallbackWarning

    fallbacks = [str(w.message) for w in caught if issubclass(w.category, KilnFallbackWarning)]
    if fallbacks:
        return "fallback", fallbacks[0][:500]
    mismatch = _compare((actual, args), (expected, expected_inputs), uninitialized, dtype,
                        skip=UNINITIALIZED_OUTPUTS.get(full_name(op), frozenset()))
    if mismatch and dtype in REDUCED and _as_accurate_as_eager(
            fn, tensors, (actual, args), (expected, expected_inputs), dtype):
        return "pass", f"matched a float64 reference as closely as eager ({mismatch[:200]})"
    return ("wrong", mismatch) if mismatch else ("pass", "")


def _as_accurate_as_eager(fn: Callable[..., Any], tensors: Sequence[torch.Tensor],
                          actual: Any, expected: Any, dtype: torch.dtype) -> bool:
    """In float16 and bfloat16, Kiln computes a fused chain in float32 and rounds once
    where eager rounds after each op, so the two can differ by more than the dtype's
    tolerance with Kiln the closer to the exact value. True when, against the op run in
    float64, Kiln's error (root mean square and largest) is at most twice eager's plus a
    tenth of the dtype's atol, for every floating output; non-finite reference values
    must match eager exactly."""
    try:
        reference, ref_inputs = _eager(fn, [t.double() if t.is_floating_point() else t
                                            for t in tensors])
    except Exception:  # noqa: BLE001 - no float64 kernel: no second opinion
        return False
    a_flat, a_spec = tree_flatten(actual)
    e_flat, _ = tree_flatten(expected)
    r_flat, r_spec = tree_flatten((reference, ref_inputs))
    if a_spec != r_spec:
        return False
    slack = TOLERANCE[dtype][1] / 10
    for a, e, r in zip(a_flat, e_flat, r_flat):
        if not isinstance(e, torch.Tensor) or _compare_leaf(a, e, False, False, dtype) is None:
            continue
        if not (a.is_floating_point() and isinstance(r, torch.Tensor)
                and r.shape == a.shape and _no_worse(a, e, r, slack)):
            return False
    return True


def _no_worse(a: torch.Tensor, e: torch.Tensor, r: torch.Tensor, slack: float) -> bool:
    a, e, r = (t.detach().to("cpu", torch.float64) for t in (a, e, r))
    finite = torch.isfinite(r)
    if not torch.equal(a[~finite].nan_to_num(), e[~finite].nan_to_num()):
        return False
    err_a, err_e = (a - r)[finite].abs(), (e - r)[finite].abs()
    if err_a.numel() == 0:
        return True
    if err_a.isnan().any():
        return False
    rms_a, rms_e = err_a.square().mean().sqrt(), err_e.square().mean().sqrt()
    return bool(rms_a <= 2 * rms_e + slack and err_a.max() <= 2 * err_e.max() + slack)


def _short(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}: {str(e)[:400]}{where}"


def _same(a: Any, b: Any, exact: bool) -> bool:
    return _compare(a, b, uninitialized=False, exact=exact) is None


def _tolerance(out: torch.dtype, run: torch.dtype | None) -> tuple[float, float]:
    """(rtol, atol) for an output of dtype ``out`` in a run of ``run``: exact for
    integers and bool, else the looser of the two dtypes' tolerances."""
    if out not in TOLERANCE:
        return 0.0, 0.0
    rtol, atol = TOLERANCE[out]
    if run in REDUCED and not out.is_complex:
        rtol, atol = max(rtol, TOLERANCE[run][0]), max(atol, TOLERANCE[run][1])
    return rtol, atol


def _compare(actual: Any, expected: Any, uninitialized: bool,
             dtype: torch.dtype | None = None, exact: bool = False,
             skip: frozenset[int] = frozenset()) -> str | None:
    """None when ``actual`` matches ``expected``; otherwise what differs. ``dtype`` is
    the run's (a float32 output of float16 inputs is held to float16's tolerance);
    outputs in ``skip`` are uninitialized: only their sizes and dtypes compare."""
    a_flat, a_spec = tree_flatten(actual)
    e_flat, e_spec = tree_flatten(expected)
    if a_spec != e_spec:
        return f"output structure {a_spec} != eager {e_spec}"
    for i, (a, e) in enumerate(zip(a_flat, e_flat)):
        problem = _compare_leaf(a, e, uninitialized or i in skip, exact, dtype)
        if problem:
            return f"output {i}: {problem}"
    return None


def _compare_leaf(a: Any, e: Any, uninitialized: bool, exact: bool,
                  dtype: torch.dtype | None = None) -> str | None:
    if not isinstance(e, torch.Tensor):
        if isinstance(e, float) and isinstance(a, float) and math.isnan(e) and math.isnan(a):
            return None
        return None if a == e else f"{a!r} != {e!r}"
    if not isinstance(a, torch.Tensor):
        return f"a {type(a).__name__}, eager a tensor"
    if a.dtype != e.dtype or a.shape != e.shape:
        return f"{a.dtype}{tuple(a.shape)} != eager {e.dtype}{tuple(e.shape)}"
    if uninitialized:
        return None
    rtol, atol = (0.0, 0.0) if exact else _tolerance(e.dtype, dtype)
    try:
        torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True,
                                   check_device=False, check_stride=False)
    except AssertionError as err:
        return str(err).replace("\n", " ")[:400]
    return None


def run_ops(ops: Sequence[Any], device: str, dtype: torch.dtype, backend: str,
            max_samples: int = 3, progress: Callable[[OpResult], None] | None = None,
            deadline: float | None = None) -> Summary:
    """Every op of ``ops`` for ``dtype``; ``progress`` sees each result as it comes. Ops
    after ``deadline`` (``time.time()``) are ``not_reached``."""
    summary = Summary(device, str(dtype).removeprefix("torch."), backend)
    for op in ops:
        if deadline is not None and time.time() > deadline:
            result = OpResult(full_name(op), summary.dtype, "not_reached")
        else:
            result = run_op(op, device, dtype, max_samples)
        summary.results.append(result)
        if progress is not None:
            progress(result)
    return summary


def format_summary(summary: Summary) -> str:
    """The counts, the pass rate and every op that did not pass, one line each."""
    counts = summary.counts()
    lines = [f"OpInfo {summary.device} {summary.dtype} ({summary.backend}): "
             + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
             + f"; pass rate {100 * summary.pass_rate():.2f}% of ops that ran"]
    for r in summary.results:
        if r.status not in ("pass", "skipped", "not_reached"):
            lines.append(f"  {r.status:8s} {r.op}: {r.detail[:300]}")
    return "\n".join(lines)
