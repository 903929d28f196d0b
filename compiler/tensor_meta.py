"""Tensor metadata of requests and packages (``TensorMeta``): shapes, strides, dtype,
device type and offset, as plain ints or, with dynamic shapes, sympy expressions over the
canonical size symbols. Apart from ``request`` so that loading a static package imports
no sympy (about a second of a package's first output on a slow host): the symbolic paths
import it when they meet a symbolic size."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .symwire import SymbolTable

# Bounds on tensor metadata from a request: a constant's storage is allocated for real.
MAX_RANK = 16
MAX_DIM = 2**40


class SerializationError(Exception):
    """A graph or request cannot be encoded or decoded canonically."""



def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_attr(name: str, kind: type, what: str) -> Any:
    value = getattr(torch, name, None)
    if not isinstance(value, kind):
        raise SerializationError(f"unknown {what} {name!r}")
    return value


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``."""
    return _torch_attr(name, torch.dtype, "dtype")


def _storage_numel(shape: Sequence[int], stride: Sequence[int], offset: int) -> int:
    """Elements a storage needs to hold a view of this shape, stride and offset."""
    if any(size == 0 for size in shape):
        return offset
    return offset + 1 + sum((size - 1) * step for size, step in zip(shape, stride))


@dataclass(frozen=True)
class TensorMeta:
    """What a compiled graph may depend on about one tensor: never its values.

    In a graph with dynamic shapes, sizes, strides and the offset may be sympy
    expressions over the canonical size symbols ``s0, s1, ...`` (never their values).
    """

    shape: tuple[Any, ...]
    stride: tuple[Any, ...]
    dtype: str
    device_type: str
    storage_offset: Any

    @classmethod
    def from_tensor(cls, t: torch.Tensor, symbols: SymbolTable | None = None) -> TensorMeta:
        """Metadata of a real, fake or meta tensor; the device ordinal is dropped.

        Symbolic sizes need ``symbols``, which names them canonically (and grows)."""
        raw = (*t.shape, *t.stride(), t.storage_offset())
        if not all(isinstance(s, int) for s in raw):
            from .request import _canonical_sizes, _shape_env, _size_expr
            from .symwire import SymbolicSizeError

            if symbols is None:
                raise SerializationError(
                    f"tensor with symbolic sizes {tuple(t.shape)} outside a dynamic request")
            try:
                sizes = _canonical_sizes([_size_expr(v) for v in raw], symbols, _shape_env(raw))
            except SymbolicSizeError as exc:
                raise SerializationError(str(exc)) from exc
        else:
            sizes = tuple(int(s) for s in raw)
        n = t.dim()
        return cls(shape=tuple(sizes[:n]), stride=tuple(sizes[n:2 * n]),
                   dtype=_dtype_name(t.dtype), device_type=t.device.type,
                   storage_offset=sizes[2 * n])

    @property
    def is_symbolic(self) -> bool:
        return not all(isinstance(v, int) for v in (*self.shape, *self.stride,
                                                    self.storage_offset))

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_name(self.dtype)

    @property
    def storage_numel(self) -> int:
        return _storage_numel(self.shape, self.stride, self.storage_offset)

    def to_wire(self) -> list[Any]:
        return [
            [_encode(v) for v in self.shape],
            [_encode(v) for v in self.stride],
            self.dtype,
            self.device_type,
            _encode(self.storage_offset),
        ]

    @classmethod
    def from_wire(cls, wire: Any, nsymbols: int = 0) -> TensorMeta:
        def size(v: Any) -> Any:
            if isinstance(v, int) and not isinstance(v, bool):
                return v
            from .symwire import decode_expr

            return decode_expr(v, nsymbols)

        try:
            shape, stride, dtype, device_type, offset = wire
            meta = cls(tuple(size(v) for v in shape), tuple(size(v) for v in stride),
                       str(dtype), str(device_type), size(offset))
        except (TypeError, ValueError) as exc:
            raise SerializationError(f"bad tensor metadata {wire!r:.200}") from exc
        # Bounds: rank, and plain sizes, strides and offset as non-negative ints (a
        # symbolic one was bounded by decode_expr: depth, declared symbols, int range).
        numbers = [n for n in (*meta.shape, *meta.stride, meta.storage_offset)
                   if isinstance(n, int)]  # the others came from decode_expr
        if (len(meta.shape) != len(meta.stride) or len(meta.shape) > MAX_RANK
                or not all(type(n) is int and 0 <= n <= MAX_DIM for n in numbers)):
            raise SerializationError(
                f"tensor metadata out of bounds {wire!r:.200}: at most {MAX_RANK} dims, "
                f"sizes, strides and offset integers in [0, {MAX_DIM}]")
        dtype_from_name(meta.dtype)
        return meta


def tensor_wire(t: torch.Tensor, symbols: SymbolTable | None = None) -> list[Any]:
    """``TensorMeta.from_tensor(t, symbols).to_wire()``; for a tensor whose sizes,
    strides and offset are plain ints (every node of a static graph: hundreds per
    request, serialized on every lookup), the same list without building the meta."""
    shape, stride, offset = tuple(t.shape), t.stride(), t.storage_offset()
    if type(offset) is int and all(type(n) is int for n in shape) \
            and all(type(n) is int for n in stride):
        return [list(shape), list(stride), _dtype_name(t.dtype), t.device.type, offset]
    return TensorMeta.from_tensor(t, symbols).to_wire()


def _encode(value: Any) -> Any:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    from .symwire import encode_canonical

    return encode_canonical(value)
