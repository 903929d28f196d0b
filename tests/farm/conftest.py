"""Fixtures of the farm tests: one real Ray cluster for the session (`ray start --head`,
2 CPUs), joined by address from this process; a moto S3 server; a clean KILN_* and
cache environment per test."""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parents[2]


def _snapshot_sources() -> Path:
    """A private copy of the packages, taken once: the session's Ray workers, client
    processes and (when nothing imported it yet) this process all run it.

    Other people edit this working tree while tests run; a worker that restarts after an
    edit would run another compiler than the client that hashed the request (and rightly
    refuse it). FARM_TEST_LIVE_TREE=1 runs the live tree instead."""
    if os.environ.get("FARM_TEST_LIVE_TREE") == "1":
        return _ROOT
    import kiln

    dest = kiln.snapshot_sources(_ROOT, tempfile.mkdtemp(prefix="kiln-farm-src-"))
    atexit.register(shutil.rmtree, dest, True)
    return dest


os.environ["FARM_TEST_SRC"] = str(_snapshot_sources())
if "kiln.compiler" not in sys.modules:
    sys.path.insert(0, os.environ["FARM_TEST_SRC"])

from farm_helpers import BUCKET, RayHead, free_port  # noqa: E402

from kiln.compiler import trace  # noqa: E402
from kiln.compiler.versions import versions  # noqa: E402
from kiln.frontend.core.client import reset_clients  # noqa: E402
from kiln.workers.ray_farm import RayFarm  # noqa: E402


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


_SESSION_HEADS: list[RayHead] = []  # the session's cluster, once started


def _stop_session_cluster() -> None:
    import ray

    ray.shutdown()
    while _SESSION_HEADS:
        _SESSION_HEADS.pop().stop()


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory: pytest.TempPathFactory, session_cache: Path
                ) -> Iterator[RayHead]:
    """A 2-CPU Ray cluster started for the session; its workers share no cache with us.
    It stops after the last test of tests/farm (``pytest_runtest_teardown``), not at the
    end of the session: the rest of a run (scripts/test.sh's xdist worker goes on with
    other files) does not share the machine with an idle cluster and farm."""
    versions()  # hash the compiler now, as close as possible to when the workers do
    log = tmp_path_factory.mktemp("ray") / "head.log"
    head = RayHead(log, num_cpus=2, env={"XDG_CACHE_HOME": str(session_cache / "workers")})
    _SESSION_HEADS.append(head)
    yield head
    _stop_session_cluster()


def _in_farm(item: pytest.Item) -> bool:
    return Path(__file__).parent in item.path.parents


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """After the last test of tests/farm, once its fixtures are torn down: the session's
    cluster stops. Under pytest-xdist tests/farm is one worker's unit, run in one piece
    (tests/conftest.py); in one process, the items left are looked at."""
    if not _SESSION_HEADS or (nextitem is not None and _in_farm(nextitem)):
        return
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        items = item.session.items
        if any(_in_farm(later) for later in items[items.index(item) + 1:]):
            return
    _stop_session_cluster()


@pytest.fixture(scope="session")
def farm(ray_cluster: RayHead) -> RayFarm:
    """This process's connection to the session cluster, its coordinator warm."""
    import ray

    farm = RayFarm(ray_cluster.address)
    here = os.getcwd()
    os.chdir(os.environ["FARM_TEST_SRC"])  # Ray puts the driver's cwd first on workers' path
    try:
        actor = farm.actor()
    finally:
        os.chdir(here)
    ray.get(actor.wait_warm.remote(), timeout=180)
    return farm


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    """Endpoint URL of a moto S3 server on 127.0.0.1 with one bucket."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    import boto3

    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1",
                 ).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    """No KILN_* or RAY_ADDRESS from the shell; the store and caches under tmp_path."""
    for name in list(os.environ):
        if name.startswith("KILN_") or name in ("RAY_ADDRESS", "TRITON_INTERPRET"):
            monkeypatch.delenv(name)
    cache = tmp_path / "xdg-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    monkeypatch.setenv("KILN_STORE", str(tmp_path / "store"))
    reset_clients()
    yield cache
    reset_clients()


@pytest.fixture
def recording() -> Iterator[None]:
    """This process's timeline recorded (as "client") for the test, then cleared."""
    trace.clear()
    trace.enable()
    trace.set_process_name("client")
    yield
    trace.enable(False)
    trace.clear()
