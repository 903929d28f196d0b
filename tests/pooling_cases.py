"""Pooling cases shared by the CPU (IR interpreter, C++) and Triton-interpreter tests:
every window parameter Kiln unrolls (padding, stride, dilation, ceil_mode, rectangular
windows, 3-d inputs, channels-last), inputs with ties (ATen picks the first), NaN (a NaN
in the window wins, the last one's index) and -inf, in fp32, fp16 and bf16."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class PoolCase:
    """``F.max_pool2d`` (with indices) over an input of ``shape`` made by ``make``."""

    name: str
    shape: tuple[int, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    make: str = "randn"  # randn | ties | nan | neginf
    channels_last: bool = False

    def inputs(self, dtype: torch.dtype) -> list[torch.Tensor]:
        x = torch.randn(self.shape)
        if self.make == "ties":
            x = (x * 2).round()  # few distinct values: windows hold equal maxima
        elif self.make == "nan":
            x[torch.rand(self.shape) < 0.1] = float("nan")
        elif self.make == "neginf":
            x[torch.rand(self.shape) < 0.6] = float("-inf")
        x = x.to(dtype)
        if self.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        return [x]

    @property
    def fn(self) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """The pooling with values and indices (a plain function: make_fx traces it)."""
        kwargs = self.kwargs

        def pool(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return F.max_pool2d(x, return_indices=True, **kwargs)  # type: ignore[no-any-return]

        return pool


RESNET = {"kernel_size": 3, "stride": 2, "padding": 1}
MAX_POOL_CASES = [
    PoolCase("resnet_stem", (2, 3, 12, 12), RESNET),
    PoolCase("resnet_stem_channels_last", (2, 5, 12, 11), RESNET, channels_last=True),
    PoolCase("k2_s2", (2, 3, 8, 10), {"kernel_size": 2}),
    PoolCase("dilation", (1, 2, 11, 12), {"kernel_size": 3, "stride": 1, "padding": 1,
                                          "dilation": 2}),
    PoolCase("ceil_mode", (2, 2, 10, 9), {"kernel_size": 3, "stride": 2, "ceil_mode": True}),
    PoolCase("ceil_mode_padded", (1, 3, 8, 9), {"kernel_size": 3, "stride": 2, "padding": 1,
                                                "ceil_mode": True}),
    PoolCase("rectangular", (2, 2, 9, 10), {"kernel_size": (2, 3), "stride": (1, 2),
                                            "padding": (1, 0)}),
    PoolCase("three_d_input", (3, 9, 9), RESNET),
    PoolCase("ties", (2, 3, 10, 10), RESNET, make="ties"),
    PoolCase("nan", (2, 3, 10, 10), RESNET, make="nan"),
    PoolCase("neginf", (2, 3, 10, 10), RESNET, make="neginf"),
]


def case_id(item: tuple[PoolCase, torch.dtype]) -> str:
    case, dtype = item
    return f"{case.name}-{str(dtype).removeprefix('torch.')}"


def expand_cases(cases: list[PoolCase] = MAX_POOL_CASES
                 ) -> list[tuple[PoolCase, torch.dtype]]:
    return [(c, d) for c in cases for d in FLOATS]


# avg_pool2d's (kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)
AVG_POOL_PARAMS: dict[str, tuple[Any, ...]] = {
    "resnet_like": (3, 2, 1, False, True, None),
    "exclude_pad": (3, 2, 1, False, False, None),
    "ceil_mode": (3, 2, 1, True, True, None),
    "ceil_mode_exclude_pad": ((3, 2), (2, 1), (1, 1), True, False, None),
    "divisor_override": (2, 2, 0, False, True, 3),
}


def avg_pool_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    k, s, p, ceil, include_pad, divisor = AVG_POOL_PARAMS[name]
    return lambda x: F.avg_pool2d(x, k, s, p, ceil, include_pad, divisor)


def avg_pool_backward_fn(name: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    k, s, p, ceil, include_pad, divisor = AVG_POOL_PARAMS[name]
    pair = lambda v: [v, v] if isinstance(v, int) else list(v)  # noqa: E731
    return lambda g, x: torch.ops.aten.avg_pool2d_backward(
        g, x, pair(k), pair(s), pair(p), ceil, include_pad, divisor)
