"""Scatter-family cases shared by the backends' tests: index_put (accumulate or not),
scatter, scatter_add, scatter_reduce, index_add and embedding_dense_backward, with
repeated indices wherever the op combines them and unique ones where it overwrites."""

from __future__ import annotations

import torch

from tests.numerics_cases import FLOATS, Case, rand

aten = torch.ops.aten


def _repeats(high: int, *shape: int) -> torch.Tensor:
    """Random int64 indices in [0, high) that repeat (more draws than rows)."""
    return torch.randint(0, high, shape)


def _unique_rows(n: int, k: int) -> torch.Tensor:
    return torch.randperm(n)[:k]


def _unique_per_column(rows: int, k: int, cols: int) -> torch.Tensor:
    """(k, cols) indices into dim 0, distinct within each column (scatter overwrites)."""
    return torch.rand(rows, cols).argsort(0)[:k]


def _index_put_acc(x: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.index_put(x, (idx,), v.exp(), accumulate=True) * 2


def _index_put_set(x: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.index_put(x.sin(), (idx,), v)


def _index_put_2d(x: torch.Tensor, i0: torch.Tensor, i1: torch.Tensor, v: torch.Tensor
                  ) -> torch.Tensor:
    return torch.index_put(x, (i0, i1), v, accumulate=True)


def _target_read_twice(x: torch.Tensor, idx: torch.Tensor, v: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    # y is read by the scatter's copy and by another kernel: both must see it unscattered.
    y = x * 3
    z = torch.index_put(y, (idx,), v, accumulate=True)
    return y + 1, z.sum(0)


def _embedding_backward(grad: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return aten.embedding_dense_backward(grad * 2, idx, 12, 3, False)


def _as_strided_scatter(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    # a strided window (rows 1, 3, 5 of columns 2..5) of a 12 x 8 copy, offset into row 1
    return torch.as_strided_scatter(x * 2, s.exp(), (3, 4), (16, 1), 10) + 1


SCATTER_CASES: list[Case] = [
    Case("index_put_accumulate", _index_put_acc,
         lambda dt: [rand(16, 8, dtype=dt), _repeats(16, 40), rand(40, 8, dtype=dt)]),
    Case("index_put_overwrite", _index_put_set,
         lambda dt: [rand(16, 8, dtype=dt), _unique_rows(16, 6), rand(6, 8, dtype=dt)]),
    Case("index_put_2d_negative_broadcast", _index_put_2d,
         lambda dt: [rand(6, 7, 5, dtype=dt), _repeats(6, 4, 3), torch.randint(-7, 7, (4, 3)),
                     rand(5, dtype=dt)]),
    Case("scatter_src", lambda x, i, s: x.scatter(0, i, s) + 1,
         lambda dt: [rand(8, 10, dtype=dt), _unique_per_column(8, 5, 10), rand(5, 10, dtype=dt)]),
    Case("scatter_value", lambda x, i: x.scatter(1, i, 1.5),
         lambda dt: [rand(6, 9, dtype=dt), _unique_per_column(9, 4, 6).t().contiguous()]),
    Case("scatter_add", lambda x, i, s: torch.scatter_add(x, 0, i, s.relu()),
         lambda dt: [rand(8, 10, dtype=dt), _repeats(8, 12, 10), rand(12, 10, dtype=dt)]),
    Case("scatter_reduce_sum", lambda x, i, s: x.scatter_reduce(1, i, s, "sum"),
         lambda dt: [rand(5, 6, dtype=dt), _repeats(6, 5, 11), rand(5, 11, dtype=dt)]),
    Case("scatter_reduce_amax", lambda x, i, s: x.scatter_reduce(0, i, s, "amax"),
         lambda dt: [rand(8, 10, dtype=dt), _repeats(8, 12, 10), rand(12, 10, dtype=dt)],
         FLOATS + (torch.int32,)),
    Case("scatter_reduce_amin", lambda x, i, s: x.scatter_reduce(0, i, s, "amin"),
         lambda dt: [rand(8, 10, dtype=dt), _repeats(8, 12, 10), rand(12, 10, dtype=dt)]),
    Case("index_add", lambda x, i, s: x.index_add(0, i, s, alpha=2),
         lambda dt: [rand(10, 6, dtype=dt), _repeats(10, 15), rand(15, 6, dtype=dt)],
         FLOATS + (torch.int64,)),
    Case("embedding_dense_backward", _embedding_backward,
         lambda dt: [rand(4, 9, 16, dtype=dt), _repeats(12, 4, 9)]),
    Case("as_strided_scatter", _as_strided_scatter,
         lambda dt: [rand(12, 8, dtype=dt), rand(3, 4, dtype=dt)]),
    Case("target_read_twice", _target_read_twice,
         lambda dt: [rand(16, 8, dtype=dt), _repeats(16, 40), rand(40, 8, dtype=dt)]),
]


def expand_scatter_cases() -> list[tuple[Case, torch.dtype]]:
    return [(c, dt) for c in SCATTER_CASES for dt in c.dtypes]


def scatter_case_id(item: tuple[Case, torch.dtype]) -> str:
    case, dtype = item
    return f"{case.name}-{str(dtype).removeprefix('torch.')}"


def flat_outputs(value: object) -> list[torch.Tensor]:
    return list(value) if isinstance(value, (list, tuple)) else [value]  # type: ignore[list-item]


def assert_case_matches(case: Case, args: list[torch.Tensor], outs: list[torch.Tensor],
                        dtype: torch.dtype) -> None:
    """Kiln's outputs against eager's: fp16/bf16 sums accumulate in fp32 in Kiln, in the
    storage dtype in eager, so there Kiln may instead be no further from the fp64 truth."""
    from tests.numerics_cases import tolerance
    from tests.triton_interp.helpers import assert_close_to_eager

    refs = flat_outputs(case.fn(*args))
    assert len(outs) == len(refs)
    for i, (out, ref) in enumerate(zip(outs, refs)):
        assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, out.shape)

        def truth(i: int = i) -> torch.Tensor:
            wide = [a.double() if a.is_floating_point() else a for a in args]
            return flat_outputs(case.fn(*wide))[i]

        assert_close_to_eager(out, ref, truth, tolerance(dtype, reduction=True))
