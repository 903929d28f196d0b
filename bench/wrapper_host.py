"""Host time of a GPU graph's wrapper per call, on a machine with no GPU: Kiln's own Python
between Dynamo's call and the kernels, static against dynamic shapes.

    python3 bench/wrapper_host.py [--lengths 128,512,2048] [--calls 2000] [--layers 4]
                                  [--profile]
    python3 bench/wrapper_host.py --encoder-step [--calls 2000] [--layers 4] [--profile]

The decoder of ``tests.models`` (d=1024, 16 heads, fp16, batch 4, as
``bench/decoder_profile.py``) is traced on fake CUDA tensors, static at each length and
once with ``dynamic=True``, and compiled for sm_90 (sources only). Each wrapper then runs
as ``compiled_graph.load`` binds it on a GPU, with what needs a GPU stood in for:

- every Triton kernel goes through Kiln's real launcher objects (``StaticCudaKernel``;
  ``BucketedLauncher`` for the dynamic kernels: the bucket and ALIGN variant choice) down
  to torch's static launcher, replaced by a no-op ``_launch_kernel`` (the C call of a
  real launch, about 5 µs on the H200 host, is the same for both and not counted here);
- buffers and views are meta tensors (torch's dispatch with no computation); a library
  call (``torch.addmm``, ``torch.bmm``) is an empty meta tensor of its output's shape
  (torch's meta kernels for them are Python decompositions, slower than the CUDA call).

``--encoder-step``: the forward and backward wrappers of ``gpu_bench``'s encoder training
step instead (``compile_encoder_step`` says how they are made without a GPU): CPU µs per
step of the two, Triton launches and buffers per step.

Columns: CPU µs per call (this thread's CPU time, the best of 10 blocks, static and
dynamic interleaved), Triton launches per call, and dynamic/static.
A dynamic wrapper whose host time is close to the static one's at the same length does
the per-call size and variant work once, not per launch. Not a GPU measure: the H200
figures come from ``bench/decoder_profile.py`` and ``bench/gpu_bench.py --dynamic``.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


class NoLaunch:
    """torch's static CUDA launcher with its C entry points doing nothing."""

    launches = 0

    def _load_kernel(self, path: str, name: str, shared: int, device: int) -> tuple[Any, ...]:
        return ("module", "function", 32, 0)

    def _launch_kernel(self, *args: Any) -> None:
        NoLaunch.launches += 1


def compile_decoder(length: int, dynamic: bool, layers: int) -> Any:
    """The decoder's inference graph for sm_90 (sources, no binaries) and its request."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kiln.frontend.config import KilnConfig
    from kiln.frontend.cross.fake_device import fake_module, trace_requests
    from kiln.workers.pipeline import compile_sources
    from tests.models import Decoder
    from tests.targets import SM90

    mode = FakeTensorMode()
    model = fake_module(Decoder(vocab=32000, d=1024, heads=16, layers=layers).half().eval(),
                        mode)
    with mode:
        ids = torch.randint(0, 32000, (4, length), device="cuda")
    (traced,) = trace_requests(model, [ids], KilnConfig.resolve({}), dict(SM90),
                               dynamic=dynamic)
    assert traced.request is not None, traced.reason
    return compile_sources(traced.request.to_bytes(), f"{'dyn' if dynamic else 'static'}"
                           f"{length}"), traced.request


class _MetaLibrary:
    """``torch`` for the wrapper: library calls make their (meta) output and nothing else."""

    def __getattr__(self, name: str) -> Any:
        import torch

        return getattr(torch, name)

    @staticmethod
    def addmm(bias: Any, a: Any, b: Any) -> Any:
        import torch

        return torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)

    @staticmethod
    def mm(a: Any, b: Any) -> Any:
        import torch

        return torch.empty(a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)

    @staticmethod
    def bmm(a: Any, b: Any) -> Any:
        import torch

        return torch.empty(a.shape[0], a.shape[1], b.shape[2], dtype=a.dtype,
                           device=a.device)


def bound_wrapper(compiled: Any) -> Callable[[list[Any]], Any]:
    """``compiled``'s ``call`` with Kiln's launchers over the no-op launcher, on meta."""
    import torch

    from kiln.compiler import compiled_graph
    from kiln.compiler.kernel_compile import KernelBinary

    torch._C._StaticCudaLauncher = NoLaunch()  # type: ignore[attr-defined,misc,assignment]
    torch._C._cuda_getCurrentRawStream = lambda device: 0  # type: ignore[attr-defined]
    compiled_graph._arch_matches = lambda binary, device: True  # type: ignore[assignment]
    for spec in compiled.kernels:
        config = compiled.config_for(spec)
        compiled.binaries[spec.name] = KernelBinary(
            spec.name, {"kind": "cuda", "arch": 90}, dict(config), b"no cubin",
            {"name": spec.name, "num_warps": config["num_warps"], "shared": 0})
    namespace: dict[str, Any] = {"DEVICE": torch.device("meta")}
    for spec in compiled.kernels:
        namespace[spec.name] = compiled_graph._launcher(compiled, spec,
                                                        torch.device("cuda", 0))
    exec(compile(compiled.wrapper_source, "<wrapper>", "exec"), namespace)
    namespace["torch"] = _MetaLibrary()  # (read by call() at run time)
    return namespace["call"]  # type: ignore[no-any-return]


def compile_encoder_step(layers: int) -> list[tuple[Any, list[Any]]]:
    """The forward and backward graphs of ``gpu_bench``'s encoder training step (width
    512, 8 heads, 8x256 tokens, bf16 autocast) for sm_90 (sources only), each with meta
    inputs shaped as its example inputs. A CPU torch cannot trace a backward on fake CUDA
    tensors, so the step is traced on the CPU (CPU autocast, CPU attention) and each ATen
    graph then compiled for fake CUDA inputs of the same layouts: the same wrapper shape
    (buffers, views, launches, library calls) as the GPU's, not the same graph."""
    import torch
    import torch.nn.functional as F
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kiln.compiler.driver import compile_graph
    from kiln.frontend.core.backend import aot_kiln
    from kiln.frontend.core.fallback import KilnFallbackWarning

    sys.path.insert(0, str(ROOT / "bench"))
    import gpu_bench

    graphs: list[tuple[Any, list[Any], str]] = []

    def capture(gm: Any, ins: Any, name: str) -> Any:
        graphs.append((gm, list(ins), name))
        return make_boxed_func(gm.forward)

    torch.manual_seed(0)
    model = gpu_bench.Encoder(layers=layers, seq=256)
    labels = torch.randint(0, 2, (8,))

    def step(ids: Any, segments: Any, keep: Any) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(ids, segments, keep).float(), labels)
        loss.backward()
        return loss

    inputs = [torch.randint(0, 30000, (8, 256)), torch.randint(0, 2, (8, 256)),
              torch.arange(256)[None, :] < torch.randint(128, 257, (8, 1))]
    with warnings.catch_warnings():  # a graph Kiln would run eagerly must not be timed
        warnings.simplefilter("error", KilnFallbackWarning)
        torch.compile(step, backend=lambda gm, ex: aot_kiln(gm, ex, capture))(*inputs)
    torch._dynamo.reset()
    if [name.split("_")[0] for _, _, name in graphs] != ["forward", "backward"]:
        raise RuntimeError(f"expected one forward and one backward graph, got "
                           f"{[name for _, _, name in graphs]}")
    out = []
    for gm, ins, name in graphs:
        for node in gm.graph.nodes:
            if isinstance(node.kwargs.get("device"), torch.device):
                node.update_kwarg("device", torch.device("cuda"))
        gm.recompile()
        with FakeTensorMode():
            fake = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
                    if isinstance(t, torch.Tensor) else t for t in ins]
        compiled = compile_graph(gm, fake, {}, name=name, compile_kernels=False)
        out.append((compiled, [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                   device="meta")
                               if isinstance(t, torch.Tensor) else t for t in ins]))
    return out


def encoder_step(layers: int, calls: int, profile: bool) -> None:
    """Host µs of the encoder training step's two wrappers per step."""
    graphs = compile_encoder_step(layers)
    bound = [(bound_wrapper(compiled), args) for compiled, args in graphs]

    def one_step(args: list[Any]) -> None:
        for call, graph_args in bound:
            call(list(graph_args))

    NoLaunch.launches = 0
    one_step([])
    launches = NoLaunch.launches
    (us,) = host_us([(one_step, [])], max(calls // 10, 1))
    print("| encoder step 8x256 bf16 | host µs per step | launches | buffers |")
    print("|---|---|---|---|")
    buffers = sum(c.wrapper_source.count("empty_strided_cuda(") - 1 for c, _ in graphs)
    print(f"| {layers} layers | {us:.1f} | {launches} | {buffers} |", flush=True)
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            one_step([])
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def inputs_for(request: Any, sizes: dict[str, int]) -> list[Any]:
    """Meta tensors (and ints) for the request's inputs with its symbols at ``sizes``."""
    import sympy
    import torch

    from kiln.compiler.request import SymIntMeta

    def value(v: Any) -> int:
        expr = sympy.sympify(v)
        return int(expr.subs({sym: sizes[sym.name] for sym in expr.free_symbols}))

    out: list[Any] = []
    for meta in request.inputs:
        if isinstance(meta, SymIntMeta):
            out.append(value(meta.expr))
        else:
            out.append(torch.empty_strided([value(v) for v in meta.shape],
                                           [value(v) for v in meta.stride],
                                           dtype=meta.torch_dtype, device="meta"))
    return out


def host_us(calls: list[tuple[Callable[[list[Any]], Any], list[Any]]], n: int,
            blocks: int = 10) -> list[float]:
    """CPU µs per call of each (wrapper, inputs): the best of ``blocks`` blocks of ``n``
    calls, the wrappers' blocks interleaved, timed by this thread's CPU time (a shared
    machine's other work does not count)."""
    for call, args in calls:
        for _ in range(20):
            call(list(args))
    best = [float("inf")] * len(calls)
    for _ in range(blocks):
        for k, (call, args) in enumerate(calls):
            start = time.thread_time()
            for _ in range(n):
                call(list(args))
            best[k] = min(best[k], (time.thread_time() - start) / n * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="128,512,2048")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--profile", action="store_true",
                        help="the functions with the most own time in the dynamic wrapper")
    parser.add_argument("--encoder-step", action="store_true",
                        help="the encoder training step's forward and backward wrappers")
    ns = parser.parse_args()
    os.environ.setdefault("KILN_CACHE_DIR", tempfile.mkdtemp())
    if ns.encoder_step:
        encoder_step(ns.layers, ns.calls, ns.profile)
        return
    lengths = [int(n) for n in ns.lengths.split(",")]
    dynamic, request = compile_decoder(lengths[0], True, ns.layers)
    dyn_call = bound_wrapper(dynamic)
    print("| decoder 4xN fp16 | static µs | dynamic µs | launches | dynamic/static |")
    print("|---|---|---|---|---|")
    for n in lengths:
        static, static_request = compile_decoder(n, False, ns.layers)
        static_call = bound_wrapper(static)
        static_args = inputs_for(static_request, {})
        dyn_args = inputs_for(request, {"s0": 4, "s1": n})
        NoLaunch.launches = 0
        dyn_call(list(dyn_args))
        launches = NoLaunch.launches
        s_us, d_us = host_us([(static_call, static_args), (dyn_call, dyn_args)],
                             max(ns.calls // 10, 1))
        print(f"| {n} | {s_us:.1f} | {d_us:.1f} | {launches} | {d_us / s_us:.2f} |",
              flush=True)
        if ns.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(200):
                dyn_call(list(dyn_args))
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()
