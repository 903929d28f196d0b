"""Dynamic shapes on a GPU: a decoder-only transformer (fp16) with a dynamic sequence
length compiles once and matches eager at every length, short rows and long; a training
step with a dynamic batch (the backward takes SymInt inputs)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from tests.models import Decoder, mlp


def _graphs() -> list[Any]:
    from kiln.frontend.core import compile as kiln_compile

    seen: list[Any] = []
    kiln_compile.observers.append(lambda name, result: seen.append(result))
    return seen


@pytest.mark.gpu
def test_decoder_dynamic_length_one_compile_on_gpu() -> None:
    from kiln.frontend.core import compile as kiln_compile
    from kiln.frontend.core.fallback import KilnFallbackWarning

    torch.manual_seed(0)
    model = Decoder(d=64, heads=4, layers=2).cuda().half().eval()
    seen = _graphs()
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="kiln")
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", KilnFallbackWarning)
            for k, n in enumerate((128, 37, 1024, 2048, 3001)):
                ids = torch.randint(0, 97, (2, n), device="cuda")
                if k == 0:
                    torch._dynamo.mark_dynamic(ids, 1)
                torch.testing.assert_close(compiled(ids), model(ids), rtol=2e-2, atol=2e-2)
    finally:
        kiln_compile.observers.pop()
    assert len(seen) == 1, [r.source for r in seen]
    assert seen[0].compiled.stats["dynamic"]["symbols"]


@pytest.mark.gpu
def test_training_step_with_dynamic_batch_on_gpu() -> None:
    from kiln.frontend.core.fallback import KilnFallbackWarning

    torch.manual_seed(0)
    model = mlp().cuda()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="kiln")
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        for k, n in enumerate((64, 33, 200)):
            x = torch.randn(n, 32, device="cuda")
            if k == 0:
                torch._dynamo.mark_dynamic(x, 0)
            compiled(x).square().mean().backward()
            got = [p.grad.clone() for p in model.parameters()]
            model.zero_grad()
            model(x).square().mean().backward()
            for g, p in zip(got, model.parameters()):
                torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-4)
            model.zero_grad()


@pytest.mark.gpu
def test_decoder_buckets_tuned_in_process_then_reloaded_on_gpu(kiln_isolated: None) -> None:
    """Each sequence-length bucket is tuned in the background when first seen; the
    running graph switches to the tuned kernels (one compile, outputs equal eager before
    and after), the artifact records a config and a cubin per bucket, and a new client
    loads them and launches each bucket's own config."""
    from kiln.compiler.runtime.buckets import BucketedLauncher
    from kiln.frontend.config import KilnConfig
    from kiln.frontend.core.client import client_for, reset_clients, wait_for_background
    from kiln.frontend.core.fallback import KilnFallbackWarning
    from kiln.frontend.core.hotswap import SwappableGraph

    torch.manual_seed(0)
    model = Decoder(d=64, heads=4, layers=2).cuda().half().eval()
    lengths = (128, 512, 2048)
    ids = {n: torch.randint(0, 97, (2, n), device="cuda") for n in lengths}
    import gc

    # Graphs of earlier tests in this process may share the key: only this test's count.
    earlier = [o for o in gc.get_objects() if type(o) is SwappableGraph]

    def mine(o: object) -> bool:
        return type(o) is SwappableGraph and o.key.key == key \
            and all(o is not e for e in earlier)

    seen = _graphs()  # kiln_isolated: a fresh store, so the first compile is a miss
    compiled = torch.compile(model, backend="kiln")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", KilnFallbackWarning)
        for k, n in enumerate(lengths):
            if k == 0:
                torch._dynamo.mark_dynamic(ids[n], 1)
            torch.testing.assert_close(compiled(ids[n]), model(ids[n]), rtol=2e-2, atol=2e-2)
        assert wait_for_background(600)
        for n in lengths:  # the switched graph
            torch.testing.assert_close(compiled(ids[n]), model(ids[n]), rtol=2e-2, atol=2e-2)
    counters = client_for(KilnConfig.resolve()).counters.snapshot()
    assert counters.get("compiles") == 1, counters
    assert counters.get("hot_swaps", 0) >= 1 and counters.get("bucket_tunes", 0) >= 3, counters
    # Called with no AOTAutograd runtime wrapper, as a static inference graph is.
    assert counters.get("inference_direct") == 1, counters
    from kiln.frontend.core import compile as kiln_compile

    kiln_compile.observers.pop()
    key = seen[0].key.key
    (graph,) = [o for o in gc.get_objects() if mine(o)]
    tuned = graph.compiled
    assert tuned.buckets and all(tuned.bucket_binaries.get(k) for k in tuned.buckets)
    reset_clients()
    torch._dynamo.reset()
    again = torch.compile(model, backend="kiln")
    with torch.no_grad():
        for k, n in enumerate(lengths):
            x = ids[n].clone()
            if k == 0:
                torch._dynamo.mark_dynamic(x, 1)
            torch.testing.assert_close(again(x), model(x), rtol=2e-2, atol=2e-2)
    counters = client_for(KilnConfig.resolve()).counters.snapshot()
    assert counters.get("hits") == 1 and not counters.get("bucket_tunes"), counters
    (loaded,) = [o for o in gc.get_objects() if mine(o) and o is not graph]
    bucketed = [v for v in loaded.call.__globals__.values() if isinstance(v, BucketedLauncher)]
    assert bucketed and any(len(b.by_bucket) >= 3 for b in bucketed)
    # Through torch's static launcher (no Triton launcher in Python), chosen once per size.
    from kiln.compiler.runtime.static_launcher import StaticCudaKernel

    assert all(isinstance(b.default, StaticCudaKernel) for b in bucketed)
    assert all(isinstance(x, StaticCudaKernel) for b in bucketed for x in b.by_bucket.values())
    assert {run.__name__ for b in bucketed for run in b.chosen.values()} == {"run_dynamic"}
