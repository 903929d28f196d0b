"""Golden output code of the C++ backend: the wrapper and kernel sources for a few small
graphs, asserted line by line, so that a change in what codegen emits shows up as a diff.

After an intended change, print the new code (``KILN_LOGS=output_code``), review it, and
paste it here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kiln.compiler.compiled_graph import CompiledGraph, load
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph


def seed(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    return ((a + b) * c.relu()).sum(dim=-1)


def softmax(x: torch.Tensor) -> torch.Tensor:
    return torch.softmax(x, -1)


SEED_WRAPPER = """\
def call(args):
    arg0_1, arg1_1, arg2_1, = args
    args.clear()
    buf0 = empty_strided((64,), (1,), device=DEVICE, dtype=torch.float32)
    cpp_fused_add_mul_relu_sum_0.run(arg0_1, arg1_1, arg2_1, buf0)
    del arg0_1
    del arg1_1
    del arg2_1
    return (buf0, )
"""

SEED_KERNEL = """\
#include "kiln_prelude.h"

extern "C" void cpp_fused_add_mul_relu_sum_0(
    const float* in_ptr0,
    const float* in_ptr1,
    const float* in_ptr2,
    float* out_ptr0)
{
    for (int64_t x0 = 0; x0 < 64; ++x0)
    {
        float acc0_1_v[16];
        for (int64_t l = 0; l < 16; ++l) acc0_1_v[l] = 0.0f;
        for (int64_t rb = 0; rb < 128; rb += 16)
        {
            #pragma omp simd
            for (int64_t rl = 0; rl < 16; ++rl)
            {
                const int64_t r0 = rb + rl;
                const float tmp0 = in_ptr0[128*x0 + r0];
                const float tmp1 = in_ptr1[128*x0 + r0];
                const float tmp2 = (tmp0 + tmp1);
                const float tmp3 = in_ptr2[128*x0 + r0];
                const float tmp4 = (tmp3 < 0 ? (float)0 : tmp3);
                const float tmp5 = (tmp2 * tmp4);
                acc0_1_v[rl] = acc0_1_v[rl] + tmp5;
            }
        }
        float tmp6 = acc0_1_v[0];
        for (int64_t l = 1; l < 16; ++l) tmp6 = tmp6 + acc0_1_v[l];
        out_ptr0[x0] = tmp6;
    }
}
"""

SOFTMAX_KERNEL = """\
#include "kiln_prelude.h"

extern "C" void cpp_fused_exp_max_sub_sum_truediv_0(
    const float* in_ptr0,
    float* out_ptr0)
{
    for (int64_t x0 = 0; x0 < 32; ++x0)
    {
        float acc0_1_v[16];
        for (int64_t l = 0; l < 16; ++l) acc0_1_v[l] = (-__builtin_inff());
        for (int64_t rb = 0; rb < 96; rb += 16)
        {
            #pragma omp simd
            for (int64_t rl = 0; rl < 16; ++rl)
            {
                const int64_t r0 = rb + rl;
                const float tmp0 = in_ptr0[100*x0 + r0];
                acc0_1_v[rl] = kiln_maximum<float>(acc0_1_v[rl], tmp0);
            }
        }
        {
            #pragma omp simd
            for (int64_t rl = 0; rl < 4; ++rl)
            {
                const int64_t r0 = 96 + rl;
                const float tmp0 = in_ptr0[100*x0 + r0];
                acc0_1_v[rl] = kiln_maximum<float>(acc0_1_v[rl], tmp0);
            }
        }
        float tmp1 = acc0_1_v[0];
        for (int64_t l = 1; l < 16; ++l) tmp1 = kiln_maximum<float>(tmp1, acc0_1_v[l]);
        float row_tmp4[100];
        float acc0_2_v[16];
        for (int64_t l = 0; l < 16; ++l) acc0_2_v[l] = 0.0f;
        for (int64_t rb = 0; rb < 96; rb += 16)
        {
            #pragma omp simd
            for (int64_t rl = 0; rl < 16; ++rl)
            {
                const int64_t r0 = rb + rl;
                const float tmp2 = in_ptr0[100*x0 + r0];
                const float tmp3 = (tmp2 - tmp1);
                const float tmp4 = expf(tmp3);
                acc0_2_v[rl] = acc0_2_v[rl] + tmp4;
                row_tmp4[r0] = tmp4;
            }
        }
        {
            #pragma omp simd
            for (int64_t rl = 0; rl < 4; ++rl)
            {
                const int64_t r0 = 96 + rl;
                const float tmp2 = in_ptr0[100*x0 + r0];
                const float tmp3 = (tmp2 - tmp1);
                const float tmp4 = expf(tmp3);
                acc0_2_v[rl] = acc0_2_v[rl] + tmp4;
                row_tmp4[r0] = tmp4;
            }
        }
        float tmp5 = acc0_2_v[0];
        for (int64_t l = 1; l < 16; ++l) tmp5 = tmp5 + acc0_2_v[l];
        #pragma omp simd
        for (int64_t r0 = 0; r0 < 100; ++r0)
        {
            const float tmp8 = row_tmp4[r0];
            const float tmp9 = (tmp8 / tmp5);
            out_ptr0[100*x0 + r0] = tmp9;
        }
    }
}
"""


def codegen(fn: Callable[..., Any], *shapes: tuple[int, ...]) -> CompiledGraph:
    args = [torch.randn(*s) for s in shapes]
    return compile_graph(trace_aten(fn, args), args, {"cpu_backend": "cpp"},
                         compile_kernels=False)


def assert_same_lines(actual: str, expected: str) -> None:
    """Equal, line by line (a failure shows the first line that differs)."""
    got, want = actual.splitlines(), expected.splitlines()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"line {i + 1}: {g!r} != {w!r}"
    assert len(got) == len(want), f"{len(got)} lines, expected {len(want)}"


def test_seed_is_one_kernel_one_buffer_freed_at_last_use() -> None:
    compiled = codegen(seed, (64, 128), (64, 128), (64, 128))
    assert compiled.stats["kernels"] == 1 and compiled.stats["buffers"] == 1
    assert compiled.wrapper_source.startswith(
        "# Kiln wrapper for graph graph: 1 kernel(s), 1 buffer(s)\n")
    call = compiled.wrapper_source[compiled.wrapper_source.index("def call"):]
    assert_same_lines(call, SEED_WRAPPER)


def test_seed_kernel_source() -> None:
    (kernel,) = codegen(seed, (64, 128), (64, 128), (64, 128)).kernels
    assert kernel.name == "cpp_fused_add_mul_relu_sum_0"
    assert kernel.backend == "cpp" and kernel.kind == "reduction"
    assert kernel.arg_buffers == ("arg0_1", "arg1_1", "arg2_1", "buf0")
    assert kernel.source.count('extern "C"') == 1
    assert "#pragma omp simd" in kernel.source
    assert_same_lines(kernel.source, SEED_KERNEL)


def test_seed_kernel_runs() -> None:
    args = [torch.randn(64, 128) for _ in range(3)]
    compiled = compile_graph(trace_aten(seed, args), args, {"cpu_backend": "cpp"})
    (out,) = load(compiled)(list(args))
    torch.testing.assert_close(out, seed(*args), rtol=1e-5, atol=1e-5)


def test_large_seed_runs_rows_across_threads() -> None:
    (kernel,) = codegen(seed, (8192, 4096), (8192, 4096), (8192, 4096)).kernels
    lines = [line.strip() for line in kernel.source.splitlines()]
    parallel = lines.index("#pragma omp parallel for schedule(static)")
    assert lines[parallel + 1] == "for (int64_t x0 = 0; x0 < 8192; ++x0)"
    assert "for (int64_t rb = 0; rb < 4096; rb += 16)" in lines
    simd = lines.index("#pragma omp simd")
    assert lines[simd + 1] == "for (int64_t rl = 0; rl < 16; ++rl)"
    assert kernel.source.count('extern "C"') == 1 and "native" not in kernel.source


def test_softmax_keeps_exp_in_a_row_buffer() -> None:
    (kernel,) = codegen(softmax, (32, 100)).kernels
    assert kernel.name == "cpp_fused_exp_max_sub_sum_truediv_0"
    assert kernel.source.count("expf(") == 2  # main blocks and tail of one phase only
    assert_same_lines(kernel.source, SOFTMAX_KERNEL)


def test_column_sum_walks_rows_with_a_lane_per_column() -> None:
    (kernel,) = codegen(lambda x: x.sum(0), (8192, 4096)).kernels
    lines = [line.strip() for line in kernel.source.splitlines()]
    assert "for (int64_t xb = 0; xb < 4096; xb += 4096)" in lines
    assert "#pragma omp parallel" in lines  # one block: the rows are split across threads
    assert "for (int64_t rc = 0; rc < 8192; rc += 64)" in lines
    simd = lines.index("#pragma omp simd")
    assert lines[simd + 1] == "for (int64_t xl = 0; xl < xn; ++xl)"
    assert "const float tmp0 = in_ptr0[4096*r0 + x0];" in lines
    assert "#pragma omp ordered" in lines  # partial sums merged in thread order
