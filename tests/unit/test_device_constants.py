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


def test_cpu_constant_of_a_gpu_graph_is_read_by_its_kernel() -> None:
    """``x * const.type_as(x)`` in a CUDA graph whose constant was captured on the CPU:
    ``load`` puts the constant on the GPU, so its copy to the GPU is a dtype cast fused into
    the multiply, not an eager ``_to_copy`` (DeBERTa-v2's one eager op on the H100)."""
    from kiln.compiler.driver import compile_graph

    aten = torch.ops.aten
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    const = graph.get_attr("_c")
    cast = graph.call_function(aten._to_copy.default, (const,),
                               {"dtype": torch.float16, "device": torch.device("cuda", 0)})
    graph.output((graph.call_function(aten.mul.Tensor, (x, cast)),))
    root = torch.nn.Module()
    root._c = torch.tensor(float(torch.randint(2, 9, ()).item()))
    with FakeTensorMode():
        inputs = [torch.empty(64, 64, dtype=torch.float16, device="cuda")]
    compiled = compile_graph(torch.fx.GraphModule(root, graph), inputs, {},
                             compile_kernels=False)
    assert compiled.stats.get("fallback_ops", {}) == {}
    assert "_to_copy" not in compiled.wrapper_source
    assert [k.backend for k in compiled.kernels] == ["triton"]
    (launch,) = [ln for ln in compiled.wrapper_source.splitlines() if ".run(" in ln]
    assert "_tensor_constant0" in launch
