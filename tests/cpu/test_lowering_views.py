"""View, indexing and constant lowerings against eager.

Views remap indices and copy nothing, so each view is checked both as a graph output
(a strided view of a buffer) and feeding a pointwise op (an inlined index map), on
contiguous, permuted and strided inputs. Indirect loads use random (and negative)
indices; constants are checked for values, dtype and size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from kiln.compiler.interpreter import run_graph

DTYPES = (torch.float32, torch.bfloat16, torch.int32)
SHAPE = (4, 6, 5)

Draw = Callable[..., torch.Tensor]


def _inputs(draw: Draw, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {
        "contiguous": draw(SHAPE, dtype),
        "permuted": draw((5, 6, 4), dtype).permute(2, 1, 0),
        "strided": draw((8, 6, 10), dtype)[::2, :, ::2],
        "offset": draw((5, 6, 5), dtype)[1:],
    }


VIEWS: dict[str, Callable[[torch.Tensor], Any]] = {
    "reshape_merge_leading": lambda x: x.reshape(24, 5),
    "reshape_merge_trailing": lambda x: x.reshape(4, 30),
    "reshape_split": lambda x: x.reshape(2, 2, 3, 2, 5),
    "reshape_regroup": lambda x: x.reshape(8, 15),
    "reshape_regroup_2": lambda x: x.reshape(10, 12),
    "reshape_flat": lambda x: x.reshape(-1),
    "reshape_ones": lambda x: x.reshape(1, 4, 1, 30, 1),
    "flatten_inner": lambda x: x.flatten(1),
    "permute": lambda x: x.permute(2, 0, 1),
    "transpose": lambda x: x.transpose(0, 2),
    "t_of_select": lambda x: x[0].t(),
    "movedim": lambda x: torch.movedim(x, 0, -1),
    "expand": lambda x: x[:, :1].expand(4, 7, 5),
    "expand_new_dim": lambda x: x[0].expand(3, 6, 5),
    "unsqueeze": lambda x: x.unsqueeze(1).unsqueeze(-1),
    "squeeze_dim": lambda x: x[:, :1].squeeze(1),
    "squeeze_all": lambda x: x[:1, :, :1].squeeze(),
    "squeeze_not_one": lambda x: x.squeeze(0),
    "slice_step": lambda x: x[:, 1::2, ::3],
    "slice_negative": lambda x: x[-3:-1, :-2],
    "slice_past_end": lambda x: x[1:100, 2:],
    "narrow": lambda x: x.narrow(2, 1, 3),
    "select": lambda x: x[:, -1],
    "select_first": lambda x: x[2],
    "diagonal": lambda x: torch.diagonal(x, 0, 1, 2),
    "split": lambda x: torch.split(x, 2, dim=1),
    "split_uneven": lambda x: torch.split(x, 4, dim=1),
    "split_sizes": lambda x: torch.split(x, [1, 3, 2], dim=1),
    "chunk": lambda x: torch.chunk(x, 2, dim=0),
    "unbind": lambda x: torch.unbind(x, 2),
}


def _view_params() -> list[Any]:
    return [pytest.param(name, dt, id=f"{name}-{str(dt)[6:]}") for name in VIEWS
            for dt in DTYPES]


@pytest.mark.parametrize(("name", "dtype"), _view_params())
def test_view(name: str, dtype: torch.dtype, draw: Draw, check_lowering: Any) -> None:
    """The view as an output, and the view read by a pointwise op, on every layout."""
    view, inputs = VIEWS[name], _inputs(draw, dtype)

    def fn(*xs: torch.Tensor) -> list[Any]:
        outs = []
        for x in xs:
            outs += [view(x), [v * 2 for v in _tensors(view(x + 1))]]
        return outs

    check_lowering(fn, *inputs.values())


def _tensors(value: Any) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


AS_STRIDED: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "input": lambda x: torch.as_strided(x, (3, 4), (2, 3), 1),
    "input_default_offset": lambda x: torch.as_strided(x[1:], (3, 4), (1, 5)) * 2,
    "intermediate": lambda x: torch.as_strided(x + 1, (3, 4), (2, 3), 1) * 2,
    "overlapping": lambda x: torch.as_strided(x.exp(), (4, 4), (1, 1)),
}


@pytest.mark.parametrize("name", AS_STRIDED)
def test_as_strided(name: str, draw: Draw, check_lowering: Any) -> None:
    """as_strided reads storage as eager lays it out, also under a transposed input."""
    fn = AS_STRIDED[name]
    check_lowering(fn, draw((6, 5), torch.float32))
    check_lowering(fn, draw((5, 6), torch.float32).t())


CATS: dict[str, Callable[..., Any]] = {
    "dim0": lambda a, b: torch.cat([a, b[:1]], 0),
    "dim1_three": lambda a, b: torch.cat([a, b * 2, a[:, :2]], 1),
    "dim-1": lambda a, b: torch.cat([a, b], -1),
    "mixed_dtypes": lambda a, b: torch.cat([a, b.to(torch.float16)], 2),
    "with_empty": lambda a, b: torch.cat([a.reshape(-1), torch.empty(0, dtype=a.dtype)]),
    "stack": lambda a, b: torch.stack([a, b], 1),
    "pad": lambda a, b: F.pad(a, (1, 2, 0, 3), value=5),
    "pad_negative": lambda a, b: F.pad(b, (-1, 2, 1, -2)),
    "pad_then_add": lambda a, b: F.pad(a, (2, 0)) + 1,
    "flip": lambda a, b: torch.flip(a, [0, 2]),
    "roll": lambda a, b: torch.roll(b, 2, 1),
    "tril": lambda a, b: torch.tril(a[0], -1),
    "triu": lambda a, b: torch.triu(b[1], 1),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d)[6:] for d in DTYPES])
@pytest.mark.parametrize("name", CATS)
def test_cat_pad_and_friends(name: str, dtype: torch.dtype, draw: Draw,
                             check_lowering: Any) -> None:
    inputs = _inputs(draw, dtype)
    check_lowering(CATS[name], inputs["permuted"], inputs["strided"])
    check_lowering(CATS[name], inputs["contiguous"], inputs["offset"])


# -- indirect loads -------------------------------------------------------------------

def _index_cases(x: torch.Tensor) -> dict[str, tuple[Callable[..., Any], list[torch.Tensor]]]:
    i4 = torch.tensor([0, -1, 2, -4, 3])  # negative indices count from the end
    return {
        "index_first": (lambda t, i: t[i], [i4]),
        "index_middle_2d": (lambda t, i: t[:, i], [torch.tensor([[0, -1], [2, 5]])]),
        "index_last": (lambda t, i: t[..., i], [torch.tensor([4, 0, -2])]),
        "index_two_adjacent": (lambda t, i, j: t[i, j], [i4, torch.tensor([1, -2, 5, 0, 3])]),
        "index_two_apart": (lambda t, i, j: t[i, :, j], [i4, torch.tensor([1, -2, 4, 0, 3])]),
        "index_broadcast": (lambda t, i, j: t[i, j], [torch.tensor([[0], [3]]),
                                                      torch.tensor([1, -2, 5])]),
        "index_all_three": (lambda t, i, j, k: t[i, j, k], [i4, i4 + 1, i4 % 5]),
        "gather_dim2": (lambda t, i: torch.gather(t, 2, i), [torch.randint(0, 5, (4, 6, 3))]),
        "gather_dim0": (lambda t, i: torch.gather(t, 0, i), [torch.randint(0, 4, (2, 6, 5))]),
        "index_select": (lambda t, i: torch.index_select(t, 1, i), [torch.tensor([0, 5, 2, 2])]),
        "index_select_0d": (lambda t, i: torch.index_select(t, 0, i), [torch.tensor(3)]),
        "take_along_dim": (lambda t, i: torch.take_along_dim(t, i, 1),
                           [torch.randint(0, 6, (4, 2, 5))]),
    }


_INDEX_NAMES = list(_index_cases(torch.zeros(SHAPE)))


@pytest.mark.parametrize("dtype", DTYPES, ids=[str(d)[6:] for d in DTYPES])
@pytest.mark.parametrize("name", _INDEX_NAMES)
def test_indirect_loads(name: str, dtype: torch.dtype, draw: Draw,
                        check_lowering: Any) -> None:
    inputs = _inputs(draw, dtype)
    fn, indices = _index_cases(inputs["contiguous"])[name]

    def fused(t: torch.Tensor, *i: torch.Tensor) -> torch.Tensor:
        return fn(t * 2, *i) + 1  # the indirect load inlined between two pointwise ops

    for layout in ("contiguous", "permuted"):
        check_lowering(fn, inputs[layout], *indices)
        check_lowering(fused, inputs[layout], *indices)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
def test_embedding(dtype: torch.dtype, draw: Draw, check_lowering: Any) -> None:
    weight = draw((10, 4), dtype)
    ids = torch.randint(0, 10, (3, 5))
    check_lowering(lambda w, i: F.embedding(i, w) * 2, weight, ids)
    check_lowering(lambda w, i: F.embedding(i, w, padding_idx=0), weight, ids)
    check_lowering(lambda w, i: F.embedding(i, w), draw((4, 10), dtype).t(), ids[0])


# -- constants ------------------------------------------------------------------------


def _constants(x: torch.Tensor) -> list[torch.Tensor]:
    return [
        torch.full((3, 4), 2.5), torch.full((3, 2), 7), torch.full((2,), True),
        torch.full((2, 3), -1.5, dtype=torch.bfloat16), torch.zeros(3, 4),
        torch.ones(2, 3, dtype=torch.int32), torch.zeros((), dtype=torch.int64),
        torch.arange(10), torch.arange(2, 11, 3), torch.arange(10, 0, -3),
        torch.arange(0.5, 3.0, 0.25), torch.arange(5, dtype=torch.float16),
        torch.arange(4.5), torch.arange(3.0, -1.0, -0.5), torch.linspace(-1, 1, 9),
        torch.scalar_tensor(3.0), torch.scalar_tensor(3, dtype=torch.int64),
        torch.zeros_like(x), torch.ones_like(x, dtype=torch.bfloat16), torch.full_like(x, 3),
        x.new_zeros(3), x.new_ones((2, 2)), x.new_full((2,), 4),
        x + torch.full((5,), 0.5), x * torch.arange(5) + torch.ones(1),
    ]


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.int64))
def test_constants(dtype: torch.dtype, draw: Draw, check_lowering: Any) -> None:
    """Creation ops: values, dtype and size; *_like ops keep the input's layout."""
    check_lowering(_constants, draw((3, 5), dtype))
    check_lowering(_constants, draw((5, 3), dtype).t())


def test_empty_like_has_the_right_metadata(draw: Draw, compile_graph: Any) -> None:
    """empty_like's values are undefined: only its dtype, size and layout are checked."""
    x = draw((5, 3), torch.float16).t()
    sg = compile_graph(lambda t: [torch.empty_like(t), torch.empty(2, 3, dtype=torch.int8)], [x])
    a, b = run_graph(sg.graph, [x])
    assert (a.dtype, a.shape, a.stride()) == (x.dtype, x.shape, (1, 3))
    assert (b.dtype, b.shape) == (torch.int8, (2, 3))


def test_outputs_that_alias_inputs_or_each_other(draw: Draw, check_lowering: Any) -> None:
    """An input returned as is, views of it, one value returned twice, and a Python int."""

    def fn(a: torch.Tensor) -> tuple[Any, ...]:
        y = a.exp()
        return a, a.t(), a[1:, ::2], y, y, y.t(), y[:, 1], 3

    check_lowering(fn, draw((4, 6), torch.float32))
    check_lowering(fn, draw((6, 4), torch.float32).t())


PRIMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "broadcast_in_dim": lambda x: torch.ops.prims.broadcast_in_dim(x, [4, 3, 5], [0, 2]) * 2,
    "transpose": lambda x: torch.ops.prims.transpose(x, [1, 0]) + 1,
    "squeeze": lambda x: torch.ops.prims.squeeze(x[:1], [0]) * 2,
    "reshape": lambda x: torch.ops.prims.reshape(x, [5, 4]) * 2,
    "convert_element_type": lambda x: torch.ops.prims.convert_element_type(x, torch.float16),
    "sum": lambda x: torch.ops.prims.sum(x, [1]),
    "var": lambda x: torch.ops.prims.var(x, [1], correction=1),
}


@pytest.mark.parametrize("name", PRIMS)
def test_prims_left_by_decompositions(name: str, draw: Draw, compile_graph: Any,
                                      assert_same: Any) -> None:
    """prims ops some decompositions emit (their views cannot be functionalized)."""
    x, fn = draw((5, 4), torch.float32).t(), PRIMS[name]
    sg = compile_graph(fn, [x], functionalize=False)
    assert_same(run_graph(sg.graph, [x]), [fn(x)], reduction=True)

