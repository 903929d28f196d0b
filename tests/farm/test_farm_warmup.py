"""A graph's first-call warm-up beside a real farm's compile (``frontend.core.overlap``): it
runs on the client's own thread (cuDNN keeps attention plans per thread: the thread that
will call the graph) while a helper thread waits for the farm, at the same time as the
farm works; the result is the farm's, and a hit warms nothing."""

from __future__ import annotations

import secrets
import threading
import time
from pathlib import Path

import pytest
from farm_helpers import RayHead, cuda_request

from kiln.frontend.config import KilnConfig
from kiln.frontend.core.client import KilnClient
from kiln.frontend.transports.gateway import GatewayFarm
from kiln.workers.ray_farm import RayFarm
from kiln.workers.serve.gateway import Gateway


@pytest.mark.parametrize("front", ["ray", "gateway"])
def test_the_warm_up_runs_on_the_callers_thread_while_the_farm_compiles(
        farm: RayFarm, ray_cluster: RayHead, tmp_path: Path, front: str) -> None:
    """Through Ray itself, and through `kiln farm up`'s gateway (a TCP relay)."""
    gateway, remote = None, None
    if front == "ray":
        client = KilnClient(KilnConfig.resolve({"farm": ray_cluster.address,
                                                "store": str(tmp_path / "store")}))
    else:
        gateway = Gateway(farm, secrets.token_hex(32)).start()
        remote = GatewayFarm(gateway.address, gateway.token.decode())
        client = KilnClient(KilnConfig.resolve({"farm": "inprocess",
                                                "store": str(tmp_path / "store")}),
                            farm=remote)  # type: ignore[arg-type]
    try:
        _check_warm_up_beside(client, front)
    finally:
        if remote is not None:
            remote.release()
        if gateway is not None:
            gateway.close()


def _check_warm_up_beside(client: KilnClient, front: str) -> None:
    request = cuda_request(shapes=((10, 44), (44, 44)), options={"tag": f"warm-up {front}"})
    seen: dict[str, object] = {}
    farm_compile = client.farm.compile
    farm_working = threading.Event()

    def watched(*args: object, **kwargs: object) -> object:
        seen["farm_thread"] = threading.get_ident()
        farm_working.set()
        started = time.perf_counter()
        try:
            return farm_compile(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            seen["farm_s"] = time.perf_counter() - started

    def warm(stop: threading.Event) -> None:
        seen["warm_thread"] = threading.get_ident()
        seen["farm_busy_during_warm_up"] = farm_working.wait(30) and "farm_s" not in seen

    client.farm.compile = watched  # type: ignore[method-assign]
    result = client.compile(request, warm=warm)
    assert result.source == "farm" and result.compiled.kernels
    assert seen["warm_thread"] == threading.get_ident() != seen["farm_thread"]
    assert seen["farm_busy_during_warm_up"] is True
    seen.clear()
    again = client.compile(request, warm=warm)
    assert again.source == "hit" and "warm_thread" not in seen
    assert again.compiled.to_dict() == result.compiled.to_dict()
