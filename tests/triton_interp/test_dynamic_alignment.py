"""Both variants of a kernel with dynamic sizes against eager under Triton's interpreter:
the ``ALIGN`` one (compiled with its symbolic size arguments divisible by 16) runs only
the launches whose sizes are multiples of 16; 1, 2, primes and a large odd size take the
generic variant. Generated code and PTX: tests/unit/test_dynamic_alignment.py."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from kiln.compiler.compiled_graph import load
from kiln.compiler.kernel_compile import ALIGN_KEY
from kiln.compiler.runtime.buckets import BucketedLauncher, bucket_index

OPTIONS: dict[str, Any] = {"cpu_backend": "triton-interpret"}


@pytest.fixture(autouse=True)
def _isolated(kiln_isolated: None) -> None:
    """Every test: a fresh store, in process (tests/conftest.py)."""


def _fn(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x * 0.5, -1) + x.amax(-1, keepdim=True)


def test_softmax_variants_match_eager_and_follow_alignment() -> None:
    from kiln import KilnFallbackWarning
    from kiln.frontend.core import compile as kiln_compile

    seen: list[Any] = []
    kiln_compile.observers.append(lambda name, result: seen.append(result))
    g = torch.Generator().manual_seed(11)
    try:
        torch._dynamo.reset()
        compiled = torch.compile(_fn, backend="kiln", options=OPTIONS)
        with warnings.catch_warnings():
            warnings.simplefilter("error", KilnFallbackWarning)
            for k, n in enumerate((2, 1, 7, 16, 1031, 2048)):
                x = torch.randn(3, n, generator=g)
                if k == 0:
                    torch._dynamo.mark_dynamic(x, 1)
                torch.testing.assert_close(compiled(x), _fn(x), rtol=1e-5, atol=1e-5)
    finally:
        kiln_compile.observers.pop()
    (graph,) = [r.compiled for r in seen if r.compiled.stats.get("dynamic")]
    assert all(k.configs[0].get(ALIGN_KEY) == 16 for k in graph.kernels), graph.kernels
    call = load(graph, device=torch.device("cpu"))
    by_bound = {k.configs[0]["RBLOCK"]: call.__globals__[k.name] for k in graph.kernels
                if k.kind == "persistent_reduction"}
    assert all(isinstance(v, BucketedLauncher) for v in by_bound.values())
    # Which variant ran: a launcher keeps the generic variant of each size bucket that
    # needed it (aligned sizes first: 16 and 13 share a bucket, as 1040, 2048 and 1031).
    for n, bound, generic in ((16, 256, False), (7, 256, True), (13, 256, True),
                              (32, 256, False), (1040, 2048, False), (2048, 2048, False),
                              (1031, 2048, True)):
        x = torch.randn(3, n, generator=g)
        (out,) = call([n, x.clone()])
        torch.testing.assert_close(out, _fn(x), rtol=1e-5, atol=1e-5)
        ran_generic = bucket_index(3, n) in by_bound[bound].unaligned
        assert ran_generic == generic, (n, by_bound[bound].unaligned)
