"""Lowering families with a dynamic dimension, shared by the C++ and Triton-interpreter
tests: each case is compiled once with ``backend="kiln"`` (its dynamic dimensions marked
with ``mark_dynamic``) and called at several sizes, every output compared with eager.

A case's ``make_args(n, generator)`` builds fresh random inputs whose dynamic dimensions
have size ``n``; ``dynamic`` lists (input, dim) pairs to mark.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

# 1 and 2 first: Dynamo specializes a size of 1 (a graph of its own, static), then marks
# the dimension dynamic at 2; a prime and a large size then reuse the symbolic graph.
SIZES = (2, 1, 7, 13, 1031)


@dataclass(frozen=True)
class DynamicCase:
    name: str
    fn: Callable[..., Any]
    make_args: Callable[[int, torch.Generator], list[torch.Tensor]]
    dynamic: tuple[tuple[int, int], ...] = ((0, 0),)
    reduction: bool = False


def _randn(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


_W = torch.randn(24, 16, generator=torch.Generator().manual_seed(3))

CASES = [
    DynamicCase("pointwise", lambda x, y: (x * y + 1).relu() - x.sigmoid(),
                lambda n, g: [_randn(g, n, 16), _randn(g, n, 16)], ((0, 0), (1, 0))),
    DynamicCase("broadcast", lambda x, b: torch.tanh(x + b) * 2,
                lambda n, g: [_randn(g, n, 3, 8), _randn(g, 8)]),
    DynamicCase("sum_rows", lambda x: x.sum(-1) + x.amax(-1),
                lambda n, g: [_randn(g, n, 33)], reduction=True),
    DynamicCase("sum_dynamic_row", lambda x: x.sum(-1) * x.mean(-1),
                lambda n, g: [_randn(g, 5, n)], ((0, 1),), reduction=True),
    DynamicCase("sum_columns", lambda x: x.sum(0), lambda n, g: [_randn(g, n, 20)],
                reduction=True),
    DynamicCase("softmax", lambda x: x.softmax(-1), lambda n, g: [_randn(g, 4, n)],
                ((0, 1),), reduction=True),
    DynamicCase("layer_norm", lambda x: F.layer_norm(x, (24,)) * 3,
                lambda n, g: [_randn(g, n, 24)], reduction=True),
    DynamicCase("var_mean", lambda x: torch.var_mean(x, -1),
                lambda n, g: [_randn(g, 3, n)], ((0, 1),), reduction=True),
    DynamicCase("view_transpose", lambda x: (x.view(x.shape[0], 4, 4).transpose(1, 2) + 1)
                .reshape(x.shape[0], 16), lambda n, g: [_randn(g, n, 16)]),
    DynamicCase("permute_contiguous", lambda x: x.permute(1, 0, 2).contiguous() * 2,
                lambda n, g: [_randn(g, n, 3, 5)]),
    DynamicCase("slice", lambda x: x[:, 1:] * x[:, :-1],
                lambda n, g: [_randn(g, 3, n + 1)], ((0, 1),)),
    DynamicCase("cat", lambda x, y: torch.cat([x, y * 2], 0).sum(-1),
                lambda n, g: [_randn(g, n, 6), _randn(g, n, 6)], ((0, 0), (1, 0))),
    DynamicCase("pad", lambda x: F.pad(x, (1, 2)) + 1, lambda n, g: [_randn(g, n, 5)]),
    DynamicCase("index_select", lambda x, i: x[i] * 2,
                lambda n, g: [_randn(g, n, 6), torch.randint(0, n, (9,), generator=g)]),
    DynamicCase("creation", lambda x: x + torch.arange(x.shape[0]).unsqueeze(-1)
                + torch.ones_like(x), lambda n, g: [_randn(g, n, 4)]),
    DynamicCase("matmul", lambda x: (x @ _W.t()).relu() + 1, lambda n, g: [_randn(g, n, 16)]),
    DynamicCase("size_as_value", lambda x: x.sum(-1) / x.shape[0] + x.shape[0],
                lambda n, g: [_randn(g, n, 12)], reduction=True),
    DynamicCase("bmm", lambda x, y: torch.bmm(x, y).sum(-1),
                lambda n, g: [_randn(g, 2, n, 8), _randn(g, 2, 8, n)], ((0, 1), (1, 2)),
                reduction=True),
]


def tolerance(case: DynamicCase) -> dict[str, float]:
    tol = {"rtol": 1e-4, "atol": 1e-4} if case.reduction else {"rtol": 1e-5, "atol": 1e-5}
    return {**tol, "equal_nan": True}  # a variance over one element is nan, as in eager


def run_case(case: DynamicCase, options: dict[str, Any], sizes: Sequence[int] = SIZES,
             seed: int = 0) -> int:
    """Compile ``case`` once, call it at ``sizes`` against eager; fail on any eager
    fallback. Returns how many ATen graphs Dynamo asked Kiln to compile."""
    from kiln.frontend.core import compile as kiln_compile
    from kiln.frontend.core.fallback import KilnFallbackWarning

    asked = []
    original = kiln_compile.compile_and_load

    def counting(*args: Any, **kwargs: Any) -> Any:
        asked.append(args[-1])
        return original(*args, **kwargs)

    kiln_compile.compile_and_load = counting
    try:
        torch._dynamo.reset()
        compiled = torch.compile(case.fn, backend="kiln", options=options)
        g = torch.Generator().manual_seed(seed)
        for k, n in enumerate(sizes):
            args = case.make_args(n, g)
            if k == 0:
                for i, d in case.dynamic:
                    torch._dynamo.mark_dynamic(args[i], d)
            with warnings.catch_warnings():
                warnings.simplefilter("error", KilnFallbackWarning)
                out = compiled(*args)
            torch.testing.assert_close(out, case.fn(*args), **tolerance(case),
                                       msg=lambda m, n=n: f"{case.name} at size {n}: {m}")
    finally:
        kiln_compile.compile_and_load = original
    return len(asked)


# A model at 5 batch sizes and 5 sequence lengths (every pair's first call per size; the
# tokens differ per call).
MODEL_BATCHES = (2, 3, 5, 4, 7)
MODEL_LENGTHS = (8, 11, 16, 29, 9)


def run_decoder(options: dict[str, Any], seed: int = 0,
                batches: Sequence[int] = MODEL_BATCHES,
                lengths: Sequence[int] = MODEL_LENGTHS) -> dict[str, Any]:
    """Call a small decoder-only transformer at every (batch, length) pair; outputs equal
    eager's, no eager fallback. Returns Dynamo's graph count and the client's counters."""
    from kiln.frontend.config import KilnConfig
    from kiln.frontend.core import compile as kiln_compile
    from kiln.frontend.core.client import client_for
    from kiln.frontend.core.fallback import KilnFallbackWarning
    from tests.models import Decoder

    torch.manual_seed(seed)
    model = Decoder().eval()
    asked: list[str] = []
    keys: list[dict[str, str]] = []
    original = kiln_compile.compile_and_load

    def counting(*args: Any, **kwargs: Any) -> Any:
        asked.append(args[-1])
        return original(*args, **kwargs)

    kiln_compile.compile_and_load = counting
    kiln_compile.observers.append(lambda name, result: keys.append(result.key.parts))
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="kiln", options=options)
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", KilnFallbackWarning)
            for b in batches:
                for s in lengths:
                    ids = torch.randint(0, 97, (b, s), generator=g)
                    torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-4,
                                               atol=1e-4, msg=lambda m, b=b, s=s: f"{b}x{s}: {m}")
    finally:
        kiln_compile.compile_and_load = original
        kiln_compile.observers.pop()
    counters = client_for(KilnConfig.resolve(options)).counters.snapshot()
    return {"asked": len(asked), "counters": counters, "keys": keys}


if __name__ == "__main__":  # the second process of the model test: prints its counts
    import json
    import sys

    print(json.dumps(run_decoder(json.loads(sys.argv[1]))))


class _ConvNet(torch.nn.Module):
    """Convolution, BatchNorm (eval), max pooling, a strided convolution, adaptive average
    pooling and a linear head: the sizes after pooling and striding are floors of floors
    of the input's symbolic height and width."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.c2 = torch.nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.max_pool2d(torch.relu(self.bn(self.c1(x))), 2)
        x = torch.relu(self.c2(x))
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(x, 1).flatten(1))


def check_conv_net(options: dict[str, Any]) -> None:
    """``dynamic=True`` on a conv net: batch, height and width symbolic. Before, the
    strided convolution's input stride ``Max(floor(...), 1)`` sent sympy into endless
    recursion and its copy was looked up as a view of itself forever: the graph ran
    eagerly with a KilnFallbackWarning."""
    import warnings

    from kiln.frontend.core import compile as kiln_compile
    from kiln.frontend.core.fallback import KilnFallbackWarning

    torch.manual_seed(0)
    model = _ConvNet().eval()
    with torch.no_grad():  # BatchNorm's statistics: not the defaults
        model.bn.running_mean.uniform_(-0.5, 0.5)
        model.bn.running_var.uniform_(0.5, 1.5)
    seen: list[Any] = []
    kiln_compile.observers.append(lambda name, result: seen.append(result))
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="kiln", dynamic=True, options=options)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("error", KilnFallbackWarning)
            for batch, side in [(2, 32), (3, 40), (5, 24)]:
                x = torch.randn(batch, 3, side, side)
                torch.testing.assert_close(compiled(x), model(x), rtol=1e-4, atol=1e-4)
    finally:
        kiln_compile.observers.pop()
    (result,) = seen  # one graph for the three sizes
    assert len(result.compiled.stats["dynamic"]["symbols"]) >= 2
    assert not result.compiled.stats.get("fallback_ops"), result.compiled.stats


def _pools(x: torch.Tensor) -> torch.Tensor:
    x = torch.nn.functional.max_pool2d(x, 3, stride=2, padding=1)
    return torch.nn.functional.avg_pool2d(x, 2, padding=1, count_include_pad=False) * 3


def check_pools(options: dict[str, Any]) -> None:
    """Max pooling (3x3, stride 2, padding 1, as ResNet's stem) and average pooling
    (padding excluded from the divisor), forward and backward, one graph each for odd and
    even heights and widths: windows over symbolic extents are unrolled (their last taps
    masked where they can leave the input), not run by ATen's kernel."""
    import warnings

    from kiln.frontend.core import compile as kiln_compile
    from kiln.frontend.core.fallback import KilnFallbackWarning

    torch.manual_seed(0)
    seen: list[Any] = []
    kiln_compile.observers.append(lambda name, result: seen.append(result))
    try:
        torch._dynamo.reset()
        compiled = torch.compile(_pools, backend="kiln", dynamic=True, options=options)
        with warnings.catch_warnings():
            warnings.simplefilter("error", KilnFallbackWarning)
            for batch, h, w in [(2, 17, 20), (3, 24, 13), (4, 9, 31)]:
                x = torch.randn(batch, 3, h, w, requires_grad=True)
                ref_x = x.detach().clone().requires_grad_()
                out, ref = compiled(x), _pools(ref_x)
                torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
                grad = torch.randn_like(ref)
                out.backward(grad)
                ref.backward(grad)
                torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-5)
    finally:
        kiln_compile.observers.pop()
    assert len(seen) == 2  # one forward, one backward, for every size
    for result in seen:
        assert result.compiled.stats["dynamic"]["symbols"], result.compiled.name
        assert not result.compiled.stats.get("fallback_ops"), result.compiled.stats
