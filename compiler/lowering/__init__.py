"""ATen op -> loop-level IR. Importing this package fills the ``lowerings`` registry."""

from . import (  # noqa: F401
    creation,
    extern_ops,
    fallbacks,
    foreach,
    index_views,
    indexing,
    pointwise,
    pooling,
    reductions,
    scatter,
    views,
)
from .registry import lowerings, make_pointwise, register_lowering, register_pointwise

__all__ = ["lowerings", "make_pointwise", "register_lowering", "register_pointwise"]
