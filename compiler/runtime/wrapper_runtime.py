"""Names generated wrappers use: allocation, strided reinterpretation, input alignment."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

empty_strided = torch.empty_strided


def cuda_empty_strided(index: int, fast: Callable[..., torch.Tensor] | None = None,
                       current: Callable[[], int] | None = None) -> Callable[..., torch.Tensor]:
    """The wrapper's ``empty_strided`` for a graph on ``cuda:<index>``: torch's C++ helper
    (what Inductor's wrappers call: no Python argument parser, no dispatcher; about 7 µs
    less per buffer on the H200 host) when that device is the current one, which is the
    device it allocates on; ``torch.empty_strided`` otherwise. ``fast`` and ``current``
    stand in for torch's functions in tests."""
    guards = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
    fast = fast or getattr(guards, "_empty_strided_cuda", None)
    if fast is None:
        return torch.empty_strided
    current = current or torch._C._cuda_getDevice
    slow = torch.empty_strided

    def allocate(size: Sequence[int], stride: Sequence[int], *, device: torch.device,
                 dtype: torch.dtype) -> torch.Tensor:
        if current() == index:
            return fast(size, stride, dtype)
        return slow(size, stride, device=device, dtype=dtype)

    return allocate


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


def as_layout(x: torch.Tensor | None, size: Sequence[int], stride: Sequence[int],
              dtype: torch.dtype | None = None) -> torch.Tensor | None:
    """``x`` itself when a library call returned the layout (and ``dtype``, where given)
    the compiler planned for, else a copy laid out that way (the kernels after it index
    by that layout and read that dtype). An output the library left out (None where the
    meta kernel gave a tensor) stays None."""
    if x is None:
        return x
    if dtype is not None and x.dtype != dtype:
        out = torch.empty_strided(size, stride, dtype=dtype, device=x.device)
        out.copy_(x)
        return out
    if tuple(x.stride()) == tuple(stride) or x.numel() <= 1:
        return x
    if all(a == b or n == 1 for a, b, n in zip(x.stride(), stride, size)):
        return x
    out = torch.empty_strided(size, stride, dtype=x.dtype, device=x.device)
    out.copy_(x)
    return out
