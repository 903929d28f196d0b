"""Compile a graph in max-autotune mode with a chosen template config for every matmul:
the farm's two passes (lower, list the pending problems; lower again with choices),
with the choice made by the test instead of a benchmark."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kiln.compiler.codegen.triton.templates import gemm_configs
from kiln.compiler.compiled_graph import CompiledGraph
from kiln.compiler.decompositions import trace_aten
from kiln.compiler.driver import compile_graph
from kiln.compiler.ir.template import GemmProblem

Pick = Callable[[GemmProblem], dict[str, Any]]


def first_config(problem: GemmProblem) -> dict[str, Any]:
    return {"kind": "template", "config": gemm_configs(problem)[0]}


def config_number(i: int) -> Pick:
    def pick(problem: GemmProblem) -> dict[str, Any]:
        configs = gemm_configs(problem)
        return {"kind": "template", "config": configs[i % len(configs)]}

    return pick


def compile_tuned(fn: Callable[..., Any], args: Sequence[torch.Tensor],
                  options: dict[str, Any], pick: Pick = first_config,
                  compile_kernels: bool = False, target: dict[str, Any] | None = None,
                  trace_args: Sequence[torch.Tensor] | None = None,
                  graph: torch.fx.GraphModule | None = None) -> CompiledGraph:
    """``trace_args``: CPU tensors to trace with where fake CUDA ones cannot be traced;
    ``graph``: an ATen graph traced already (``fn`` is then not traced)."""
    gm = graph if graph is not None else trace_aten(
        fn, list(trace_args if trace_args is not None else args))
    options = {**options, "max_autotune": True}
    first = compile_graph(gm, list(args), options, name="tuned", compile_kernels=False)
    pending = first.stats["gemm_pending"]
    choices = {key: pick(GemmProblem.from_dict(p)) for key, p in pending.items()}
    return compile_graph(gm, list(args), {**options, "gemm_choices": choices}, name="tuned",
                         compile_kernels=compile_kernels, target=target)


def aot_graphs(step: Callable[..., Any], args: Sequence[torch.Tensor]
               ) -> list[tuple[str, torch.fx.GraphModule, list[Any]]]:
    """The ATen graphs (forward, backward) that the kiln backend's own Dynamo and
    AOTAutograd path makes of ``step(*args)``, traced on CPU tensors: (name, graph, inputs)
    each, ready to compile again on fake CUDA inputs of the same metadata."""
    from torch._functorch.aot_autograd import make_boxed_func

    from kiln.frontend.core.backend import aot_kiln

    graphs: list[tuple[str, torch.fx.GraphModule, list[Any]]] = []

    def keep(gm: torch.fx.GraphModule, inputs: Sequence[Any], name: str) -> Any:
        graphs.append((name, gm, list(inputs)))
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=lambda gm, ex: aot_kiln(gm, ex, keep),
                             dynamic=False)
    compiled(*args)
    torch._dynamo.reset()
    return graphs


def as_fake_cuda(inputs: Sequence[Any]) -> list[Any]:
    """Fake CUDA tensors with the inputs' sizes, strides and dtypes (others as they are)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
                if isinstance(t, torch.Tensor) else t for t in inputs]
