"""The ``inprocess`` farm, and every client's fallback: the compiler in this process."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kiln.compiler.compiled_graph import CompiledGraph
    from kiln.compiler.request import CompileRequest
    from kiln.workers.pipeline import KernelCache


class InProcessFarm:
    """The ``inprocess`` mode and every client's fallback: this process, no Ray."""

    description = "this process"

    def __init__(self, kernels: KernelCache | None = None) -> None:
        from kiln.workers.pipeline import KernelCache
        from kiln.workers.select import MemoryChoiceCache

        self.kernels = kernels or KernelCache()
        self.choices = MemoryChoiceCache()  # max-autotune's matmul choices
        # Child processes for graph stages (``workers.stage_pool``); set by regional
        # compilation, which compiles several graphs at once.
        self.stages: Any = None

    def attach_store(self, store: Any) -> None:
        """Keep max-autotune's choices in ``store`` too (fleet-wide)."""
        from kiln.workers.select import MemoryChoiceCache, StoreChoiceCache

        self.choices = MemoryChoiceCache(StoreChoiceCache(store))

    def compile(self, key: str, request: CompileRequest, *, timeout: float | None = None,
                delay: float = 0.0, debug_options: dict[str, Any] | None = None
                ) -> CompiledGraph:
        """``debug_options`` (KILN_DEBUG's folder) reach the compiler, not the key."""
        from kiln.workers.pipeline import CompileFailure, compile_inprocess

        try:
            return compile_inprocess(request.to_bytes(), key, cache=self.kernels, delay=delay,
                                     extra_options=debug_options, choices=self.choices,
                                     stages=self.stages)
        except Exception as e:
            raise CompileFailure.wrap(e, key) from e
