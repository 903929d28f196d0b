"""Decomposed composites (softmax, log_softmax, layer_norm, rms_norm, gelu, silu,
cross_entropy, ...) and their backward graphs, lowered and run by the IR interpreter.

The backward is traced with ``torch.func.vjp`` inside the traced function, so the graph
holds the forward and the backward ops AOTAutograd would produce (``*_backward``
decompositions included). A second test captures AOTAutograd's own forward and backward
graphs with ``aot_function`` and runs both through the interpreter.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch._functorch.aot_autograd import aot_function, make_boxed_func

from kiln.compiler.decompositions import kiln_decompositions
from kiln.compiler.driver import lower_and_schedule
from kiln.compiler.interpreter import run_graph

FLOATS = (torch.float32, torch.float16, torch.bfloat16)
B, D = 6, 12

Draw = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class Composite:
    """``fn(x, *params)``; ``params`` are the shapes of extra differentiable inputs."""

    name: str
    fn: Callable[..., torch.Tensor]
    params: tuple[tuple[int, ...], ...] = ()


def _cross_entropy(**kwargs: Any) -> Callable[..., torch.Tensor]:
    def fn(x: torch.Tensor) -> torch.Tensor:
        target = torch.arange(B) * 5 % D  # fixed targets: no integer input to differentiate
        return F.cross_entropy(x, target, **kwargs)

    return fn


COMPOSITES: list[Composite] = [
    Composite("softmax", lambda x: torch.softmax(x, -1)),
    Composite("softmax_dim0", lambda x: torch.softmax(x, 0)),
    Composite("log_softmax", lambda x: torch.log_softmax(x, -1)),
    Composite("softmax_fp32_dtype", lambda x: torch.softmax(x, -1, dtype=torch.float32)),
    Composite("layer_norm", lambda x, w, b: F.layer_norm(x, (D,), w, b), ((D,), (D,))),
    Composite("layer_norm_no_affine", lambda x: F.layer_norm(x, (D,), eps=1e-3)),
    Composite("layer_norm_2d", lambda x, w: F.layer_norm(x.reshape(B, 3, 4), (3, 4), w),
              ((3, 4),)),
    Composite("rms_norm", lambda x, w: F.rms_norm(x, (D,), w, eps=1e-6), ((D,),)),
    Composite("rms_norm_no_weight", lambda x: F.rms_norm(x, (D,))),
    Composite("gelu", F.gelu),
    Composite("gelu_tanh", lambda x: F.gelu(x, approximate="tanh")),
    Composite("silu", F.silu),
    Composite("sigmoid", torch.sigmoid),
    Composite("tanh", torch.tanh),
    Composite("relu", torch.relu),
    Composite("cross_entropy", _cross_entropy()),
    Composite("cross_entropy_sum_smoothing", _cross_entropy(label_smoothing=0.1,
                                                             reduction="sum")),
    Composite("cross_entropy_ignore_index", _cross_entropy(ignore_index=5)),
    Composite("logsumexp", lambda x: torch.logsumexp(x, 1)),
    Composite("group_norm", lambda x, w, b: F.group_norm(x.reshape(B, 4, 3), 2, w, b),
              ((4,), (4,))),
]


def _params() -> list[Any]:
    return [pytest.param(c, dt, id=f"{c.name}-{str(dt)[6:]}") for c in COMPOSITES
            for dt in FLOATS]


@pytest.mark.parametrize(("comp", "dtype"), _params())
def test_forward_and_backward(comp: Composite, dtype: torch.dtype, draw: Draw,
                              check_lowering: Any) -> None:
    """Outputs of ``fn`` and the gradients of every input, for a random cotangent."""
    x = draw((D, B), dtype).t()  # transposed: the backward sees a non-contiguous input
    params = [draw(shape, dtype) for shape in comp.params]
    cotangent = draw(tuple(comp.fn(x, *params).shape), dtype)

    def fwd_bwd(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        *primals, ct = inputs
        out, pullback = torch.func.vjp(comp.fn, *primals)
        return (out, *pullback(ct))

    check_lowering(fwd_bwd, x, *params, cotangent, reduction=True, allow_fallback=UNLOWERED)


# Ops these graphs reach that have no lowering yet and run eagerly inside the compiled
# graph: the scatter family (cross entropy's and max's backward, index backward), CPU
# attention, and cumprod (the backward of prod). Every other op must be lowered.
UNLOWERED = ("aten.scatter", "aten.index_put", "aten._scaled_dot_product", "aten.cumprod")

# Backward graphs of views, indexing and losses: slice_scatter, select_scatter,
# index_put / scatter_add (fallbacks), constant padding with negative pads, ...
GRAD_CASES: dict[str, tuple[Callable[..., torch.Tensor], list[tuple[int, ...]]]] = {
    "slice_step": (lambda x: x[:, 1::2] * 2, [(4, 7)]),
    "slice_negative": (lambda x: x[-3:-1] * 2, [(5, 3)]),
    "select": (lambda x: x[:, -2].exp(), [(4, 5)]),
    "cat": (lambda x, y: torch.cat([x, y], 1).exp(), [(3, 2), (3, 4)]),
    "pad": (lambda x: F.pad(x, (1, 2, -1, 1)).sin(), [(4, 5)]),
    "expand": (lambda x: x.expand(4, 3, 5) * 2, [(3, 1)]),
    "permute_reshape": (lambda x: x.permute(1, 0, 2).reshape(4, 15) ** 2, [(3, 4, 5)]),
    "split_unbind": (lambda x: torch.split(x, 2, 1)[1] * torch.unbind(x, 1)[0][:, None],
                     [(3, 7)]),
    "index_repeated": (lambda x: x[torch.tensor([0, -1, 2, 2])] * 2, [(6, 3)]),
    "gather": (lambda x: torch.gather(x, 1, torch.tensor([[0, 4], [1, 1], [3, 2]])), [(3, 5)]),
    "embedding": (lambda w: F.embedding(torch.tensor([[1, 7, 1], [0, 9, 3]]), w), [(10, 4)]),
    "max_and_var": (lambda x: x.max(1)[0] + x.var(1) + x.prod(1), [(4, 5)]),
    "where_clamp": (lambda x: torch.where(x > 0, x, x * 0.1).clamp(-0.5, 0.5), [(4, 5)]),
    "mse": (lambda x, y: F.mse_loss(x, y), [(4, 5), (4, 5)]),
    "bce_with_logits": (lambda x, y: F.binary_cross_entropy_with_logits(x, y.sigmoid()),
                        [(4, 5), (4, 5)]),
    "batch_norm_train": (lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
                         [(4, 3, 5), (3,), (3,)]),
    "pools": (lambda x: F.avg_pool2d(x, 2) + F.max_pool2d(x, 2), [(1, 2, 4, 6)]),
    # Global and even adaptive average pooling (a mean; an average pooling), a vector
    # norm and repeat: each lowered (they ran eagerly in the model suite's graphs).
    "adaptive_pools": (lambda x: F.adaptive_avg_pool2d(x, 1).sin()
                       + F.adaptive_avg_pool2d(x, (2, 3)).sum((-2, -1), keepdim=True),
                       [(2, 3, 4, 6)]),
    "vector_norm": (lambda x: x / torch.linalg.vector_norm(x, dim=-1, keepdim=True)
                    + torch.linalg.vector_norm(x, ord=3, dim=0), [(4, 5)]),
    "repeat": (lambda x: x.repeat(2, 1, 3).exp(), [(3, 4)]),
    "cumsum": (lambda x: x.cumsum(1) * 2 + x.cumsum(0), [(5, 7)]),  # a masked sum
    "attention": (lambda q, k, v: F.scaled_dot_product_attention(q, k, v),
                  [(1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)]),
}


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=["float32", "bfloat16"])
@pytest.mark.parametrize("name", GRAD_CASES)
def test_backward_of_views_indexing_and_losses(name: str, dtype: torch.dtype, draw: Draw,
                                               check_lowering: Any) -> None:
    fn, shapes = GRAD_CASES[name]
    primals = [draw(s, dtype) for s in shapes]
    cotangent = draw(tuple(fn(*primals).shape), dtype)

    def fwd_bwd(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        *xs, ct = inputs
        out, pullback = torch.func.vjp(fn, *xs)
        return (out, *pullback(ct))

    check_lowering(fwd_bwd, *primals, cotangent, reduction=True, allow_fallback=UNLOWERED)


def test_autograd_grad_inside_the_traced_function(draw: Draw, check_lowering: Any) -> None:
    """``torch.autograd.grad`` traces too when the input requires grad."""
    x = draw((B, D), torch.float32).requires_grad_()
    w = draw((D,), torch.float32)

    def fn(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, ...]:
        loss = (F.gelu(F.layer_norm(x, (D,), w)) ** 2).sum()
        return torch.autograd.grad(loss, x)

    check_lowering(fn, x, w, reduction=True)


def _aot_graphs(fn: Callable[..., torch.Tensor], args: list[torch.Tensor]
                ) -> tuple[list[torch.fx.GraphModule], torch.Tensor]:
    """AOTAutograd's forward and backward graphs of ``fn``, compiled by capture only."""
    graphs: list[torch.fx.GraphModule] = []

    def capture(gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        graphs.append(gm)
        return make_boxed_func(gm)

    compiled = aot_function(fn, capture, decompositions=kiln_decompositions())
    loss = compiled(*args)
    loss.backward(torch.ones_like(loss))
    return graphs, loss


def test_aot_autograd_forward_and_backward_graphs(draw: Draw, assert_same: Any) -> None:
    """Run AOTAutograd's own fw and bw graphs through the interpreter, fed each other."""

    def model(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        h = F.silu(F.layer_norm(x, (D,), w, b))
        return F.cross_entropy(torch.log_softmax(h, -1), torch.arange(B) % D)

    shapes = [(B, D), (D,), (D,)]
    args = [draw(shape, torch.float32).requires_grad_() for shape in shapes]
    (fw, bw), _ = _aot_graphs(model, args)
    plain = [a.detach() for a in args]
    fw_out = run_graph(lower_and_schedule(fw, plain, name="fw").graph, plain)
    assert_same(fw_out[:1], [model(*plain)], reduction=True)
    saved = fw_out[1:]  # the activations the forward saved for the backward
    bw_in = saved + [torch.ones(())]
    grads = run_graph(lower_and_schedule(bw, bw_in, name="bw").graph, bw_in)
    expected = torch.autograd.grad(model(*args), args)
    assert_same(grads, list(expected), reduction=True)


def test_position_ids_from_an_attention_mask(check_lowering: Any) -> None:
    """RoBERTa's position ids: an int64 cumulative sum of the mask along the sequence,
    lowered (a masked sum), exact."""
    mask = (torch.rand(4, 37) > 0.3).long()
    check_lowering(lambda m: torch.cumsum(m, dim=1) * m + 1, mask)
