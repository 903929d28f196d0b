"""Fusion rules shared by the loop backends (Triton and C++): a kernel iterates one
(numel, rnumel) space; pointwise work runs inside it before or after the reduction."""

from __future__ import annotations

from typing import Any

from ..dependencies import reduction_access_order


class SIMDScheduling:
    """The backend ``can_fuse`` of Kiln's loop backends."""

    def can_fuse_vertical(self, node1: Any, node2: Any) -> bool:
        return self._same_space(node1, node2)

    def can_fuse_horizontal(self, node1: Any, node2: Any) -> bool:
        return self._same_space(node1, node2)

    def can_fuse_siblings(self, node1: Any, node2: Any) -> bool:
        """Two independent reductions that share no buffer in one kernel (see
        ``Scheduler.sibling_reductions``): not by default."""
        return False

    def row_column_plan(self, node1: Any, node2: Any) -> Any:
        """A row reduction and a column stage over the same rows in one kernel: the
        plan ``(row group, parts, column stage names)``, or None (none by default)."""
        return None

    def row_column_allows(self, node1: Any, node2: Any) -> bool:
        return True

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


def is_outer_reduction(node: Any) -> bool:
    """True when the reduced dimension is strided in memory and x is the contiguous one,
    judged by the reductions' reads (a column sum of a row-major matrix)."""
    inner = outer = 0
    for sub in node.get_nodes():
        if not sub.is_reduction():
            continue
        i, o = _access_order(sub)
        inner, outer = inner + i, outer + o
    return outer > inner


def _access_order(sub: Any) -> tuple[int, int]:
    """``reduction_access_order`` of a scheduler node's reads, kept on the node while its
    reads stay the same object: fusion asks it of the same nodes for every candidate pair
    (sympy coefficient work: seconds per large graph when recomputed)."""
    rw = sub.read_writes
    cached = getattr(sub, "_access_order", None)
    if cached is not None and cached[0] is rw:
        return cached[1]
    order = reduction_access_order(rw, len(sub.get_ranges()[0]))
    sub._access_order = (rw, order)
    return order
