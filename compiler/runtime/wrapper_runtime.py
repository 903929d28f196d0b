"""Names generated wrappers use: allocation, strided reinterpretation, input alignment."""

from __future__ import annotations

from collections.abc import Sequence

import torch

empty_strided = torch.empty_strided


def _reinterpret_python(x: torch.Tensor, size: Sequence[int], stride: Sequence[int],
                        offset: int) -> torch.Tensor:
    """A view of ``x``'s storage; ``offset`` counts from where ``x`` starts."""
    return x.as_strided(size, stride, x.storage_offset() + offset)


# torch's C++ helper does the same without the dispatcher's overhead, where it exists.
reinterpret_tensor = getattr(getattr(getattr(torch._C, "_dynamo", None), "guards", None),
                             "_reinterpret_tensor", _reinterpret_python)


def align_input(x: torch.Tensor, alignment: int = 16) -> torch.Tensor:
    """``x`` itself when its data pointer is aligned, else a copy of its whole extent."""
    if x.data_ptr() % alignment == 0:
        return x
    extent = 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride())) if x.numel() else 0
    base = x.as_strided((extent,), (1,), x.storage_offset()).clone()
    return base.as_strided(x.shape, x.stride(), 0)


def as_layout(x: torch.Tensor | None, size: Sequence[int], stride: Sequence[int]
              ) -> torch.Tensor | None:
    """``x`` itself when a library call returned the layout the compiler planned for,
    else a copy laid out that way (the kernels after it index by that layout). An output
    the library left out (None where the meta kernel gave a tensor) stays None."""
    if x is None or tuple(x.stride()) == tuple(stride) or x.numel() <= 1:
        return x
    if all(a == b or n == 1 for a, b, n in zip(x.stride(), stride, size)):
        return x
    out = torch.empty_strided(size, stride, dtype=x.dtype, device=x.device)
    out.copy_(x)
    return out
