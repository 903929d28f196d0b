"""Fusion rules shared by the loop backends (Triton and C++): a kernel iterates one
(numel, rnumel) space; pointwise work runs inside it before or after the reduction."""

from __future__ import annotations

from typing import Any


class SIMDScheduling:
    """The backend ``can_fuse`` of Kiln's loop backends."""

    def can_fuse_vertical(self, node1: Any, node2: Any) -> bool:
        return self._same_space(node1, node2)

    def can_fuse_horizontal(self, node1: Any, node2: Any) -> bool:
        return self._same_space(node1, node2)

    def can_fuse_siblings(self, node1: Any, node2: Any) -> bool:
        """Two independent reductions in one kernel: the same space, walked in the same
        order (a column reduction next to a row reduction would walk one of them across
        memory)."""
        from .triton.scheduling import is_outer_reduction

        return self._same_space(node1, node2) and \
            is_outer_reduction(node1) == is_outer_reduction(node2)

    def row_column_plan(self, node1: Any, node2: Any) -> Any:
        """A row reduction and a column stage over the same rows in one kernel (GPU
        kernels only: ``codegen/triton/row_column.py``)."""
        from .triton.row_column import row_column_plan

        return row_column_plan(node1, node2)

    def row_column_allows(self, node1: Any, node2: Any) -> bool:
        from .triton.row_column import row_column_allows

        return row_column_allows(node1, node2)

    def _same_space(self, node1: Any, node2: Any) -> bool:
        numel1, rnumel1 = node1.group
        numel2, rnumel2 = node2.group
        red1, red2 = node1.is_reduction(), node2.is_reduction()
        if not red1 and not red2:
            return bool(numel1 == numel2)
        if red1 and red2:
            return bool(numel1 == numel2 and rnumel1 == rnumel2)
        numel_r, rnumel_r = (numel1, rnumel1) if red1 else (numel2, rnumel2)
        numel_p = numel2 if red1 else numel1
        # Pointwise work over the reduction's whole space (inside its loop), or over its
        # output (after the loop).
        return bool(numel_p == numel_r * rnumel_r or numel_p == numel_r)
