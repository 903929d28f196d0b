"""The farm's coordinator reached over Ray: ``RayFarm`` joins a cluster (or starts an
embedded Ray), finds or starts the ``KilnFarm`` coordinator and calls it; ``_KilnRay`` owns
the one Ray connection a process has and leaves it in order at exit.

Clients use it (directly, or in their farm process: ``frontend.transports.process``), and
so does the gateway (``workers.serve.gateway``), which relays its clients' calls. Ray is
imported on first use only. Work that must finish before Kiln leaves Ray at exit (a
client's background tuning) registers itself with ``on_exit``.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.artifact_store import user_cache_dir
from kiln.compiler import trace
from kiln.workers.farm_api import (
    FarmTimeout,
    FarmUnavailable,
    answer_to_graph,
    farm_waits,
    host_port,
    probe,
    probe_ray,
)
from kiln.workers.serve.farm_files import read_farm_file

if TYPE_CHECKING:
    from kiln.compiler.compiled_graph import CompiledGraph
    from kiln.compiler.request import CompileRequest

log = logging.getLogger("kiln.farm")

RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
# Ray replaces a loopback node IP by the machine's network address unless it believes it
# runs without a cluster (its macOS/Windows default); with this at 0, a node started with
# ``--node-ip-address=127.0.0.1`` binds every port (GCS, raylet, workers) to loopback.
# Every process of the cluster and every driver joining it needs it (Ray 2.60).
RAY_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK = "127.0.0.1"
GET_SLICE_S = 0.25  # how often a client waiting on the farm checks that it is not exiting
EXIT_CALLS_WAIT_S = 5.0  # at exit: the longest Kiln waits for its Ray calls to end

# Called, in order, when Kiln leaves Ray at exit, before its calls are cut off.
_exit_hooks: list[Callable[[], None]] = []


def on_exit(hook: Callable[[], None]) -> None:
    """Run ``hook`` at exit before Kiln leaves Ray (once, however often registered)."""
    if hook not in _exit_hooks:
        _exit_hooks.append(hook)


def use_farm_token(info: dict[str, Any]) -> None:
    """Before joining `kiln farm up`'s cluster: send its token (unless one is set)."""
    token_file = info.get("token_file")
    if token_file and not os.environ.get("RAY_AUTH_TOKEN"):
        os.environ.setdefault("RAY_AUTH_MODE", "token")
        os.environ.setdefault("RAY_AUTH_TOKEN_PATH", str(token_file))
        _refresh_ray_auth()

def is_loopback(address: str) -> bool:
    """Whether a Ray address (``host:port``) names this machine's loopback interface."""
    target = host_port(address)
    return target is not None and (target[0] in ("localhost", "::1")
                                   or target[0].startswith("127."))

def use_loopback_ray(address: str) -> None:
    """Before joining the cluster at ``address``: if it listens on loopback only (``kiln
    farm up`` without ``--host``), keep Ray from rewriting 127.0.0.1 to the machine's
    network address, where nothing answers (see RAY_LOOPBACK_ENV). A Ray imported
    already read the variable: its constant is set too."""
    if not is_loopback(address):
        return
    os.environ[RAY_LOOPBACK_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None and hasattr(constants, "ENABLE_RAY_CLUSTER"):
        constants.ENABLE_RAY_CLUSTER = False  # type: ignore[attr-defined]

def _refresh_ray_auth() -> None:
    """Ray reads its auth mode and token once and caches them: a Ray imported before the
    variables were set must read them again, or it joins without the token."""
    if "ray" not in sys.modules:
        return
    try:
        from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError) as e:  # a Ray without token authentication
        log.debug("kiln farm: could not refresh Ray's auth settings: %s", e)

AUTH_HINT = ("the cluster uses token authentication and this client's token is missing or "
             "wrong: set RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's token "
             "(`ray get-auth-token` on the head)")

# What Ray says when a cluster refuses a token (not its start-up notice that token
# authentication is on or off, which every log holds).
_AUTH_MARKERS = ("invalidauthtoken", "unauthenticated", "authentication token is missing",
                 "invalid or missing authentication token", "invalid authentication token")

def explain_join_failure(address: str, error: BaseException, ray_output: str) -> str:
    """One line on why joining ``address`` failed, naming the fix where it is known."""
    text = f"{error}\n{ray_output}".lower()
    if any(marker in text for marker in _AUTH_MARKERS):
        return f"the Ray cluster at {address} refused this client: {AUTH_HINT}"
    first = (str(error).strip().splitlines() or [type(error).__name__])[0]
    return f"cannot join the Ray cluster at {address}: {type(error).__name__}: {first}"

@contextmanager
def ray_output_captured() -> Iterator[Path]:
    """Ray's own output (C++ core logs written to file descriptors 1 and 2: reconnect
    attempts, auth failures, ...) goes to a Kiln log file instead of the user's terminal
    while this block runs; the file's path is yielded, and kept (its tail explains a
    failure)."""
    folder = user_cache_dir() / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"ray-join-{os.getpid()}.log"
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    saved = [os.dup(1), os.dup(2)]
    with path.open("ab") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        try:
            yield path
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)

def _tail(path: Path, nbytes: int = 20000) -> str:
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, path.stat().st_size - nbytes))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""

def use_auth_token() -> None:
    """Send this machine's Ray token when joining a cluster: Ray enables token auth by
    default for the clusters it starts, but a joining driver only if told to."""
    try:
        from ray._private.authentication.authentication_token_setup import (
            maybe_enable_token_auth_if_token_available,
        )
    except ImportError:  # a Ray without token authentication
        return
    maybe_enable_token_auth_if_token_available(warn_if_disabled=False)


# --------------------------------------------------------------------------------------
# Ray.


class _KilnRay:
    """The Ray connection Kiln opened in this process, the farms using it, and Kiln's Ray
    calls in flight.

    A process has one Ray connection. Kiln leaves it (``ray.shutdown``) only when it
    opened it itself (never the user's own ``ray.init``), that same connection is still
    the live one (its job id), and the last farm using it has let go: other clients of
    the process may share it.

    At exit Kiln leaves in order (``at_exit``, an atexit hook registered after Ray's, so
    it runs first): background work (autotuning asks the farm) finishes or is given up,
    no new Ray call starts and those in flight end, the handles go, and only then the
    connection; Ray's own hook finds nothing of Kiln's left to touch the stopped core
    worker, which would abort the process (or leave a ``ray.get`` waiting forever)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.job: str | None = None  # the job id of the connection Kiln opened
        self.joined: str | None = None  # its address ("embedded": a Ray of its own)
        self.users: weakref.WeakSet[RayFarm] = weakref.WeakSet()  # the farms on it
        self.farms: weakref.WeakSet[RayFarm] = weakref.WeakSet()  # every connected one
        self.calls = threading.Condition()  # guards in_flight and closing
        self.in_flight = 0
        self.closing = False

    @staticmethod
    def current_job(ray: Any) -> str | None:
        """The live connection's job id; None when not connected (not asked then: Ray
        would connect to whatever cluster it finds to answer)."""
        if not ray.is_initialized():
            return None
        try:
            return str(ray.get_runtime_context().get_job_id())
        except Exception:  # not connected, or an older Ray
            return None

    def attach(self, farm: RayFarm, ray: Any) -> None:
        """Connect ``farm`` (under the lock: one ``ray.init`` a process)."""
        with self.lock:
            if not ray.is_initialized():
                self.joined = farm._init_ray(ray)
                self.job = self.current_job(ray)
                self.users.clear()
            # Last in the atexit list, after whatever Ray registered: runs before it.
            atexit.unregister(self.at_exit)
            atexit.register(self.at_exit)
            self.farms.add(farm)
            if self.job is not None and self.job == self.current_job(ray):
                self.users.add(farm)
                farm.joined = self.joined

    def detach(self, farm: RayFarm) -> None:
        with self.lock:
            self.farms.discard(farm)
            if farm not in self.users:
                return
            self.users.discard(farm)
            if self.users:
                log.debug("kiln farm: %d other farm(s) still use Ray", len(self.users))
                return
            self._leave()

    def _leave(self) -> None:
        """``ray.shutdown`` if Kiln's connection is the live one (under the lock)."""
        import ray

        if self.job is None or self.job != self.current_job(ray):
            return  # the user's connection, or they closed Kiln's and opened their own
        self.job = None
        try:
            ray.shutdown()
        except Exception as e:  # leaving is best effort
            log.debug("kiln farm: leaving Ray failed: %s", e)

    @contextmanager
    def call(self) -> Iterator[None]:
        """Around each of Kiln's Ray calls: refused (``FarmUnavailable``) once the
        process is leaving Ray at exit; counted, so that exit waits for it to end."""
        with self.calls:
            if self.closing:
                raise FarmUnavailable("this process is exiting: it has left the farm")
            self.in_flight += 1
        try:
            yield
        finally:
            with self.calls:
                self.in_flight -= 1
                self.calls.notify_all()

    def at_exit(self) -> None:
        """Leave Ray in order at interpreter exit (see the class docstring)."""
        for hook in list(_exit_hooks):  # e.g. tuning still running, up to its limit
            try:
                hook()
            except Exception as e:  # leaving Ray must go on
                log.debug("kiln farm: exit hook failed: %s", e)
        with self.calls:
            self.closing = True
            # A waiting call notices ``closing`` within GET_SLICE_S.
            if not self.calls.wait_for(lambda: self.in_flight == 0, EXIT_CALLS_WAIT_S):
                log.warning("kiln farm: %d Ray call(s) still running at exit",
                            self.in_flight)
        for farm in list(self.farms):
            farm.drop_handles()
        if self.lock.acquire(timeout=EXIT_CALLS_WAIT_S):  # not behind a hung ray.init
            try:
                self._leave()
            finally:
                self.lock.release()


def ray_get(ray: Any, ref: Any, timeout: float | None) -> Any:
    """``ray.get(ref, timeout=timeout)`` waiting in slices of GET_SLICE_S, so that a
    call waiting when the process exits sees it (``FarmUnavailable``) instead of
    waiting on a connection that is being closed. Raises Ray's ``GetTimeoutError``."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            raise ray.exceptions.GetTimeoutError(f"no answer within {timeout:g}s")
        ready, _ = ray.wait([ref], timeout=GET_SLICE_S if left is None
                            else min(GET_SLICE_S, left))
        if ready:
            return ray.get(ref)
        if _kiln_ray.closing:
            raise FarmUnavailable("this process is exiting: it stopped waiting for the "
                                  "farm (KILN_AUTOTUNE_EXIT_WAIT ran out)")

_kiln_ray = _KilnRay()

class RayFarm:
    """A Ray cluster's ``KilnFarm`` coordinator; ``address=None`` is the ``local`` mode."""

    def __init__(self, address: str | None = None, *, num_cpus: int | None = None,
                 graph_workers: int | None = None, connect_timeout: float = 120.0,
                 num_gpus: int | None = None, namespace: str | None = None) -> None:
        """``num_cpus`` / ``num_gpus``: the resources of an embedded Ray (``num_gpus``
        None: Ray counts this machine's; on a machine without GPUs a number makes fake
        ones, which the tests' fake benchmark uses). ``namespace``: the farm's Ray
        namespace (``workers.names``), given by a client's farm process: a coordinator
        that runs is then found by name, without importing the compiler (or torch)."""
        self.address = address
        self.namespace = namespace
        self.num_cpus = num_cpus
        self.num_gpus = num_gpus
        self.graph_workers = graph_workers
        self.connect_timeout = connect_timeout
        self.joined: str | None = None  # the connection Kiln opened, while this uses it
        self._actor: Any = None
        self._lock = threading.Lock()

    @property
    def description(self) -> str:
        where = self.joined or self.address
        return f"the Ray cluster at {where}" if where else "an embedded Ray"

    def actor(self) -> Any:
        """The coordinator, connecting (and starting embedded Ray) on first use."""
        with _kiln_ray.call(), self._lock:
            if self._actor is None:
                self._actor = self._connect()
            return self._actor

    def _ask(self, method: str, *args: Any, timeout: float | None) -> Any:
        """Call the coordinator's ``method`` and wait for its answer (one of Kiln's Ray
        calls: see ``_KilnRay.call``)."""
        import ray

        with _kiln_ray.call():
            ref = getattr(self.actor(), method).remote(*args)
            return ray_get(ray, ref, timeout)

    def drop_handles(self) -> None:
        """Forget the coordinator's handle (before the connection is left; not behind
        ``_lock``, which a connect that hangs may hold)."""
        self._actor = None

    def _connect(self) -> Any:
        try:
            import ray
        except ImportError as e:
            raise FarmUnavailable(f"Ray is not installed here ({e}); pip install ray") from e

        if self.address is not None:  # fail fast, whatever this process joined before
            reason = probe_ray(self.address)
            if reason is not None:
                raise FarmUnavailable(f"cannot reach the Ray cluster at {self.address}: "
                                      f"{reason}")
        _kiln_ray.attach(self, ray)
        start = time.perf_counter()
        actor = self._running_coordinator(ray)
        if actor is None:
            from kiln.workers.coordinator import get_farm_actor

            actor = get_farm_actor(self.graph_workers)
        try:
            ray_get(ray, actor.ping.remote(), self.connect_timeout)
        except FarmUnavailable:
            raise
        except Exception as e:
            raise FarmUnavailable(f"the farm's coordinator did not start: {e}") from e
        log.debug("kiln farm: coordinator ready in %.2fs", time.perf_counter() - start)
        return actor

    def _running_coordinator(self, ray: Any) -> Any:
        """The coordinator by name in ``namespace``, if it was given and one runs."""
        if self.namespace is None:
            return None
        from kiln.workers.names import FARM_NAME

        try:
            return ray.get_actor(FARM_NAME, namespace=self.namespace)
        except ValueError:  # none yet: created (from the compiler's classes) as usual
            return None

    def _init_ray(self, ray: Any) -> str:
        """Connect this process to Ray; the address joined ("embedded": a new Ray)."""
        # Ray aborts a driver whose cluster's head has been unreachable for a minute; a
        # user's program that Kiln joined to a farm must outlive the farm (the client
        # gives the farm up, compiles itself, and leaves Ray: ``release``).
        os.environ.setdefault(RECONNECT_ENV, str(7 * 24 * 3600))
        address = self.address
        info = read_farm_file()
        if address is None:  # local: `kiln farm up`'s cluster if it answers
            if info is not None and probe(str(info["address"])) is None:
                address = str(info["address"])
                use_farm_token(info)
        elif info is not None and str(info.get("address")) == address:
            use_farm_token(info)  # `kiln farm up`'s cluster, named by its address
        kwargs: dict[str, Any] = {"log_to_driver": False, "logging_level": logging.WARNING,
                                  "ignore_reinit_error": True}
        if address is None:
            # Workers only compile: Triton's interpreter (a client's CPU backend) would
            # stop them from cross-compiling GPU kernels.
            # address "local": a new instance even where `ray start` runs one already.
            kwargs.update(address="local", num_cpus=self.num_cpus or os.cpu_count(),
                          include_dashboard=False,
                          **({} if self.num_gpus is None else {"num_gpus": self.num_gpus}),
                          runtime_env={"env_vars": {"TRITON_INTERPRET": "0"}})
        else:
            kwargs["address"] = address
        if address is None:
            try:
                ray.init(**kwargs)
            except Exception as e:
                raise FarmUnavailable(f"Ray did not start: {e}") from e
        else:
            self._join(ray, address, kwargs)
        return address or "embedded"

    @staticmethod
    def _join(ray: Any, address: str, kwargs: dict[str, Any]) -> None:
        """``ray.init`` to a cluster, with Ray's own output kept out of the terminal."""
        use_loopback_ray(address)
        with ray_output_captured() as log_path:
            try:
                use_auth_token()
                ray.init(**kwargs)
                return
            except Exception as e:
                error: Exception = e
        raise FarmUnavailable(f"{explain_join_failure(address, error, _tail(log_path))} "
                              f"(Ray's output: {log_path})") from error

    def compile(self, key: str, request: CompileRequest, *, timeout: float | None = None,
                delay: float = 0.0) -> CompiledGraph:
        self.actor()  # connecting is not part of the wait
        with farm_waits(key):
            answer = self.compile_raw(key, request.to_bytes(), delay, trace.recording(),
                                      timeout)
        return answer_to_graph(answer)

    def compile_raw(self, key: str, request: bytes, delay: float, traced: bool,
                    timeout: float | None) -> dict[str, Any]:
        """The coordinator's answer to a compile (also what a client's farm process,
        ``frontend.transports.process``, relays); errors as ``compile`` raises them."""
        import ray

        # The farm recomputes the key from the bytes; ours only checks that we agree.
        try:
            return dict(self._ask("compile", request, delay, key, traced, timeout=timeout))
        except ray.exceptions.GetTimeoutError:
            raise FarmTimeout(
                f"no answer within {timeout:g}s (KILN_FARM_TIMEOUT); the farm keeps "
                "compiling it for later clients") from None
        except ray.exceptions.RayError as e:
            raise self._classify(e, key) from None

    def tuned(self, key: str, timeout: float | None = None) -> CompiledGraph | None:
        """The graph the farm autotuned in the background after answering ``compile``
        (None if it tuned nothing); waits for it. The farm publishes it too."""
        from kiln.compiler.compiled_graph import CompiledGraph

        result = self.tuned_raw(key, timeout, trace.recording())
        return None if result is None else CompiledGraph.from_dict(result)

    def tuned_raw(self, key: str, timeout: float | None, traced: bool
                  ) -> dict[str, Any] | None:
        """``tuned``'s answer as the coordinator gives it (its timeline merged here when
        ``traced``)."""
        import ray

        try:
            result = self._ask("tuned", key, timeout=timeout)
            if traced:
                trace.merge(self.tuning_trace(timeout))
        except ray.exceptions.GetTimeoutError:
            raise FarmUnavailable(f"autotuning gave no answer within {timeout}s") from None
        except ray.exceptions.RayError as e:
            raise self._classify(e, key) from None
        return result

    def tuning_trace(self, timeout: float | None) -> list[Any]:
        """The coordinator's timeline of its background tuning."""
        return list(self._ask("tuning_trace", timeout=timeout))

    def _classify(self, error: Exception, key: str) -> Exception:
        from kiln.workers.coordinator import root_cause
        from kiln.workers.pipeline import CompileFailure, FarmKeyMismatch, FarmVersionMismatch

        cause = root_cause(error)
        if isinstance(cause, CompileFailure):
            return CompileFailure.wrap(cause, key)
        if not isinstance(cause, (FarmVersionMismatch, FarmKeyMismatch)):
            with self._lock:
                self._actor = None  # look the coordinator up again next time
        return FarmUnavailable(f"{type(cause).__name__}: {cause}")

    def stats(self) -> dict[str, Any]:
        """The coordinator's counters, every one of ``FARM_COUNTERS`` present."""
        from kiln.workers import FARM_COUNTERS

        try:
            stats = self._ask("stats", timeout=self.connect_timeout)
        except FarmUnavailable:
            raise
        except Exception as e:
            raise FarmUnavailable(f"the farm's coordinator did not answer: {e}") from e
        return {**dict.fromkeys(FARM_COUNTERS, 0), **dict(stats)}

    def release(self) -> None:
        """Let go of the farm: a client that gave it up (it died, it cannot be reached,
        it runs other versions) calls this. The connection is left when Kiln opened it
        and no other farm of this process uses it: a driver whose cluster is gone keeps
        trying to reach it (see ``_init_ray``), and the user's own connection is theirs."""
        with self._lock:
            self.joined, self._actor = None, None
        _kiln_ray.detach(self)
