"""Layouts: where a buffer's elements live. Sizes, strides and offsets are sympy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import sympy
import torch

from .sym import Expr, sympify_tuple


def at_least_one(size: Expr) -> Expr:
    """``max(size, 1)``: the step a dimension of ``size`` elements gives the next stride
    (torch's rule, so that a size of 0 gives no zero strides). A symbolic size is a
    positive symbol or an expression of them that is at least 1 (Dynamo specializes 0
    and 1); where sympy cannot show it cheaply, the ``Max`` stays unevaluated: evaluating
    it on a convolution's output size (floors of floors after striding and pooling) makes
    sympy recurse without end."""
    size = sympy.sympify(size)
    if size.is_number:
        return sympy.Integer(max(int(size), 1))
    if size.is_positive:
        return size
    return sympy.Max(size, 1, evaluate=False)


def contiguous_strides(size: Sequence[Expr]) -> tuple[Expr, ...]:
    strides: list[Expr] = []
    running: Expr = sympy.Integer(1)
    for s in reversed(size):
        strides.append(running)
        running = running * at_least_one(s)
    return tuple(reversed(strides))


def strides_for_order(size: Sequence[Expr], order: Sequence[int]) -> tuple[Expr, ...]:
    """Dense strides where ``order`` lists dimensions from innermost to outermost."""
    strides: list[Expr] = [sympy.Integer(0)] * len(size)
    running: Expr = sympy.Integer(1)
    for d in order:
        strides[d] = running
        running = running * at_least_one(size[d])
    return tuple(strides)


def stride_order(stride: Sequence[Expr]) -> list[int]:
    """Dimensions from innermost (smallest stride) to outermost; ties keep later dims inner."""
    return sorted(range(len(stride)), key=lambda d: (int(stride[d]), -d))


@dataclass(frozen=True)
class Layout:
    """Device, dtype, size, stride and offset of a buffer's storage view."""

    device: torch.device
    dtype: torch.dtype
    size: tuple[Expr, ...]
    stride: tuple[Expr, ...]
    offset: Expr = sympy.Integer(0)

    def make_indexer(self) -> Callable[[Sequence[Expr]], Expr]:
        """Map a logical index to a flat storage offset (size-1 dims contribute nothing)."""
        stride, size, offset = self.stride, self.size, self.offset

        def indexer(index: Sequence[Expr]) -> Expr:
            assert len(index) == len(stride), (index, stride)
            return offset + sum(
                (i * s for i, s, n in zip(index, stride, size) if n != 1), sympy.Integer(0)
            )

        return indexer

    def storage_size(self) -> Expr:
        """Elements the storage needs: offset + the furthest element + 1."""
        if any(s == 0 for s in self.size):
            return sympy.Integer(0)
        return self.offset + sum((s - 1) * st for s, st in zip(self.size, self.stride)) + 1

    def is_contiguous(self) -> bool:
        expected = contiguous_strides(self.size)
        return all(n == 1 or s == c for n, s, c in zip(self.size, self.stride, expected))


@dataclass(frozen=True)
class FixedLayout(Layout):
    """A layout whose strides are decided and can no longer change."""


@dataclass(frozen=True)
class FlexibleLayout(Layout):
    """Contiguous by default; realization may still pick another dense stride order."""

    @staticmethod
    def contiguous(device: torch.device, dtype: torch.dtype, size: Sequence[Expr]
                   ) -> FlexibleLayout:
        sz = sympify_tuple(size)
        return FlexibleLayout(device, dtype, sz, contiguous_strides(sz))

    def as_fixed(self, stride: Sequence[Expr] | None = None) -> FixedLayout:
        return FixedLayout(
            self.device, self.dtype, self.size, sympify_tuple(stride or self.stride), self.offset
        )


@dataclass(frozen=True)
class MutationLayout(Layout):
    """The layout of a buffer that writes into another buffer's storage in place."""

    target: str = ""


@dataclass(frozen=True)
class MultiOutputLayout:
    """The layout of an extern kernel that returns several tensors (see MultiOutput)."""

    device: torch.device
