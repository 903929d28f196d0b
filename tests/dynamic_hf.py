"""Real Hugging Face models with dynamic shapes, shared by the fake-CUDA compile tests
(tests/unit), the Triton-interpreter numerics (tests/triton_interp) and the GPU tests.

Models are built from configs (random weights, no download). ``sm90_graphs`` runs a
model through the kiln backend's own Dynamo and AOTAutograd path on fake CUDA tensors
and compiles every ATen graph's request as a farm worker would: sources from the
request's bytes, then every Triton kernel cross-compiled to an sm_90 cubin. No GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tests.targets import SM90

# A bucket of sizes a real model is called at: lengths that are not multiples of 16.
ODD_LENGTHS = (200, 333, 700)


def tiny_llama(layers: int = 1, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
               vocab: int = 100, dtype: torch.dtype = torch.float32,
               use_cache: bool = False) -> torch.nn.Module:
    """An HF ``LlamaModel`` with grouped-query attention (``heads`` / ``kv_heads``),
    rotary embeddings and HF's own causal mask, through SDPA (no KV cache unless asked:
    a cache made on fake tensors cannot be)."""
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, vocab_size=vocab,
                         max_position_embeddings=4096, use_cache=use_cache)
    config._attn_implementation = "sdpa"
    return LlamaModel(config).to(dtype)


def hidden_states(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda ids: model(ids).last_hidden_state


@dataclass
class Sm90Graph:
    """One ATen graph compiled for sm_90 from fake CUDA tensors."""

    name: str
    compiled: Any  # compiler.compiled_graph.CompiledGraph
    symbols: tuple[Any, ...]


def sm90_graphs(fn: Callable[..., Any], calls: Sequence[Sequence[Any]],
                dynamic: bool | None = None) -> list[Sm90Graph]:
    """Call ``fn`` (compiled on the kiln backend's path) once per argument list of
    ``calls`` (fake CUDA tensors); every ATen graph Dynamo and AOTAutograd make is
    serialized, compiled from the request's bytes for sm_90 and its kernels built to
    cubins. A graph Kiln would run eagerly, or whose compile fails, raises here."""
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._guards import detect_fake_mode

    from kiln.compiler.driver import compile_all
    from kiln.frontend.config import KilnConfig
    from kiln.frontend.core.backend import aot_kiln, unsupported_reason
    from kiln.frontend.core.compile import request_options
    from kiln.frontend.core.keys import compute_key
    from kiln.frontend.core.serialize import make_request
    from kiln.frontend.cross.cuda_guard_shim import ensure_fake_cuda_guard
    from kiln.frontend.cross.fake_device import gpu_device_model
    from kiln.workers.pipeline import compile_sources

    ensure_fake_cuda_guard()
    target = dict(SM90, sm_count=132)
    config = KilnConfig.resolve({"farm": "inprocess"})
    fake_mode = detect_fake_mode([a for call in calls for a in call])
    graphs: list[Sm90Graph] = []
    notes: list[str] = []

    def graph_compiler(gm: torch.fx.GraphModule, inputs: Sequence[Any], name: str) -> Any:
        reason = unsupported_reason(inputs)
        assert reason is None, f"graph {name} would run eagerly: {reason}"
        request = make_request(gm, inputs, options=request_options(config, name),
                               target=target)
        compiled = compile_sources(request.to_bytes(), compute_key(request).key)
        compile_all(compiled, target)
        graphs.append(Sm90Graph(name, compiled, request.symbols))

        def run_fake(*args: Any) -> Any:
            with fake_mode:
                return gm.forward(*args)

        return make_boxed_func(run_fake)

    device_model = gpu_device_model(target, notes)

    def backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        return aot_kiln(gm, example_inputs, graph_compiler, device_model=device_model)

    torch._dynamo.reset()
    compiled_fn = torch.compile(fn, backend=backend, dynamic=dynamic)
    with torch.no_grad():
        for args in calls:
            compiled_fn(*args)
    return graphs


def fake_cuda_model(model: torch.nn.Module) -> tuple[torch.nn.Module, Any]:
    """``model`` with fake CUDA parameters, and the fake mode to make inputs in (real
    constants a model makes while it runs, such as a rotary table's scalars, are let in)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kiln.frontend.cross.fake_device import fake_module

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    return fake_module(model, mode, "cuda"), mode


def fake_ids(mode: Any, batch: int, length: int, vocab: int = 100) -> torch.Tensor:
    with mode:
        return torch.randint(0, vocab, (batch, length), device="cuda")


def assert_built_for_sm90(graph: Sm90Graph) -> None:
    """Every Triton kernel of ``graph`` has an sm_90 cubin."""
    compiled = graph.compiled
    assert compiled.device_type == "cuda", graph.name
    triton = [k for k in compiled.kernels if k.backend == "triton"]
    assert triton, graph.name
    for spec in triton:
        binary = compiled.binaries[spec.name]
        assert binary.binary[:4] == b"\x7fELF", spec.name
        assert binary.metadata["target"]["arch"] == 90, spec.name
