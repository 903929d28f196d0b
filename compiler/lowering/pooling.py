"""2-d pooling as pointwise loops over the output window: max_pool2d (values; indices only
where something reads them) and avg_pool2d, and their backwards as gathers over the
windows that can reach each input element.

Each output element reads its window's taps, unrolled: a tap outside the input (padding,
or the last window of ``ceil_mode``) is masked and reads -inf (max) or 0 (sum), so no
padded copy of the input exists. The input's producer stays inlined when it is cheap (a
batch norm and relu on a convolution's output: one kernel reads the convolution's output
and writes the pooled values); a window reads it several times, so an expensive one is
realized first. Windows of more than ``MAX_WINDOW_TAPS`` taps would unroll into long
kernels: they run ATen's kernel instead (``EagerInstead``: the graph's fallback, with
the reason in the debug log).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sympy
import torch

from ..ir.nodes import IRNode, Pointwise, StorageBox, TensorBox
from ..ir.sym import Expr, FloorDiv
from ..virtualized import ops
from .fallbacks import EagerInstead
from .registry import register_lowering

aten = torch.ops.aten

# Taps of one window above which it is not unrolled (Inductor draws the line at 25 too).
MAX_WINDOW_TAPS = 25
# A lazy producer reading more buffers than this is realized before a window reads it:
# each tap recomputes it. A batch norm reads its input and four per-channel vectors.
WINDOW_INLINE_MAX_READS = 6


@dataclass(frozen=True)
class Window:
    """One spatial dimension of a pooling window: input extent ``size`` (an int, or a
    symbolic size without ``ceil_mode``), ``kernel`` taps ``dilation`` apart, windows
    ``stride`` apart starting at ``-padding``."""

    size: Any  # int, or a sympy expression of the graph's size symbols
    kernel: int
    stride: int
    padding: int
    dilation: int
    ceil_mode: bool

    @property
    def symbolic(self) -> bool:
        return not isinstance(self.size, (int, sympy.Integer))

    @property
    def out_size(self) -> Any:
        """ATen's pooling output extent (``ceil_mode``: a last partial window counts if it
        starts inside the input or its left padding)."""
        span = self.size + 2 * self.padding - self.dilation * (self.kernel - 1) - 1
        if self.symbolic:  # no ceil_mode (pool2d_geometry)
            return FloorDiv(span, self.stride) + 1 if self.stride != 1 else span + 1
        out = (span + (self.stride - 1 if self.ceil_mode else 0)) // self.stride + 1
        if self.ceil_mode and (out - 1) * self.stride >= self.size + self.padding:
            out -= 1
        return out

    def tap(self, o: Expr, k: int) -> Expr:
        """The input position of tap ``k`` of the window at output position ``o``."""
        return o * self.stride - self.padding + k * self.dilation

    def tap_may_leave(self, k: int) -> tuple[bool, bool]:
        """Whether tap ``k`` falls before the input, or after it, for some window. For a
        symbolic size, after it where it can for some size: the last window starts at
        most ``span`` in, so tap ``k`` reaches at most ``size + padding - dilation *
        (kernel - 1 - k) - 1``."""
        first = k * self.dilation - self.padding
        if self.symbolic:
            return first < 0, self.padding - self.dilation * (self.kernel - 1 - k) - 1 >= 0
        last = (self.out_size - 1) * self.stride - self.padding + k * self.dilation
        return first < 0, last >= self.size


@dataclass(frozen=True)
class Pool2d:
    """The two windows (height, width) of a 2-d pooling over an (N, C, H, W) or (C, H, W)
    input."""

    h: Window
    w: Window

    @property
    def taps(self) -> list[tuple[int, int]]:
        return [(kh, kw) for kh in range(self.h.kernel) for kw in range(self.w.kernel)]

    @property
    def out_hw(self) -> tuple[int, int]:
        return self.h.out_size, self.w.out_size

    def tap_mask(self, oh: Expr, ow: Expr, kh: int, kw: int) -> Any:
        """The ops-level bool that tap (kh, kw) lies in the input, or None when it always
        does."""
        mask = None
        for win, o, k in ((self.h, oh, kh), (self.w, ow, kw)):
            before, after = win.tap_may_leave(k)
            pos = ops.index_expr(win.tap(o, k), torch.int64) if before or after else None
            for bad, check in ((before, lambda p: ops.ge(p, ops.constant(0, torch.int64))),
                               (after, lambda p, n=win.size: ops.lt(p, _index(n)))):
                if bad:
                    m = check(pos)
                    mask = m if mask is None else ops.logical_and(mask, m)
        return mask


def _index(value: Any) -> Any:
    """An int64 value at the ops level: a constant, or an expression of size symbols."""
    if isinstance(value, (int, sympy.Integer)):
        return ops.constant(int(value), torch.int64)
    return ops.index_expr(value, torch.int64)


def _pair(value: Sequence[int] | int | None, default: Sequence[int] | None = None
          ) -> tuple[int, int]:
    """A 2-d parameter as (height, width): one value serves both; empty or None (a
    stride) takes ``default`` (the kernel size)."""
    if isinstance(value, int):
        return value, value
    value = list(value or ()) or list(default or ())
    if len(value) == 1:
        return int(value[0]), int(value[0])
    if len(value) != 2:
        raise ValueError(f"a 2-d pooling parameter has 1 or 2 values, not {value}")
    return int(value[0]), int(value[1])


def pool2d_geometry(x: IRNode, kernel_size: Any, stride: Any, padding: Any, dilation: Any,
                    ceil_mode: bool) -> Pool2d | str:
    """The windows of a pooling of ``x``, or why it cannot be unrolled here."""
    size = x.get_size()
    if len(size) not in (3, 4):
        return f"a {len(size)}-d input (2-d pooling takes 3-d or 4-d)"
    static = all(isinstance(s, (int, sympy.Integer)) for s in size[-2:])
    if not static and ceil_mode:
        return "ceil_mode with a symbolic height or width"
    kernel = _pair(kernel_size)
    strides, pads, dils = _pair(stride, kernel), _pair(padding), _pair(dilation)
    if kernel[0] * kernel[1] > MAX_WINDOW_TAPS:
        return f"a {kernel[0]}x{kernel[1]} window has more than {MAX_WINDOW_TAPS} taps"
    wins = [Window(int(size[-2 + d]) if static else size[-2 + d], kernel[d], strides[d],
                   pads[d], dils[d], bool(ceil_mode)) for d in range(2)]
    if static and any(w.out_size <= 0 for w in wins):
        return "an empty output"
    return Pool2d(*wins)


def _unrolled(x: IRNode, kernel_size: Any, stride: Any, padding: Any, dilation: Any,
              ceil_mode: bool, values: bool = False) -> Pool2d:
    """The windows of a pooling of ``x`` (``values``: a forward, which reads ``x``'s
    values), or ``EagerInstead`` naming why ATen's kernel runs it."""
    pool = pool2d_geometry(x, kernel_size, stride, padding, dilation, ceil_mode)
    if isinstance(pool, str):
        raise EagerInstead(pool)
    if values and not x.get_dtype().is_floating_point:
        raise EagerInstead(f"{x.get_dtype()} values")
    return pool


def window_input(x: IRNode) -> IRNode:
    """``x`` ready to be read by a window: a lazy producer that reads many buffers is
    realized (each tap would recompute it); a cheap one stays inlined."""
    storage = x.storage() if isinstance(x, TensorBox) else None
    if isinstance(storage, StorageBox) and not storage.is_realized() \
            and storage.num_reads() > WINDOW_INLINE_MAX_READS:
        storage.realize()
    return x


def _window_loads(x: IRNode, pool: Pool2d, fill: float
                  ) -> Callable[[Sequence[Expr]], list[tuple[Any, Any, Expr]]]:
    """``loads(index)`` -> per tap, in ATen's order: (value, in-input mask or None, flat
    h * W + w position in the input plane)."""
    load, width = x.make_loader(), pool.w.size

    def loads(idx: Sequence[Expr]) -> list[tuple[Any, Any, Expr]]:
        *prefix, oh, ow = idx
        out = []
        for kh, kw in pool.taps:
            h, w = pool.h.tap(oh, kh), pool.w.tap(ow, kw)
            mask = pool.tap_mask(oh, ow, kh, kw)
            src = [*prefix, h, w]
            value = load(src) if mask is None else \
                ops.masked(mask, lambda src=src: load(src), fill)
            out.append((value, mask, h * width + w))
        return out

    return loads


def _max_values(loads: Callable[..., list[tuple[Any, Any, Expr]]]) -> Callable[..., Any]:
    def inner_fn(idx: Sequence[Expr]) -> Any:
        taps = loads(idx)
        best = taps[0][0]
        for value, _, _ in taps[1:]:
            best = ops.maximum(best, value)  # NaN wins, as in ATen
        return best

    return inner_fn


def _max_indices(loads: Callable[..., list[tuple[Any, Any, Expr]]], dtype: torch.dtype
                 ) -> Callable[..., Any]:
    """ATen's choice: the first largest tap, the last NaN; if every tap in the input is
    -inf, the first tap in the input."""

    def inner_fn(idx: Sequence[Expr]) -> Any:
        taps = loads(idx)
        first = None
        for _, mask, pos in reversed(taps):
            here = ops.index_expr(pos, torch.int64)
            first = here if mask is None or first is None else ops.where(mask, here, first)
        best, chosen = ops.constant(float("-inf"), dtype), first
        for value, _, pos in taps:
            take = ops.logical_or(ops.gt(value, best), ops.isnan(value))
            best = ops.where(take, value, best)
            chosen = ops.where(take, ops.index_expr(pos, torch.int64), chosen)
        return chosen

    return inner_fn


@register_lowering(aten.max_pool2d_with_indices)
def max_pool2d_with_indices(x: IRNode, kernel_size: Any, stride: Any = (), padding: Any = 0,
                            dilation: Any = 1, ceil_mode: bool = False) -> Any:
    """Values and indices as two pointwise loops over the output; the indices loop makes
    a kernel only if something reads it (training saves it for the backward)."""
    pool = _unrolled(x, kernel_size, stride, padding, dilation, ceil_mode, values=True)
    dtype = x.get_dtype()
    loads = _window_loads(window_input(x), pool, float("-inf"))
    size = (*x.get_size()[:-2], *pool.out_hw)
    values = Pointwise.create(x.get_device(), dtype, _max_values(loads), size)
    indices = Pointwise.create(x.get_device(), torch.int64, _max_indices(loads, dtype), size)
    return values, indices


def _candidates(win: Window, i: Expr) -> list[tuple[Expr, Any]]:
    """Per tap k: the output position whose tap k is input position ``i`` (as an index
    expression) and the ops-level bool that such a window exists."""
    out = []
    for k in range(win.kernel):
        num = i + win.padding - k * win.dilation
        value = ops.index_expr(num, torch.int64)
        ok = ops.logical_and(ops.ge(value, ops.constant(0, torch.int64)),
                             ops.lt(value, _index(win.out_size * win.stride)))
        if win.stride != 1:
            on_grid = ops.eq(ops.remainder(value, ops.constant(win.stride, torch.int64)),
                             ops.constant(0, torch.int64))
            ok = ops.logical_and(ok, on_grid)
        out.append((FloorDiv(num, win.stride) if win.stride != 1 else num, ok))
    return out


@register_lowering(aten.max_pool2d_with_indices_backward)
def max_pool2d_with_indices_backward(grad: IRNode, x: IRNode, kernel_size: Any, stride: Any,
                                     padding: Any, dilation: Any, ceil_mode: bool,
                                     indices: IRNode) -> Any:
    """Each input element sums the gradients of the windows whose tap at it was chosen:
    a gather over the taps that can reach it, no scatter."""
    pool = _unrolled(x, kernel_size, stride, padding, dilation, ceil_mode)
    for t in (grad, indices):
        if isinstance(t, TensorBox) and t.storage() is not None:
            t.realize()  # read once per tap
    g_load, i_load, width = grad.make_loader(), indices.make_loader(), pool.w.size
    dtype = grad.get_dtype()

    def inner_fn(idx: Sequence[Expr]) -> Any:
        *prefix, h, w = idx
        me = ops.index_expr(h * width + w, torch.int64)
        total = ops.constant(0.0, torch.float32)
        for oh, h_ok in _candidates(pool.h, h):
            for ow, w_ok in _candidates(pool.w, w):
                ok = ops.logical_and(h_ok, w_ok)
                src = [*prefix, oh, ow]
                picked = ops.masked(ok, lambda src=src: ops.eq(i_load(src), me), False)
                g = ops.masked(picked, lambda src=src: ops.to_dtype(g_load(src), torch.float32),
                               0.0)
                total = ops.add(total, g)
        return ops.to_dtype(total, dtype)

    return Pointwise.create(x.get_device(), dtype, inner_fn, x.get_size())


def _avg_divisor(pool: Pool2d, oh: Expr, ow: Expr, count_include_pad: bool,
                 divisor_override: int | None) -> Any:
    """ATen's divisor: the window clipped to the padded input, or to the input itself."""
    if divisor_override:
        return ops.constant(float(divisor_override), torch.float32)
    sizes = []
    for win, o in ((pool.h, oh), (pool.w, ow)):
        start = ops.index_expr(o * win.stride - win.padding, torch.int64)
        end = ops.minimum(ops.add(start, ops.constant(win.kernel, torch.int64)),
                          _index(win.size + win.padding))
        if not count_include_pad:
            start = ops.maximum(start, ops.constant(0, torch.int64))
            end = ops.minimum(end, _index(win.size))
        sizes.append(ops.sub(end, start))
    return ops.to_dtype(ops.mul(sizes[0], sizes[1]), torch.float32)


@register_lowering(aten.avg_pool2d)
def avg_pool2d(x: IRNode, kernel_size: Any, stride: Any = (), padding: Any = 0,
               ceil_mode: bool = False, count_include_pad: bool = True,
               divisor_override: int | None = None) -> Any:
    """The window's sum (masked taps add 0) over ATen's divisor, in fp32."""
    pool = _unrolled(x, kernel_size, stride, padding, 1, ceil_mode, values=True)
    dtype = x.get_dtype()
    loads = _window_loads(window_input(x), pool, 0.0)

    def inner_fn(idx: Sequence[Expr]) -> Any:
        total = ops.constant(0.0, torch.float32)
        for value, _, _ in loads(idx):
            total = ops.add(total, ops.to_dtype(value, torch.float32))
        divisor = _avg_divisor(pool, idx[-2], idx[-1], count_include_pad, divisor_override)
        return ops.to_dtype(ops.truediv(total, divisor), dtype)

    size = (*x.get_size()[:-2], *pool.out_hw)
    return Pointwise.create(x.get_device(), dtype, inner_fn, size)


@register_lowering(aten.avg_pool2d_backward)
def avg_pool2d_backward(grad: IRNode, x: IRNode, kernel_size: Any, stride: Any, padding: Any,
                        ceil_mode: bool, count_include_pad: bool,
                        divisor_override: int | None) -> Any:
    """Each input element sums, over the windows that cover it, the window's gradient
    over its divisor: a gather, as max_pool2d's backward."""
    pool = _unrolled(x, kernel_size, stride, padding, 1, ceil_mode)
    if isinstance(grad, TensorBox) and grad.storage() is not None:
        grad.realize()  # read once per tap
    g_load, dtype = grad.make_loader(), grad.get_dtype()

    def inner_fn(idx: Sequence[Expr]) -> Any:
        *prefix, h, w = idx
        total = ops.constant(0.0, torch.float32)
        for oh, h_ok in _candidates(pool.h, h):
            for ow, w_ok in _candidates(pool.w, w):
                src = [*prefix, oh, ow]
                share = ops.masked(ops.logical_and(h_ok, w_ok), lambda src=src: ops.truediv(
                    ops.to_dtype(g_load(src), torch.float32),
                    _avg_divisor(pool, src[-2], src[-1], count_include_pad,
                                 divisor_override)), 0.0)
                total = ops.add(total, share)
        return ops.to_dtype(total, dtype)

    return Pointwise.create(x.get_device(), dtype, inner_fn, x.get_size())


def _adaptive_windows(x: IRNode, output_size: Any) -> tuple[int, int] | None:
    """The (height, width) stride of an adaptive average pooling whose windows are all
    alike (the input divisible by the output: then stride == kernel, as ATen's own
    shortcut takes it); None for a global pooling (1 x 1), where the answer is a mean."""
    out = _pair(output_size)
    if out == (1, 1):
        return None
    size = x.get_size()
    if len(size) not in (3, 4) or not all(isinstance(s, (int, sympy.Integer))
                                          for s in size[-2:]):
        raise EagerInstead("adaptive pooling over a symbolic height or width")
    h, w = int(size[-2]), int(size[-1])
    if h % out[0] or w % out[1]:
        raise EagerInstead("adaptive windows of different lengths")
    return h // out[0], w // out[1]


@register_lowering(aten._adaptive_avg_pool2d)
def adaptive_avg_pool2d(x: IRNode, output_size: Any) -> Any:
    """A global pooling (1 x 1) is a mean over height and width, accumulated in fp32 (one
    reduction, whatever the window); windows all alike are an average pooling."""
    stride = _adaptive_windows(x, output_size)
    if stride is None:
        from .reductions import mean

        return mean(x, [-2, -1], keepdim=True)
    return avg_pool2d(x, list(stride), list(stride))


@register_lowering(aten._adaptive_avg_pool2d_backward)
def adaptive_avg_pool2d_backward(grad: IRNode, x: IRNode) -> Any:
    """Each input element gets its one window's gradient over the window's size."""
    stride = _adaptive_windows(x, grad.get_size()[-2:])
    if stride is not None:
        return avg_pool2d_backward(grad, x, list(stride), list(stride), 0, False, True, None)
    *_, h, w = x.get_size()
    g_load, dtype = grad.make_loader(), grad.get_dtype()

    def inner_fn(idx: Sequence[Expr]) -> Any:
        g = ops.to_dtype(g_load([*idx[:-2], sympy.Integer(0), sympy.Integer(0)]),
                         torch.float32)
        return ops.to_dtype(ops.truediv(g, ops.to_dtype(_index(h * w), torch.float32)), dtype)

    return Pointwise.create(x.get_device(), dtype, inner_fn, x.get_size())
