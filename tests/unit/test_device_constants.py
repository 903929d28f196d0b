"""A graph's tensor constants are real tensors on its device, even though a backend loads
the graph while Dynamo's FakeTensorMode is on the dispatch-mode stack.

On the H100 host, DeBERTa-v2, torchvision's Swin-T and both detection models failed in
their first call: a 0-d constant (``torch.tensor(mid - 1)``, a mask's fill value) moved to
the GPU at load time under that mode was a fake tensor, with no data pointer (torch's
static launcher crashed on it; Triton's launcher refused it). On the CPU a constant needs
no move, which hid it; moving to ``meta`` under the same mode shows it here."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake

from kiln.compiler.compiled_graph import device_constant


def test_constant_moved_under_an_active_fake_mode_is_real() -> None:
    value = torch.randint(-50, 50, ())
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert is_fake(value.to("meta"))  # what a plain move makes here (the failure)
        moved = device_constant(value, torch.device("meta"))
    assert type(moved) is torch.Tensor and not is_fake(moved)
    assert moved.device.type == "meta" and moved.shape == () and moved.dtype == value.dtype


def test_constant_on_its_device_keeps_its_values() -> None:
    value = torch.randn(3, 4)
    with FakeTensorMode(allow_non_fake_inputs=True):
        moved = device_constant(value, torch.device("cpu"))
    assert not is_fake(moved)
    torch.testing.assert_close(moved, value, rtol=0, atol=0)
