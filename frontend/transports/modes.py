"""Where a miss is compiled: the farm mode named by ``KILN_FARM``.

- ``inprocess``: in this process, no Ray (``workers.pipeline.compile_inprocess``);
- ``local`` (default): the cluster ``kiln farm up`` started, if its address file names
  one that answers now, through its gateway (``workers.serve.gateway``: no Ray here); else
  the graph compiles in this process at once (``FarmNotUp``: no warning, no wait for
  Ray to start). The farm file is checked again every
  ``LOCAL_RECHECK_S``, so a farm brought up later serves the next misses;
- ``embedded``: an embedded Ray started on the first miss with this machine's CPUs (it
  lives as long as this process; its start-up is on that miss's path);
- anything else is a Ray address (``host:port``, ``ray://host:port``, ``auto``): join it.

A process already connected to Ray (``ray.init`` by the user) uses that connection. A
farm that cannot be reached, that dies, that runs other versions, or that does not answer
within ``KILN_FARM_TIMEOUT`` raises ``FarmUnavailable``: the client then compiles the
graph itself. A compile error raises ``CompileFailure`` (naming key, stage and op).
A client that gives a farm up for any reason but a timeout (``FarmTimeout``: the farm is
up, only slow) calls ``release``: Kiln leaves the Ray connection it opened once no other
farm of the process uses it. ``workers.serve.cluster`` starts and stops `kiln farm up`'s cluster.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any

from kiln.compiler import trace
from kiln.frontend.transports.base import EMBEDDED, INPROCESS, LOCAL, Farm, FarmNotUp
from kiln.frontend.transports.inprocess import InProcessFarm
from kiln.workers.farm_api import FarmUnavailable, probe, probe_ray
from kiln.workers.ray_farm import RayFarm, use_farm_token
from kiln.workers.serve.farm_files import farm_token, read_farm_file

if TYPE_CHECKING:
    from kiln.compiler.compiled_graph import CompiledGraph
    from kiln.compiler.request import CompileRequest
    from kiln.frontend.transports.process import ProcessFarm
    from kiln.frontend.transports.relay import RelayFarm

log = logging.getLogger("kiln.farm")

LOCAL_RECHECK_S = 10.0


class LocalFarm:
    """``KILN_FARM=local``: the farm ``kiln farm up`` started, used only while it is up;
    a client never waits for one to start (``FarmNotUp``: it compiles in process)."""

    def __init__(self) -> None:
        self._ray: RayFarm | RelayFarm | None = None
        self._checked = -LOCAL_RECHECK_S
        self._address: str | None = None
        self._info: dict[str, Any] = {}
        self._lock = threading.Lock()

    @property
    def description(self) -> str:
        return self._ray.description if self._ray else "the farm of `kiln farm up`"

    @property
    def joined(self) -> str | None:
        return self._ray.joined if self._ray else None

    def address(self) -> str | None:
        """The address of the farm that is up now (checked every LOCAL_RECHECK_S)."""
        with self._lock:
            if self._ray is not None:
                return self._ray.address
            now = time.monotonic()
            if now - self._checked >= LOCAL_RECHECK_S:
                self._checked = now
                self._info = read_farm_file() or {}
                # The gateway (no Ray here) where the farm has one, else its Ray head.
                found = str(self._info.get("gateway") or self._info.get("address") or "")
                self._address = found if found and probe(found) is None else None
            return self._address

    def ray_farm(self) -> RayFarm | RelayFarm:
        address = self.address()
        if address is None:
            raise FarmNotUp("no farm is up (`kiln farm up` starts one)")
        with self._lock:
            if self._ray is None and address == self._info.get("gateway"):
                from kiln.frontend.transports.gateway import GatewayFarm

                self._ray = GatewayFarm(address, farm_token() or "")
            elif self._ray is None:
                self._ray = remote_farm(address)
            return self._ray

    def compile(self, key: str, request: CompileRequest, *, timeout: float | None = None,
                delay: float = 0.0) -> CompiledGraph:
        return self.ray_farm().compile(key, request, timeout=timeout, delay=delay)

    def tuned(self, key: str, timeout: float | None = None) -> CompiledGraph | None:
        return self.ray_farm().tuned(key, timeout)

    def release(self) -> None:
        with self._lock:
            ray_farm, self._ray = self._ray, None
        if ray_farm is not None:
            ray_farm.release()

def remote_farm(address: str) -> RayFarm | ProcessFarm:
    """The farm at a Ray address: joined in this process, or through a child process
    (``frontend.transports.process``: this one never imports Ray) with ``KILN_FARM_PROCESS=1``
    where Ray is not connected here."""
    from kiln.frontend.transports.process import ProcessFarm, wanted

    return ProcessFarm(address) if wanted() else RayFarm(address)

def connect_early(farm: Farm) -> threading.Thread | None:
    """Join the farm that is up in the background, so that the first miss finds the
    connection made (joining Ray and finding the coordinator took 0.9 s of GPT-2's
    cold start on the H200 host), on a thread (returned): a ``GatewayFarm`` connects
    and shakes hands, a ``ProcessFarm`` starts its child, a ``RayFarm`` joins Ray. It
    never starts a farm (no farm up, embedded Ray: nothing to do) and never raises: a
    connection that fails here fails again, and is reported, on the miss itself."""
    from kiln.frontend.transports.relay import RelayFarm

    remote: RayFarm | RelayFarm | None = None
    if isinstance(farm, LocalFarm) and farm.address() is not None:
        remote = farm.ray_farm()
    elif isinstance(farm, (RayFarm, RelayFarm)) and farm.address is not None:
        remote = farm
    if remote is None or (isinstance(remote, RayFarm) and remote._actor is not None):
        return None
    thread = threading.Thread(target=_connect_quietly, args=(remote,), daemon=True,
                              name="kiln-farm-connect")
    thread.start()
    return thread

def _connect_quietly(farm: RayFarm | RelayFarm) -> None:
    try:
        with trace.background():  # off the first output's path: it overlaps the trace
            farm.actor() if isinstance(farm, RayFarm) else farm.start()
    except Exception as e:  # the miss connects again and reports it
        log.debug("kiln farm: early connection failed: %s", e)

_farms: dict[str, Farm] = {}

_farms_lock = threading.Lock()

def farm_for(mode: str) -> Farm:
    """The process's farm for a ``KILN_FARM`` value (one per value: Ray connects once)."""
    mode = (mode or LOCAL).strip()
    with _farms_lock:
        if mode not in _farms:
            if mode.lower() == INPROCESS:
                _farms[mode] = InProcessFarm()
            elif mode.lower() == LOCAL:
                _farms[mode] = LocalFarm()
            elif mode.lower() == EMBEDDED:
                _farms[mode] = RayFarm(None)
            else:
                _farms[mode] = remote_farm(mode)
        return _farms[mode]


def farm_status(mode: str) -> dict[str, Any]:
    """What ``kiln farm status`` reports for a ``KILN_FARM`` value: the address, whether
    it is up (else why not) and the coordinator's counters (zeros when down)."""
    from kiln.workers import FARM_COUNTERS

    status: dict[str, Any] = {"farm": mode, "address": None, "up": False, "reason": None,
                              "counters": dict.fromkeys(FARM_COUNTERS, 0)}
    address, info = mode, {}
    if mode.lower() in (LOCAL, INPROCESS, EMBEDDED):
        info = read_farm_file() or {}
        if not info:
            status["reason"] = (f"no farm is up (KILN_FARM={mode}: clients compile in "
                                "process; `kiln farm up` starts one)")
            return status
        use_farm_token(info)
        address = str(info["address"])
    status["address"] = address
    gateway = info.get("gateway") if address != mode else None
    status["reason"] = probe(address) if gateway else probe_ray(address)
    if status["reason"] is None:
        try:
            status["counters"] = _farm_counters(address, str(gateway or ""))
            status["up"] = True
        except FarmUnavailable as e:
            status["reason"] = str(e)
    return status


def _farm_counters(address: str, gateway: str) -> dict[str, Any]:
    """The coordinator's counters: through the farm's gateway where it has one (no Ray
    here), else by joining its Ray cluster."""
    if not gateway:
        return RayFarm(address).stats()
    from kiln.frontend.transports.gateway import GatewayFarm

    remote = GatewayFarm(gateway, farm_token() or "")
    try:
        return remote.stats()
    finally:
        remote.release()
