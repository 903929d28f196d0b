"""The loop-level IR: lazy loops (Pointwise, Reduction), buffers, and the boxes around them.

A ``TensorBox`` is what a lowering returns. It holds a view chain whose leaf is a
``StorageBox``; the storage holds either a lazy loop (``Pointwise`` / ``Reduction``,
whose ``inner_fn`` is a closure over sympy index expressions) or a realized ``Buffer``.
``StorageBox.realize`` is the only place a ``ComputedBuffer`` is made.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch

from ..virtualized import V, ops
from .layout import FixedLayout, FlexibleLayout, Layout, MultiOutputLayout, strides_for_order
from .sym import Expr, sympify_tuple

Loader = Callable[[Sequence[Expr]], Any]


class IRNode:
    """Base of every IR node: a tensor-valued thing with a size, dtype and device."""

    def get_size(self) -> tuple[Expr, ...]:
        raise NotImplementedError(type(self).__name__)

    def get_dtype(self) -> torch.dtype:
        raise NotImplementedError(type(self).__name__)

    def get_device(self) -> torch.device:
        raise NotImplementedError(type(self).__name__)

    def make_loader(self) -> Loader:
        raise NotImplementedError(type(self).__name__)

    def get_numel(self) -> Expr:
        n: Expr = sympy.Integer(1)
        for s in self.get_size():
            n = n * s
        return n

    def realize(self) -> str | None:
        return None

    def unwrap_storage(self) -> IRNode:
        return self


@dataclass(frozen=True, eq=False)
class Loops(IRNode):
    """A lazy loop nest: ``inner_fn(index)`` computes one element through ``ops``."""

    device: torch.device
    dtype: torch.dtype
    inner_fn: Callable[..., Any]
    ranges: tuple[Expr, ...]

    def get_size(self) -> tuple[Expr, ...]:
        return self.ranges

    def get_dtype(self) -> torch.dtype:
        return self.dtype

    def get_device(self) -> torch.device:
        return self.device

    def get_reduction_size(self) -> tuple[Expr, ...]:
        return ()

    def index_vars(self, prefix: str = "d") -> list[sympy.Symbol]:
        return [sympy.Symbol(f"{prefix}{i}", integer=True, nonnegative=True)
                for i in range(len(self.ranges))]


@dataclass(frozen=True, eq=False)
class Pointwise(Loops):
    """One output element as a function of its index."""

    @classmethod
    def create(cls, device: torch.device, dtype: torch.dtype, inner_fn: Callable[..., Any],
               ranges: Sequence[Expr]) -> TensorBox:
        return TensorBox.create(cls(device, dtype, inner_fn, tuple(ranges)))

    def make_loader(self) -> Loader:
        return self.inner_fn

    def store_output(self, name: str, indexer: Callable[[Sequence[Expr]], Expr],
                     index: Sequence[Expr]) -> None:
        ops.store(name, indexer(index), self.inner_fn(index))


# How a Scatter combines a value with what its target holds: None overwrites.
SCATTER_MODES = (None, "atomic_add", "atomic_max", "atomic_min")


@dataclass(frozen=True, eq=False)
class Scatter(Pointwise):
    """A loop over the *source* of a scatter: element ``index`` goes to the target at
    ``output_indexer(index)`` (an indirect index), combined there by ``scatter_mode``.

    It is realized as a buffer with a ``MutationLayout`` over the target buffer, which a
    separate kernel filled first: a scatter writes elements of the target that other
    iterations (other programs on a GPU) may also write, so it never fuses with the
    target's producer or its readers.
    """

    output_indexer: Callable[[Sequence[Expr]], Sequence[Expr]] = field(default=None)  # type: ignore[assignment]
    scatter_mode: str | None = None

    def store_output(self, name: str, indexer: Callable[[Sequence[Expr]], Expr],
                     index: Sequence[Expr]) -> None:
        value = self.inner_fn(index)
        ops.store(name, indexer(self.output_indexer(index)), value, mode=self.scatter_mode)


@dataclass(frozen=True, eq=False)
class Reduction(Loops):
    """``reduction_type`` over ``reduction_ranges`` of ``inner_fn(index, rindex)``.

    Multi-output reductions (Welford's mean, m2 and weight) are one Reduction per output
    with ``output_index`` set; the backends compute the shared reduction once (CSE).
    """

    reduction_ranges: tuple[Expr, ...] = ()
    reduction_type: str = "sum"
    src_dtype: torch.dtype = torch.float32
    output_index: int | None = None

    def get_reduction_size(self) -> tuple[Expr, ...]:
        return self.reduction_ranges

    def make_loader(self) -> Loader:
        raise RuntimeError("a Reduction is read only after it is realized")

    def store_output(self, name: str, indexer: Callable[[Sequence[Expr]], Expr],
                     index: Sequence[Expr], rindex: Sequence[Expr]) -> None:
        value = ops.reduction(self.dtype, self.src_dtype, self.reduction_type,
                              self.inner_fn(index, rindex))
        if self.output_index is not None:
            value = ops.getitem(value, self.output_index)
        ops.store_reduction(name, indexer(index), value)


@dataclass(eq=False)
class Buffer(IRNode):
    """A named tensor in memory. The name is given by ``register_buffer`` or the graph."""

    name: str | None
    layout: Layout | MultiOutputLayout

    def get_name(self) -> str:
        assert self.name is not None, "buffer used before register_buffer named it"
        return self.name

    def get_layout(self) -> Layout:
        assert isinstance(self.layout, Layout), f"{self.name} has no single layout"
        return self.layout

    def get_size(self) -> tuple[Expr, ...]:
        return self.get_layout().size

    def get_stride(self) -> tuple[Expr, ...]:
        return self.get_layout().stride

    def get_dtype(self) -> torch.dtype:
        return self.get_layout().dtype

    def get_device(self) -> torch.device:
        return self.layout.device

    def make_loader(self) -> Loader:
        # The layout is read when the loader runs, not when it is made: a flexible layout
        # may still be decided (channels-last, eager's output strides) after readers exist.
        name = self.get_name()
        return lambda index: ops.load(name, self.get_layout().make_indexer()(index))

    def freeze_layout(self, stride: Sequence[Expr] | None = None) -> None:
        if isinstance(self.layout, FlexibleLayout):
            self.layout = self.layout.as_fixed(stride)

    def is_flexible(self) -> bool:
        return isinstance(self.layout, FlexibleLayout)

    def get_mutation_names(self) -> list[str]:
        return []

    def __repr__(self) -> str:
        lay = self.layout
        if isinstance(lay, Layout):
            desc = f"{lay.dtype}, size={list(lay.size)}, stride={list(lay.stride)}"
        else:
            desc = "multi-output"
        return f"{type(self).__name__}({self.name}, {desc})"


@dataclass(eq=False, repr=False)
class InputBuffer(Buffer):
    """A graph input: a placeholder of the FX graph."""


@dataclass(eq=False, repr=False)
class ConstantBuffer(InputBuffer):
    """A tensor constant of the graph (a ``get_attr``), passed to ``call`` like an input."""


@dataclass(eq=False, repr=False)
class ComputedBuffer(Buffer):
    """A realized lazy loop: its body writes every element of the buffer."""

    data: Loops = field(default=None)  # type: ignore[assignment]

    def get_reduction_size(self) -> tuple[Expr, ...]:
        return self.data.get_reduction_size()

    def get_reduction_type(self) -> str | None:
        return self.data.reduction_type if isinstance(self.data, Reduction) else None

    def is_reduction(self) -> bool:
        return isinstance(self.data, Reduction)

    def store_body(self) -> Callable[..., None]:
        """The loop body that writes this buffer: ``body(index)`` or ``body(index, rindex)``."""
        indexer = self.get_layout().make_indexer()
        name = self.get_name()
        data = self.data
        if isinstance(data, Reduction):
            return lambda index, rindex: data.store_output(name, indexer, index, rindex)
        assert isinstance(data, Pointwise)
        return lambda index: data.store_output(name, indexer, index)

    def get_mutation_names(self) -> list[str]:
        target = getattr(self.layout, "target", "")
        return [target] if target else []


@dataclass(eq=False, repr=False)
class TemplateBuffer(Buffer):
    """A buffer computed by a kernel template; its reads come from its declared inputs."""

    inputs: list[IRNode] = field(default_factory=list)
    template_name: str = ""

    def __post_init__(self) -> None:
        self.name = V.graph.register_buffer(self)


class _Box(IRNode):
    """A node that stands for the node it holds: size, dtype, device and loads are its."""

    def __init__(self, data: IRNode) -> None:
        self.data = data

    def get_size(self) -> tuple[Expr, ...]:
        return self.data.get_size()

    def get_dtype(self) -> torch.dtype:
        return self.data.get_dtype()

    def get_device(self) -> torch.device:
        return self.data.get_device()

    def make_loader(self) -> Loader:
        return self.data.make_loader()


class StorageBox(_Box):
    """Holds a lazy loop until something realizes it, then the buffer it became."""

    def is_realized(self) -> bool:
        return isinstance(self.data, Buffer)

    def realize(self) -> str | None:
        """Make the lazy loop a ComputedBuffer and register it; no-op if already a buffer."""
        if isinstance(self.data, Buffer):
            return self.data.name
        assert isinstance(self.data, Loops), type(self.data)
        layout = FlexibleLayout.contiguous(
            self.data.get_device(), self.data.get_dtype(), self.data.get_size())
        order = _inherited_stride_order(self.data)
        if order is not None:
            layout = FlexibleLayout(layout.device, layout.dtype, layout.size,
                                    strides_for_order(layout.size, order))
        buf = ComputedBuffer(name=None, layout=layout, data=self.data)
        buf.name = V.graph.register_buffer(buf)
        self.data = buf
        return buf.name

    def unwrap_storage(self) -> IRNode:
        return self.data

    def num_reads(self) -> int:
        if isinstance(self.data, Buffer):
            return 1
        from ..dependencies import extract_read_writes

        assert isinstance(self.data, Loops)
        return len(extract_read_writes(self.data).reads)

    def __repr__(self) -> str:
        return f"StorageBox({self.data!r})"


def _inherited_stride_order(data: Loops) -> list[int] | None:
    """A 4-d pointwise result over a channels-last buffer of its shape is laid out
    channels-last too, so that convolutions around it need no layout conversions. So is
    one that reads no buffer of its shape but a channels-last one of its batch and
    channels (a pooling window: its output keeps its input's layout, as in eager)."""
    if not isinstance(data, Pointwise) or len(data.ranges) != 4:
        return None
    from ..dependencies import extract_read_writes

    layouts = []
    for name in sorted(extract_read_writes(data).read_names()):
        try:
            layout = V.graph.get_buffer(name).layout
        except (KeyError, AssertionError):
            continue
        if isinstance(layout, FixedLayout) and len(layout.size) == 4:
            layouts.append(layout)
    same = [lay for lay in layouts if tuple(lay.size) == tuple(data.ranges)]
    batch_channels = [lay for lay in layouts if tuple(lay.size[:2]) == tuple(data.ranges[:2])]
    for lay in same or batch_channels:
        if is_channels_last(lay.stride, lay.size):
            return CHANNELS_LAST_ORDER
    return None


CHANNELS_LAST_ORDER = [1, 3, 2, 0]  # innermost first: C, W, H, N


def is_channels_last(stride: Sequence[Expr], size: Sequence[Expr]) -> bool:
    if len(stride) != 4 or any(s == 1 for s in size[1:]):
        return False
    return list(stride) == list(strides_for_order(size, CHANNELS_LAST_ORDER))


class TensorBox(_Box):
    """What lowerings return: a view chain (possibly empty) over a StorageBox."""

    @staticmethod
    def create(data: IRNode) -> TensorBox:
        if isinstance(data, (Loops, Buffer)):
            return TensorBox(StorageBox(data))
        return TensorBox(data)

    def storage(self) -> StorageBox | None:
        node = self.data
        while isinstance(node, (View, ReinterpretView)):
            node = node.data
        return node if isinstance(node, StorageBox) else None

    def realize(self) -> str | None:
        storage = self.storage()
        return storage.realize() if storage is not None else None

    def unwrap_storage(self) -> IRNode:
        return self.data.unwrap_storage()

    def __repr__(self) -> str:
        return f"TensorBox({self.data!r})"


@dataclass(eq=False)
class View(IRNode):
    """A view as index remapping: ``reindex`` maps an output index to the base's index."""

    data: IRNode
    size: tuple[Expr, ...]
    reindex: Callable[[Sequence[Expr]], Sequence[Expr]]
    kind: str = "view"

    def get_size(self) -> tuple[Expr, ...]:
        return self.size

    def get_dtype(self) -> torch.dtype:
        return self.data.get_dtype()

    def get_device(self) -> torch.device:
        return self.data.get_device()

    def make_loader(self) -> Loader:
        inner = self.data.make_loader()
        reindex = self.reindex
        return lambda index: inner(reindex(index))

    def __repr__(self) -> str:
        return f"View[{self.kind}]({list(self.size)}, {self.data!r})"


@dataclass(eq=False)
class ReinterpretView(IRNode):
    """A strided view of a realized buffer's storage (no copy, no index remapping)."""

    data: Buffer
    layout: FixedLayout

    def get_size(self) -> tuple[Expr, ...]:
        return self.layout.size

    def get_stride(self) -> tuple[Expr, ...]:
        return self.layout.stride

    def get_dtype(self) -> torch.dtype:
        return self.layout.dtype

    def get_device(self) -> torch.device:
        return self.layout.device

    def get_name(self) -> str:
        return self.data.get_name()

    def make_loader(self) -> Loader:
        indexer = self.layout.make_indexer()
        name = self.data.get_name()
        return lambda index: ops.load(name, indexer(index))

    def __repr__(self) -> str:
        lay = self.layout
        return (f"ReinterpretView({self.data.name}, size={list(lay.size)}, "
                f"stride={list(lay.stride)}, offset={lay.offset})")


def view_chain_reindex(node: IRNode) -> tuple[StorageBox, Callable[[Sequence[Expr]], Any]] | None:
    """The storage under a chain of Views and the composed index map, if there is one."""
    maps: list[Callable[[Sequence[Expr]], Sequence[Expr]]] = []
    while isinstance(node, (TensorBox, View)):
        if isinstance(node, View):
            maps.append(node.reindex)
        node = node.data
    if not isinstance(node, StorageBox):
        return None

    def composed(index: Sequence[Expr]) -> Sequence[Expr]:
        for m in maps:
            index = m(index)
        return index

    return node, composed


_unique = itertools.count()


def fresh_index_vars(n: int, prefix: str = "i") -> list[sympy.Symbol]:
    tag = next(_unique)
    return [sympy.Symbol(f"{prefix}{tag}_{i}", integer=True, nonnegative=True) for i in range(n)]


def as_storage_and_layout(node: IRNode) -> tuple[Buffer, FixedLayout] | None:
    """Express ``node`` as a strided view of a realized buffer, freezing its layout."""
    if isinstance(node, TensorBox):
        node = node.data
    if isinstance(node, ReinterpretView):
        return node.data, node.layout
    found = view_chain_reindex(node)
    if found is None:
        return None
    storage, reindex = found
    if not isinstance(storage.data, Buffer) or not isinstance(storage.data.layout, Layout):
        return None
    buf = storage.data
    size = node.get_size()
    idx = fresh_index_vars(len(size))
    from .sym import combine_div_mod, linear_coefficients, simplify_with_ranges

    base_layout = buf.get_layout()
    flat = base_layout.make_indexer()(list(reindex(idx)))
    # A reshape of a contiguous range splits an index into div and mod parts that fold
    # back into one affine term: (8, 64, 32) over (2, 4, 64, 32) needs no copy.
    flat = combine_div_mod(simplify_with_ranges(sympy.expand(flat), dict(zip(idx, size))))
    lin = linear_coefficients(flat, idx)
    if lin is None:
        return None
    coeffs, offset = lin
    if any(c.is_number and c < 0 for c, n in zip(coeffs, size) if n != 1):
        return None  # a flipped view: torch has no negative strides, so it is a copy
    buf.freeze_layout()
    # A size-1 dim's stride is arbitrary: give it eager's (the next dim's extent).
    strides = list(coeffs)
    for d in reversed(range(len(size))):
        if size[d] == 1:
            strides[d] = strides[d + 1] * size[d + 1] if d + 1 < len(size) else sympy.Integer(1)
    return buf, FixedLayout(buf.get_device(), buf.get_dtype(), sympify_tuple(size),
                            sympify_tuple(strides), offset)
