"""Matmuls as Triton GEMM templates (max-autotune): the problem a matmul poses, the
prologue casts folded into the template's loads, and the ``GemmTemplateBuffer`` made
where the graph's selection picked a template config (else the extern call stays)."""

from __future__ import annotations

import torch
import torch.fx

from ..ir.extern import realize_input
from ..ir.layout import FixedLayout, contiguous_strides
from ..ir.nodes import Buffer, IRNode, ReinterpretView, TensorBox
from ..ir.sym import sympify_tuple
from ..ir.template import GemmProblem, GemmTemplateBuffer, current_selection, dtype_name
from ..virtualized import V

aten, prims = torch.ops.aten, torch.ops.prims

TEMPLATE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CASTS = (prims.convert_element_type.default, aten._to_copy.default)
# Ops after which the product is read by pointwise work that can fuse into the store.
_EPILOGUE_OPS = (aten.addmm.default, aten.baddbmm.default)
_VIEWS = (aten.view.default, aten._unsafe_view.default, aten.reshape.default)


def tuned_matmul(op: str, a: IRNode, b: IRNode, a_arg: int, b_arg: int,
                 library_epilogue: bool = False) -> TensorBox | None:
    """``a @ b`` (``op`` "mm" or "bmm") as a template buffer, or None for the extern call.

    ``a_arg`` / ``b_arg`` are the positions of ``a`` and ``b`` among the FX node's
    arguments: a cast that produced them is folded into the template's loads.
    ``library_epilogue``: the extern call does the node's own pointwise part (a row bias
    added in cuBLASLt's epilogue), so only pointwise consumers make an epilogue.
    """
    selection = current_selection()
    if selection.mode != "max-autotune" or not selection.templates:
        return None
    a, a_dtype = _prologue_source(a, a_arg)
    b, b_dtype = _prologue_source(b, b_arg)
    dtype = a.get_dtype() if a_dtype is None else a_dtype
    if dtype not in TEMPLATE_DTYPES or (b_dtype or b.get_dtype()) != dtype:
        return None
    ra, rb = _realized(a), _realized(b)
    problem = GemmProblem(
        op, _batch(ra, op), int(ra.get_size()[-2]), int(rb.get_size()[-1]),
        int(ra.get_size()[-1]), dtype_name(dtype), dtype_name(ra.get_dtype()),
        dtype_name(rb.get_dtype()), _strides(ra), _strides(rb),
        _has_epilogue(library_epilogue),
        selection.allow_tf32 and dtype == torch.float32)
    config = selection.choose(problem)
    if config is None:
        return None
    size = sympify_tuple(problem.out_size())
    layout = FixedLayout(ra.get_device(), dtype, size, contiguous_strides(size))
    node = GemmTemplateBuffer(name=None, layout=layout, inputs=[ra, rb], template_name=op,
                              problem=problem, config=config)
    return TensorBox.create(node)


def _prologue_source(x: IRNode, arg: int) -> tuple[IRNode, torch.dtype | None]:
    """The tensor before a float-to-float cast that made ``x`` (and the cast's dtype), so
    the template loads the original and converts in registers; else ``x`` itself."""
    node = V.graph.current_node
    if node is None or arg >= len(node.args):
        return x, None
    producer = node.args[arg]
    if not isinstance(producer, torch.fx.Node) or producer.target not in _CASTS:
        return x, None
    source = V.graph.env.get(producer.args[0]) if producer.args else None
    if not isinstance(source, TensorBox) or not source.get_dtype().is_floating_point:
        return x, None
    if set(producer.kwargs) - {"dtype"} or len(producer.args) > 2:
        return x, None
    if source.get_dtype() not in TEMPLATE_DTYPES or source.get_device() != x.get_device():
        return x, None
    return source, x.get_dtype()


def _realized(x: IRNode) -> Buffer | ReinterpretView:
    real = realize_input(x)
    if isinstance(real, Buffer) and real.is_flexible():
        real.freeze_layout()
    assert isinstance(real, (Buffer, ReinterpretView)), type(real)
    return real


def _batch(x: IRNode, op: str) -> int:
    return int(x.get_size()[0]) if op == "bmm" else 1


def _strides(x: Buffer | ReinterpretView) -> tuple[int, int, int]:
    stride = [int(s) for s in (x.layout.stride if isinstance(x, ReinterpretView)
                               else x.get_layout().stride)]
    size = [int(s) for s in x.get_size()]
    # A size-1 dimension's stride never moves a pointer: 0 keeps equal problems equal.
    stride = [0 if n == 1 else s for s, n in zip(stride, size)]
    return (stride[0], stride[1], stride[2]) if len(stride) == 3 else (0, stride[0], stride[1])


def _has_epilogue(library_epilogue: bool) -> bool:
    """Whether pointwise work follows the product that a template's store absorbs and
    the extern call leaves to a kernel of its own: the node's own (addmm's scaled or 2-D
    bias), or consumers that are all pointwise."""
    node = V.graph.current_node
    if node is None:
        return False
    if node.target in _EPILOGUE_OPS and not library_epilogue:
        return True
    return _feeds_pointwise(node)


def _feeds_pointwise(node: torch.fx.Node) -> bool:
    users = list(node.users)
    return bool(users) and all(
        _feeds_pointwise(u) if u.target in _VIEWS else _is_pointwise(u) for u in users)


def _is_pointwise(node: torch.fx.Node) -> bool:
    """A pointwise op, or a dtype cast (16-bit activations run in fp32 after one)."""
    if node.op != "call_function":
        return False
    if node.target in _CASTS:
        return not set(node.kwargs) - {"dtype"}
    return torch.Tag.pointwise in getattr(node.target, "tags", ())
