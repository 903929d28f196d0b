"""GraphLowering: an FX interpreter that turns an ATen graph into loop-level IR.

Placeholders become ``InputBuffer``s, every ``call_function`` goes through the
``lowerings`` registry (ops with no lowering become ``FallbackKernel``s), and the
outputs are realized and pinned. ``register_buffer`` is the one place buffers are named.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence
from typing import Any

import sympy
import torch
import torch.fx

from .errors import LoweringError, MalformedGraphError
from .ir.extern import _MATMULS, ExternKernel, make_fallback_call, realize_input
from .ir.layout import FixedLayout, FlexibleLayout, MutationLayout, contiguous_strides
from .ir.nodes import (
    Buffer,
    ComputedBuffer,
    ConstantBuffer,
    InputBuffer,
    IRNode,
    Pointwise,
    Reduction,
    ReinterpretView,
    StorageBox,
    TensorBox,
    as_storage_and_layout,
)
from .ir.sym import sympify_tuple
from .ir.template import GemmSelection
from .lowering import lowerings
from .lowering.fallbacks import EagerInstead, eager_reason, effectful_lowerings
from .lowering.symbolic import SYMBOLIC_OPS
from .sizevars import SizeVars, SymbolicTensor
from .virtualized import V

log = logging.getLogger("kiln.graph")

# A value with several users stays a closure unless it reads more than this many buffers.
REALIZE_READS_THRESHOLD = 4


class GraphLowering(torch.fx.Interpreter):
    """Lower ``gm`` (an ATen FX graph) for inputs shaped like ``example_inputs``."""

    def __init__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                 name: str = "graph", options: dict[str, Any] | None = None,
                 target: dict[str, Any] | None = None, sizevars: SizeVars | None = None
                 ) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.name = name
        self.options = dict(options or {})  # compile options lowerings read (deterministic)
        self.target = dict(target or {})  # the machine, where lowering depends on it (SMs)
        self.sizevars = sizevars or SizeVars()
        # size symbol -> how the wrapper reads it from the inputs (``arg0_1.size(0)``)
        self.symbol_sources: dict[sympy.Symbol, str] = {}
        self.example_inputs = list(example_inputs)
        self.buffers: list[Buffer] = []
        self.name_to_buffer: dict[str, Buffer] = {}
        self.graph_inputs: dict[str, TensorBox] = {}
        self.graph_input_names: list[str] = []
        self.constants: dict[str, torch.Tensor] = {}
        self.graph_outputs: list[IRNode] = []
        self.mutated_inputs: dict[str, str] = {}  # input name -> buffer that writes it
        self.lazy_readers: dict[str, list[TensorBox]] = {}
        self.default_device = self._default_device()
        self.current_node: torch.fx.Node | None = None
        # Nodes run eagerly inside the compiled graph (FallbackKernels), and why.
        self.fallback_reasons: dict[str, str] = {}
        self.gemm_selection = GemmSelection()  # how matmuls lower (the driver sets it)

    def _default_device(self) -> torch.device:
        """The graph's device: the target's kind where a target is given (a graph that
        makes CUDA tensors from sizes alone has no CUDA input), else a GPU input's, else
        the first tensor input's (a CPU scalar tensor beside GPU ones is a CPU scalar)."""
        if self.target.get("kind") == "cuda":
            return torch.device("cuda")
        devices = [torch.device(t.device.type) for t in self.example_inputs
                   if isinstance(t, (torch.Tensor, SymbolicTensor))]
        return next((d for d in devices if d.type == "cuda"), devices[0] if devices
                    else torch.device("cpu"))

    # -- buffer registry ------------------------------------------------------------

    def register_buffer(self, buffer: Buffer) -> str:
        """Name ``buffer`` ``buf<N>`` and make it visible to the scheduler and wrapper."""
        name = f"buf{len(self.buffers)}"
        self.buffers.append(buffer)
        self.name_to_buffer[name] = buffer
        return name

    def get_buffer(self, name: str) -> Buffer:
        if name in self.name_to_buffer:
            return self.name_to_buffer[name]
        box = self.graph_inputs[name]
        storage = box.storage()
        assert storage is not None and isinstance(storage.data, Buffer)
        return storage.data

    def get_dtype(self, name: str) -> torch.dtype:
        return self.get_buffer(name).get_dtype()

    def get_output_names(self) -> list[str]:
        names = []
        for out in self.graph_outputs:
            if isinstance(out, (Buffer, ReinterpretView)):
                names.append(out.get_name())
        return names

    # -- FX interpreter hooks -------------------------------------------------------

    def run(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        with V.set_graph_handler(self):
            result = super().run(*self.example_inputs)
        self.check_symbol_sources()
        return result

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        example = super().placeholder(target, args, kwargs)
        name = self.current_node.name if self.current_node is not None else str(target)
        if isinstance(example, sympy.Expr):  # a SymInt input: the wrapper receives it
            self._add_symbol_source(example, name)
            self.graph_input_names.append(name)
            return example
        if not isinstance(example, (torch.Tensor, SymbolicTensor)):
            return example  # a Python scalar input is baked into the graph
        size, stride = sympify_tuple(example.shape), sympify_tuple(example.stride())
        offset = sympy.sympify(example.storage_offset())
        for d, s in enumerate(size):
            self._add_symbol_source(s, f"{name}.size({d})")
        for d, s in enumerate(stride):
            self._add_symbol_source(s, f"{name}.stride({d})")
        self._add_symbol_source(offset, f"{name}.storage_offset()")
        layout = FixedLayout(torch.device(example.device.type), example.dtype, size, stride,
                             offset)
        box = TensorBox.create(InputBuffer(name=name, layout=layout))
        self.graph_inputs[name] = box
        self.graph_input_names.append(name)
        if layout.device.type == "cpu" and self.default_device.type != "cpu":
            return self._on_device(box)
        return box

    def _on_device(self, box: TensorBox) -> Any:
        """A CPU tensor input of a GPU graph (eager's CPU scalar: ``x * torch.tensor(2.)``),
        copied to the graph's device once at the start of a call: the graph's kernels
        read device memory only."""
        from .ir.extern import make_fallback_call

        return make_fallback_call(torch.ops.aten._to_copy.default, [box],
                                  {"device": self.default_device})

    def _add_symbol_source(self, expr: sympy.Expr, source: str) -> None:
        if isinstance(expr, sympy.Symbol) and expr not in self.symbol_sources:
            self.symbol_sources[expr] = source

    def check_symbol_sources(self) -> None:
        """Every size symbol must be readable from an input as it is (not only inside an
        expression such as a stride ``2*s0``): the wrapper computes sizes from them."""
        missing = [s for s in self.sizevars.symbols if s not in self.symbol_sources]
        if missing:
            raise LoweringError(f"size symbols {missing} appear in no input size as such",
                                node="inputs", op="placeholder", graph=self.name)

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        value = super().get_attr(target, args, kwargs)
        if not isinstance(value, torch.Tensor):
            return value
        name = f"_tensor_constant{len(self.constants)}"
        self.constants[name] = value
        # ``load`` puts every constant on the graph's device, so that is where it lives
        # (a CPU constant of a GPU graph labelled CPU made its ``type_as`` a device change,
        # run eagerly: DeBERTa-v2's mask fill value).
        layout = FixedLayout(torch.device(self.default_device.type), value.dtype,
                             sympify_tuple(value.shape), sympify_tuple(value.stride()))
        box = TensorBox.create(ConstantBuffer(name=name, layout=layout))
        self.graph_inputs[name] = box
        return box

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        node = self.current_node
        node_name = node.name if node is not None else "?"
        if target is operator.getitem and isinstance(args[0], (list, tuple)):
            return args[0][args[1]]
        if target in SYMBOLIC_OPS:  # size arithmetic (SymInt inputs, sym_size)
            return self._lower(SYMBOLIC_OPS[target], target, args, kwargs, node_name)
        if target in effectful_lowerings:
            return self._lower(effectful_lowerings[target], target, args, kwargs, node_name)
        if not isinstance(target, torch._ops.OpOverload):
            raise MalformedGraphError(
                f"call_function target {_target_name(target)} is not an ATen op: trace "
                "the function with AOTAutograd (or make_fx) so that only ATen ops remain",
                node=node_name, op=_target_name(target), graph=self.name)
        reason = eager_reason(target, args, kwargs, node)
        if reason is None:
            try:
                return lowerings[target](*args, **kwargs)
            except EagerInstead as e:  # the lowering chose ATen's kernel here
                reason = str(e)
            except Exception as e:  # noqa: BLE001 - the op runs eagerly instead
                reason = f"its lowering failed: {type(e).__name__}: {e}"
                log.warning("kiln: graph %s, node %s: %s; running %s eagerly inside the "
                            "compiled graph", self.name, node_name, reason, target)
        log.debug("node %s (%s) runs eagerly inside the graph: %s", node_name, target, reason)
        self.fallback_reasons[node_name] = f"{target}: {reason}"
        return self._lower(lambda *a, **k: make_fallback_call(target, a, k), target,
                           args, kwargs, node_name)

    def _lower(self, fn: Any, target: Any, args: Any, kwargs: Any, node_name: str) -> Any:
        try:
            return fn(*args, **kwargs)
        except LoweringError:
            raise
        except Exception as e:
            raise LoweringError(f"lowering failed: {type(e).__name__}: {e}", node=node_name,
                                op=str(target), graph=self.name) from e

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        raise MalformedGraphError("call_module in an ATen graph: trace it with AOTAutograd",
                                  node=self._node_name(), op=f"call_module {target}",
                                  graph=self.name)

    def call_method(self, target: Any, args: Any, kwargs: Any) -> Any:
        raise MalformedGraphError("call_method in an ATen graph: trace it with AOTAutograd",
                                  node=self._node_name(), op=f"call_method {target}",
                                  graph=self.name)

    def output(self, target: Any, args: Any, kwargs: Any) -> Any:
        outs = _flatten(args[0])
        metas = self._output_metas()
        for i, value in enumerate(outs):
            if isinstance(value, IRNode):
                self.graph_outputs.append(self._realize_output(value, metas[i]))
            else:
                self.graph_outputs.append(value)
        return outs

    def _output_metas(self) -> list[Any]:
        fx_graph = self.module.graph
        assert isinstance(fx_graph, torch.fx.Graph)
        out_node = next(n for n in fx_graph.nodes if n.op == "output")
        arg = _flatten(out_node.args[0])
        return [a.meta.get("val") if isinstance(a, torch.fx.Node) else None for a in arg]

    def _realize_output(self, value: IRNode, meta: Any) -> IRNode:
        """Realize an output with the strides eager gives it, when it owns its storage."""
        if isinstance(value, TensorBox):
            storage = value.storage()
            if (storage is not None and not storage.is_realized()
                    and value.data is storage and isinstance(meta, torch.Tensor)):
                storage.realize()
                buf = storage.data
                assert isinstance(buf, Buffer)
                if _is_dense(meta) and buf.is_flexible():
                    buf.freeze_layout(sympify_tuple(meta.stride()))
        out = realize_input(value)
        if isinstance(meta, torch.Tensor) and _is_dense(meta) and _owned_by_graph(out) \
                and not _same_strides(out, meta) and not (
                    self.options.get("padded_outputs") and _padded_matmul_rows(out, meta)):
            # A buffer laid out for speed is returned as eager lays it out. Where every
            # output goes to the user (``padded_outputs``: an inference graph), a padded
            # matmul's rows stay padded, as Inductor returns them: the copy is a pass over
            # the whole output (GPT-2's logits). A forward graph's outputs may be saved
            # for a backward compiled for eager's strides: those are copied.
            return _strided_copy(out, sympify_tuple(meta.stride()))
        return out

    def run_node(self, n: torch.fx.Node) -> Any:
        self.current_node = n
        try:
            result = super().run_node(n)
        except (LoweringError, MalformedGraphError):
            raise
        except Exception as e:
            raise LoweringError(f"{type(e).__name__}: {e}", node=n.name, op=str(n.target),
                                graph=self.name) from e
        if n.op == "call_function" and isinstance(result, TensorBox):
            self._realize_if_needed(n, result)
            self._track_lazy_reads(result)
        return result

    # -- realization triggers ---------------------------------------------------------

    def _realize_if_needed(self, n: torch.fx.Node, result: TensorBox) -> None:
        """Realize a value whose inlining into several users would recompute too much."""
        storage = result.storage()
        if storage is None or storage.is_realized() or len(n.users) < 2:
            return
        reduction_users = sum(1 for u in n.users if _is_reduction_target(u.target))
        if reduction_users >= 2 or storage.num_reads() > REALIZE_READS_THRESHOLD:
            storage.realize()

    def _track_lazy_reads(self, result: TensorBox) -> None:
        storage = result.storage()
        if storage is None or storage.is_realized():
            return
        from .dependencies import extract_read_writes

        assert isinstance(storage.data, (Pointwise, Reduction))
        for name in extract_read_writes(storage.data).read_names():
            self.lazy_readers.setdefault(name, []).append(result)

    def mutate_input(self, dst: IRNode, src: IRNode) -> IRNode:
        """Write ``src`` into the storage of graph input ``dst`` (a ``copy_``)."""
        found = as_storage_and_layout(dst)
        if found is None or not isinstance(found[0], InputBuffer):
            raise LoweringError("copy_ into something that is not a graph input",
                                node=self._node_name(), op="aten.copy_", graph=self.name)
        target, layout = found
        # Lazy readers of the old value must read it before it is overwritten.
        for reader in self.lazy_readers.pop(target.get_name(), []):
            reader.realize()
        load = src.make_loader()
        mut_layout = MutationLayout(layout.device, layout.dtype, layout.size, layout.stride,
                                    layout.offset, target=target.get_name())
        data = Pointwise(src.get_device(), src.get_dtype(), load, tuple(dst.get_size()))
        box = TensorBox(StorageBox(data))
        storage = box.storage()
        assert storage is not None
        storage.realize()
        buf = storage.data
        assert isinstance(buf, ComputedBuffer)
        buf.layout = mut_layout
        self.mutated_inputs[target.get_name()] = buf.get_name()
        return box

    def _node_name(self) -> str:
        return self.current_node.name if self.current_node is not None else "?"

    def finalize_layouts(self) -> None:
        """Decide every layout still flexible (contiguous) before scheduling."""
        for buf in self.buffers:
            if isinstance(buf.layout, FlexibleLayout):
                buf.freeze_layout(contiguous_strides(buf.layout.size))


def _target_name(target: Any) -> str:
    """A readable name for an FX target: ``aten.add.Tensor``, ``module.<lambda>``."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None)
    if qualname is None:
        return repr(target)
    module = getattr(target, "__module__", None)
    return f"{module}.{qualname}" if module else str(qualname)


def _flatten(value: Any) -> list[Any]:
    """Nested lists and tuples of outputs, flattened in order (None entries kept)."""
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _flatten(item)]
    return [value]


def _strided_copy(out: IRNode, stride: Sequence[sympy.Expr]) -> Buffer:
    """``out`` copied into a buffer with ``stride``: a kernel, or for values no kernel
    can type (complex: an FFT's output the fallback laid out otherwise than the trace),
    an eager clone that the wrapper lays out (``as_layout``)."""
    if out.get_dtype().is_complex:
        box = make_fallback_call(torch.ops.aten.clone.default, [out], {})
        buf = box.storage().data  # type: ignore[union-attr]
        assert isinstance(buf, Buffer)
        lay = buf.get_layout()
        buf.layout = FixedLayout(lay.device, lay.dtype, lay.size, tuple(stride))
        return buf
    copy = TensorBox.create(Pointwise(out.get_device(), out.get_dtype(), out.make_loader(),
                                      tuple(out.get_size())))
    copy.realize()
    buf = copy.storage().data  # type: ignore[union-attr]
    assert isinstance(buf, Buffer)
    buf.freeze_layout(tuple(stride))
    return buf


def _owned_by_graph(node: IRNode) -> bool:
    buf = node.data if isinstance(node, ReinterpretView) else node
    return isinstance(buf, Buffer) and not isinstance(buf, InputBuffer)


def _same_strides(node: IRNode, meta: torch.Tensor) -> bool:
    stride = node.layout.stride if isinstance(node, ReinterpretView) else \
        node.get_layout().stride  # type: ignore[attr-defined]
    return all(int(a) == b or n == 1 for a, b, n in zip(stride, meta.stride(), meta.shape))


def _padded_matmul_rows(node: IRNode, meta: torch.Tensor) -> bool:
    """True when ``node`` views a library matmul's output whose rows were widened to an
    aligned stride (``_padded_matmul``), where eager's output is contiguous."""
    if not (isinstance(node, ReinterpretView) and isinstance(node.data, ExternKernel)
            and (node.data.op_overload in _MATMULS
                 or node.data.op_overload is torch.ops.aten.addmm.default)
            and meta.is_contiguous() and meta.dim() >= 2):
        return False
    sizes, row = list(meta.shape), int(node.layout.stride[-2])
    if not sizes[-1] < row < sizes[-1] + 16:
        return False
    expected = [1, row]
    for size in reversed(sizes[1:-1]):
        expected.append(expected[-1] * size)
    return all(int(a) == b or n == 1 for a, b, n in
               zip(node.layout.stride, reversed(expected), sizes))


def _is_dense(t: torch.Tensor) -> bool:
    """True when strides are a permutation of dense strides (no gaps, no overlap)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


_REDUCTION_TARGETS = {"sum", "prod", "amax", "amin", "argmax", "argmin", "any", "all", "mean",
                      "var_mean", "var", "max", "min", "std", "std_mean", "logsumexp"}


def _is_reduction_target(target: Any) -> bool:
    name = getattr(target, "__name__", "")
    return name.split(".")[0] in _REDUCTION_TARGETS
