"""Kernels with dynamic sizes compile an ``ALIGN`` variant (every symbolic size argument
divisible by 16, so Triton vectorizes their loads like a static kernel's) and launch it
only where that holds; any other launch runs the generic variant.

Generated on this CPU machine from fake CUDA tensors (a graph request with a symbolic
sequence length, as the farm compiles it) and cross-compiled for sm_90: the attention
softmax of the decoder at 2048 tokens, whose dynamic kernel ran 3.6x slower than the
static one on the H200 with scalar 16-bit loads. Numerics of both variants under Triton's
interpreter: tests/triton_interp/test_dynamic_alignment.py."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import pytest
import torch

from kiln.compiler.codegen.kernel_spec import KernelSpec
from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.kernel_compile import (
    ALIGN_KEY,
    divisible_args,
    symbolic_positions,
    triton_compiled,
)
from kiln.compiler.runtime.buckets import BucketedLauncher, aligned_sizes, generic_config
from kiln.compiler.runtime.kernel_files import interpreter_active
from kiln.workers.buckets import bucket_candidates
from tests.targets import SM90

pytestmark = pytest.mark.skipif(interpreter_active(),
                                reason="Triton was imported for its interpreter")


def _masked_softmax(att: torch.Tensor) -> torch.Tensor:
    s = att.shape[-1]
    pos = torch.arange(s, device=att.device)
    causal = pos[:, None] >= pos[None, :]
    return torch.softmax((att * 0.125).masked_fill(~causal, float("-inf")), dim=-1)


def _compile(dynamic: bool) -> CompiledGraph:
    """The decoder's attention softmax (2 x 4 heads, fp16) compiled for CUDA from the
    request Kiln's backend builds, sequence length symbolic or 2048."""
    from torch._dynamo.backends.common import aot_autograd

    from kiln.compiler.decompositions import kiln_decompositions
    from kiln.frontend.core.serialize import make_request
    from kiln.workers.pipeline import compile_sources

    requests: list[Any] = []

    def capture(gm: torch.fx.GraphModule, inputs: Any) -> Any:
        requests.append(make_request(gm, inputs, options={}, target=SM90))
        return gm.forward

    torch._dynamo.reset()
    x = torch.randn(2, 4, 2048, 2048, dtype=torch.half)
    if dynamic:
        torch._dynamo.mark_dynamic(x, 2)
        torch._dynamo.mark_dynamic(x, 3)
    backend = aot_autograd(fw_compiler=capture, decompositions=kiln_decompositions())
    with torch.no_grad():
        torch.compile(_masked_softmax, backend=backend)(x)
    torch._dynamo.reset()
    (request,) = requests
    # Traced on the CPU; the graph as the GPU would send it.
    inputs = tuple(dataclasses.replace(m, device_type="cuda") if hasattr(m, "device_type")
                   else m for m in request.inputs)
    request = dataclasses.replace(request, inputs=inputs)
    return compile_sources(request.to_bytes(), "dynamic" if dynamic else "static")


@pytest.fixture(scope="module")
def graphs() -> dict[str, CompiledGraph]:
    return {"dynamic": _compile(True), "static": _compile(False)}


def _loads(spec: KernelSpec, config: dict[str, Any]) -> set[str]:
    ptx = triton_compiled(spec, config, SM90).asm["ptx"]
    return set(re.findall(r"(?:ld|st)\.global[.\w]*", ptx))


def test_dynamic_softmax_configs_and_divisible_args(graphs: dict[str, CompiledGraph]) -> None:
    kernels = graphs["dynamic"].kernels
    # The looped reduction and a persistent one per row bound (a power-of-two row
    # fills its block).
    assert sorted(k.kind for k in kernels) == ["persistent_reduction"] * 5 + ["reduction"]
    rblocks = sorted(k.configs[0]["RBLOCK"] for k in kernels
                     if k.kind == "persistent_reduction")
    assert rblocks == [256, 512, 1024, 2048, 4096], rblocks
    for spec in kernels:
        assert spec.size_args == ("8*s0", "s0", "s0"), spec.size_args
        assert all(c.get(ALIGN_KEY) == 16 for c in spec.configs), spec.configs
        names = list(spec.signature)
        assert [names[i] for i in symbolic_positions(spec)] == ["xnumel", "rnumel", "s0"]
        aligned = [names[i] for i in divisible_args(spec, spec.configs[0])]
        generic = [names[i] for i in divisible_args(spec, generic_config(spec.configs[0])
                                                    or {})]
        assert aligned == ["in_ptr0", "out_ptr0", "xnumel", "rnumel", "s0"], aligned
        assert generic == ["in_ptr0", "out_ptr0"], generic
    wrapper = graphs["dynamic"].wrapper_source
    assert "if s0 <= 256:" in wrapper and "elif s0 <= 2048:" in wrapper, wrapper
    for spec in graphs["static"].kernels:  # no size arguments, nothing to align
        assert not spec.size_args and all(ALIGN_KEY not in c for c in spec.configs)


def test_aligned_variant_loads_are_vectorized_like_static(
        graphs: dict[str, CompiledGraph]) -> None:
    (static,) = graphs["static"].kernels
    assert static.kind == "persistent_reduction" and static.configs[0]["RBLOCK"] == 2048
    assert _loads(static, static.configs[0]) == {"ld.global.v4.b32", "st.global.v4.b32"}
    (at_2048,) = [k for k in graphs["dynamic"].kernels if k.configs[0]["RBLOCK"] == 2048
                  and k.kind == "persistent_reduction"]
    config = at_2048.configs[0]
    # 8 halves a load, as static; the generic variant loads and stores one half at a time.
    assert _loads(at_2048, config) == {"ld.global.v4.b32", "st.global.v4.b32"}
    plain = generic_config(config)
    assert plain is not None
    assert _loads(at_2048, plain) == {"ld.global.b16", "st.global.b16"}
    # Each variant is a kernel job of its own (the config is part of its key).
    from kiln.workers.pipeline import KernelJob

    assert KernelJob(at_2048, config, SM90).key != KernelJob(at_2048, plain, SM90).key
    # A loaded graph compiles the generic variant on first need, for its binary's target.
    from kiln.compiler.compiled_graph import _compile_generic
    from kiln.compiler.kernel_compile import KernelBinary

    aligned = KernelBinary(at_2048.name, dict(SM90), dict(config), b"cubin")
    generic = _compile_generic(at_2048, plain, aligned)
    assert generic is not None and generic.config == plain and generic.target == SM90
    assert generic.binary and generic.metadata["binary_ext"] == "cubin"
    assert _compile_generic(at_2048, plain, None) is None  # no binary: Triton's JIT


SPEC = KernelSpec(name="triton_red_fused_sum_0", backend="triton", kind="reduction",
                  source="@triton.jit\ndef KERNEL_NAME(in_ptr0, out_ptr0, xnumel, rnumel, "
                  "s0, XBLOCK, RBLOCK): pass", arg_buffers=("arg1_1", "buf0"),
                  signature={"in_ptr0": "*fp16", "out_ptr0": "*fp16", "xnumel": "i64",
                             "rnumel": "i64", "s0": "i64", "XBLOCK": "constexpr",
                             "RBLOCK": "constexpr"},
                  xnumel=8192, rnumel=8192, size_args=("3*s0", "s0", "s0"),
                  configs=({"XBLOCK": 1, "RBLOCK": 1024, "num_warps": 4, "num_stages": 1,
                            ALIGN_KEY: 16},
                           {"XBLOCK": 1, "RBLOCK": 2048, "num_warps": 8, "num_stages": 1,
                            ALIGN_KEY: 16}))


class _Launcher:
    def __init__(self, name: str, ran: list[str]) -> None:
        self.name, self.ran = name, ran

    def run(self, *args: Any) -> None:
        self.ran.append(self.name)


def test_launcher_runs_aligned_variants_only_on_aligned_sizes() -> None:
    ran: list[str] = []
    built: list[str | None] = []

    def generic(bucket: str | None) -> Any:
        built.append(bucket)
        return None if bucket == "2048x1024" else _Launcher(f"generic {bucket}", ran)

    launcher = BucketedLauncher(SPEC, _Launcher("heuristic", ran),
                                {"4096x1024": _Launcher("tuned", ran),
                                 "2048x1024": _Launcher("tuned plain", ran)},
                                None, generic)
    x = torch.empty(2, 8)
    for n in (1024, 1021, 1008, 1021, 17, 544, 530):
        launcher.run(x, x, 3 * n, n, n)
    assert ran == ["tuned", "generic 4096x1024", "tuned", "generic 4096x1024",
                   "generic None", "tuned plain", "tuned plain"], ran
    assert built == ["4096x1024", None, "2048x1024"]  # each variant built once


def test_bucket_candidates_follow_the_sizes_seen() -> None:
    assert bucket_candidates(SPEC, [3 * 1024, 1024, 1024]) == list(SPEC.configs)
    assert aligned_sizes(SPEC, [3 * 16, 16, 16]) and not aligned_sizes(SPEC, [21, 7, 7])
    plain = bucket_candidates(SPEC, [21, 7, 7])
    assert plain == [generic_config(c) for c in SPEC.configs]
    assert all(ALIGN_KEY not in c for c in plain)
