"""ATen op -> loop-level IR. Importing this package fills the ``lowerings`` registry."""

from . import creation, extern_ops, indexing, pointwise, reductions, scatter, views  # noqa: F401
from .registry import lowerings, make_pointwise, register_lowering, register_pointwise

__all__ = ["lowerings", "make_pointwise", "register_lowering", "register_pointwise"]
