"""Names generated wrappers use: allocation, strided reinterpretation, input alignment."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

empty_strided = torch.empty_strided


_GUARDS = getattr(getattr(torch._C, "_dynamo", None), "guards", None)
_EMPTY_STRIDED_CUDA = getattr(_GUARDS, "_empty_strided_cuda", None)
Allocate = Callable[[Sequence[int], Sequence[int], torch.dtype], torch.Tensor]


def cuda_allocator(device: torch.device, fast: Allocate | None = None,
                   current: Callable[[], int] | None = None) -> Allocate:
    """``alloc(size, stride, dtype)`` for one call of a wrapper of a graph on ``device``;
    the wrapper asks once per call, then allocates every buffer with it. When the graph's
    device is the current one (the device it allocates on), that is torch's C++ helper
    itself (what Inductor's wrappers call: no Python frame, argument parser or dispatcher
    per buffer; 134 buffers per encoder training step on the H200 host); otherwise
    ``torch.empty_strided`` on ``device``. ``fast`` and ``current`` stand in for torch's
    functions in tests."""
    if device.type == "cuda":
        fast = fast or _EMPTY_STRIDED_CUDA
        if fast is not None and (device.index is None or
                                 (current or torch._C._cuda_getDevice)() == device.index):
            return fast

    def allocate(size: Sequence[int], stride: Sequence[int], dtype: torch.dtype
                 ) -> torch.Tensor:
        return torch.empty_strided(size, stride, dtype=dtype, device=device)

    return allocate


def _reinterpret_python(x: torch.Tensor, size: Sequence[int], stride: Sequence[int],
                        offset: int) -> torch.Tensor:
    """A view of ``x``'s storage; ``offset`` counts from where ``x`` starts."""
    return x.as_strided(size, stride, x.storage_offset() + offset)


# torch's C++ helper does the same without the dispatcher's overhead, where it exists.
reinterpret_tensor = getattr(_GUARDS, "_reinterpret_tensor", _reinterpret_python)


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
