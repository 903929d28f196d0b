"""The one interface of the client's transports to a farm: a ``Farm`` compiles a request
somewhere and returns the compiled graph, or raises ``FarmUnavailable`` (the client then
compiles the graph itself; ``FarmTimeout``: the farm is up, only slow; ``FarmNotUp``: no
farm is up, compile here quietly). ``frontend.transports.modes`` picks the farm a
``KILN_FARM`` value names:

- ``inprocess``: this process, no Ray (``inprocess.InProcessFarm``);
- ``local`` (default): the farm ``kiln farm up`` started, through its gateway
  (``gateway.GatewayFarm``: no Ray here), while it is up; else this process;
- ``embedded``: an embedded Ray started on the first miss (``workers.ray_farm.RayFarm``);
- a Ray address: joined here (``RayFarm``) or from a child process
  (``process.ProcessFarm``: this one never imports Ray); the relayed ones share
  ``relay.RelayFarm``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from kiln.workers.farm_api import FarmNotUp, FarmTimeout, FarmUnavailable

if TYPE_CHECKING:
    from kiln.compiler.compiled_graph import CompiledGraph
    from kiln.compiler.request import CompileRequest

__all__ = ["EMBEDDED", "INPROCESS", "LOCAL", "Farm", "FarmNotUp", "FarmTimeout",
           "FarmUnavailable"]

INPROCESS, LOCAL, EMBEDDED = "inprocess", "local", "embedded"


class Farm(Protocol):
    """Compiles requests somewhere; see the module docstring for the modes."""

    @property
    def description(self) -> str: ...

    def compile(self, key: str, request: CompileRequest, *, timeout: float | None = None,
                delay: float = 0.0) -> CompiledGraph: ...
