"""Errors that name what failed: the graph, the stage, the node and the op."""

from __future__ import annotations


class KilnCompileError(RuntimeError):
    """A compile failure, with where it happened."""

    def __init__(self, message: str, *, stage: str, graph: str = "", node: str = "",
                 op: str = "", kernel: str = "") -> None:
        self.stage, self.graph, self.node, self.op, self.kernel = stage, graph, node, op, kernel
        self.reason = message  # without the "(stage ..., kernel ...)" that str() adds
        where = [f"stage {stage}"]
        if graph:
            where.append(f"graph {graph}")
        if node:
            where.append(f"node {node}")
        if op:
            where.append(f"op {op}")
        if kernel:
            where.append(f"kernel {kernel}")
        super().__init__(f"{message} ({', '.join(where)})")


class LoweringError(KilnCompileError):
    """A node of the FX graph could not be lowered."""

    def __init__(self, message: str, *, node: str, op: str, graph: str = "") -> None:
        super().__init__(message, stage="lowering", graph=graph, node=node, op=op)


class MalformedGraphError(KilnCompileError):
    """The FX graph itself is not something Kiln can compile."""

    def __init__(self, message: str, *, node: str = "", op: str = "", graph: str = "") -> None:
        super().__init__(message, stage="graph check", graph=graph, node=node, op=op)
