"""A kernel that reads back a buffer it wrote must get what it wrote.

Triton gives each ``tl.store`` and ``tl.load`` its own thread layout: a strided store goes
one element per thread, a load whose value feeds a contiguous store eight per thread, so
the thread loading an element is often not the one that stored it and nothing orders the
two. On the H200 (2026-12-04 18:44, Triton 3.6) ResNet-50's training forward had ~8000 of
6.4M stale values, a few NaN, in the contiguous copy of the max-pool output that the
backward saves: the max-pool kernel stored its channels-last output and loaded it back,
at the same address printed another way (``64*(x % 3136)`` against
``3584*((x // 56) % 56) + 64*(x % 56)``), in another layout. Triton's interpreter, which
runs one program's lanes together, cannot show it.

Now a load at an address proven equal to a stored one takes the stored value
(``sym.same_index``), and any other load of a buffer the kernel wrote follows a
``tl.debug_barrier()`` (a looped reduction's later phase reloading what an earlier loop
stored). Kernels are generated here from fake CUDA tensors and compiled for sm_90."""

from __future__ import annotations

import re
from typing import Any

import pytest
import sympy
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.ir.sym import FloorDiv, ModularIndexing, same_index
from kiln.compiler.kernel_compile import compile_kernel
from kiln.compiler.runtime.kernel_files import interpreter_active
from tests.targets import SM90
from tests.unit.test_loop_phase_forwarding import _looped_kernel

X = sympy.Symbol("xindex", integer=True, nonnegative=True)
R = sympy.Symbol("rindex", integer=True, nonnegative=True)
C = ModularIndexing(X, 3136, 64)
N = 200704 * FloorDiv(X, 200704)


@pytest.mark.parametrize(("a", "b", "same"), [
    # the H200's pair: a channels-last store and its load through merged loops
    (C + N + 3584 * ModularIndexing(X, 56, 56) + 64 * ModularIndexing(X, 1, 56),
     C + N + 64 * ModularIndexing(X, 1, 3136), True),
    (C + N + 3584 * ModularIndexing(X, 56, 56) + 64 * ModularIndexing(X, 1, 56),
     C + N + 64 * ModularIndexing(X, 1, 3136) + 1, False),
    (C + N + 3584 * ModularIndexing(X, 56, 56) + 64 * ModularIndexing(X, 1, 56),
     C + N + 3584 * ModularIndexing(X, 56, 56) + 64 * ModularIndexing(X, 1, 57), False),
    (X, 56 * FloorDiv(X, 56) + ModularIndexing(X, 1, 56), True),
    (X + 64 * R, 64 * R + X, True),
    (FloorDiv(X, 3), FloorDiv(X, 4), False),                   # boundaries that do not nest
    (ModularIndexing(X, 1, 8), ModularIndexing(X, 1, 16), False),
    (FloorDiv(X + 1, 4), FloorDiv(X + 1, 4), True),             # identical: no proof needed
    (FloorDiv(X + 1, 4), FloorDiv(X, 4), False),                # a compound base: not proven
])
def test_same_index(a: Any, b: Any, same: bool) -> None:
    assert same_index(a, b) is same
    assert same_index(b, a) is same


def unordered_reloads(source: str) -> list[str]:
    """Loads of a pointer this kernel stored to earlier with no barrier in between."""
    written: set[str] = set()
    bad = []
    for line in source.splitlines():
        line = line.strip()
        if line == "tl.debug_barrier()":
            written.clear()
        for ptr in re.findall(r"tl\.load\((\w+) \+", line):
            if ptr in written:
                bad.append(line)
        written.update(re.findall(r"tl\.(?:store|atomic_\w+)\((\w+) \+", line))
    return bad


def stem_saving_pool(x: torch.Tensor, w: torch.Tensor, mean: torch.Tensor,
                     var: torch.Tensor, g: torch.Tensor, b: torch.Tensor,
                     w1: torch.Tensor) -> Any:
    """ResNet-50's stem as its training forward has it: the max pool's output goes on
    channels-last to the next convolution, and a contiguous copy and the indices are
    saved for the backward, as is the pool's input (which gives the kernel of region 0
    on the H200, ``..._maximum_3``, and lets a test pool it eagerly)."""
    y = F.batch_norm(F.conv2d(x, w, None, 2, 3), mean, var, g, b, False, 0.1, 1e-5).relu()
    pooled, indices = F.max_pool2d(y, 3, 2, 1, return_indices=True)
    return F.conv2d(pooled, w1, None, 1, 1), pooled.contiguous(), indices, y


def stem_args(batch: int, device: str) -> list[torch.Tensor]:
    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=torch.float16)

    return [t(batch, 3, 224, 224), t(64, 3, 7, 7) * 0.1, t(64), t(64).abs() + 0.5,
            t(64), t(64), t(64, 64, 3, 3) * 0.05]


def _compile_stem() -> CompiledGraph:
    with FakeTensorMode():
        args = stem_args(32, "cuda")
    return compile_graph(trace_aten(stem_saving_pool, args), args, {},
                         compile_kernels=False)


def test_the_saved_pool_copy_takes_the_stored_value() -> None:
    compiled = _compile_stem()
    pool = next(k for k in compiled.kernels if "maximum" in k.name or "isnan" in k.name)
    stored = re.findall(r"tl\.store\((\w+) \+", pool.source)
    # channels-last values, their contiguous copy and the indices: three stores ...
    assert len(stored) == 3, pool.source
    # ... and not one load of what the kernel wrote (the copy reused the value)
    loaded = re.findall(r"tl\.load\((\w+) \+", pool.source)
    assert not set(stored) & set(loaded), pool.source
    assert "debug_barrier" not in pool.source
    for kernel in compiled.kernels:
        assert unordered_reloads(kernel.source) == [], kernel.source


def test_a_later_phase_reload_follows_one_barrier_before_its_loop() -> None:
    source, _ = _looped_kernel()
    assert unordered_reloads(source) == []
    first, second = source.split("for roffset")[1:]
    # one barrier, between the loops: not one per r block
    assert source.count("tl.debug_barrier()") == 1
    assert first.rstrip().endswith("tl.debug_barrier()"), first
    assert "debug_barrier" not in second


@pytest.mark.skipif(interpreter_active(), reason="Triton was imported for its interpreter")
def test_both_kernels_compile_for_sm90() -> None:
    pool = next(k for k in _compile_stem().kernels if "isnan" in k.name)
    _, looped = _looped_kernel()
    for spec in (pool, looped):
        binary = compile_kernel(spec, dict(spec.configs[0]), SM90)  # type: ignore[union-attr]
        assert binary.binary[:4] == b"\x7fELF"
