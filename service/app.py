"""The FastAPI application, and the one place where the server's parts are put together.

    from jitserve.service.app import create_app
    app = create_app()              # settings from the JITSERVE_* environment
    # uvicorn.run(app, host="127.0.0.1", port=8000)

The lifespan starts the runtime processes (``service.runtimes``: they decode,
compile and run programs; this process never does), then ``serving`` builds the
rest in dependency order, each part handed what it needs through its
constructor, and the app holds them as one ``Services`` (``service.api.deps``)
that every route receives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from jitserve.compiler import Catalog
from jitserve.wire import ErrorCode

from . import v2
from .api.announce import AnnounceReplica
from .api.deps import Services, refused_owner
from .api.lane import ExecuteLane, lane_routes
from .api.openapi import install_docs
from .api.routes import arrays as arrays_routes
from .api.routes import batching as batching_routes
from .api.routes import calls as calls_routes
from .api.routes import console as console_routes
from .api.routes import executables as executables_routes
from .api.routes import execute as execute_routes
from .api.routes import futures as futures_routes
from .api.routes import health as health_routes
from .api.routes import programs as programs_routes
from .api.schemas import FutureView
from .calls.calls import Calls
from .calls.drain import Drain
from .calls.executables import ExecutableIndex
from .calls.executor import Executor
from .calls.futures import Future, FutureStore
from .calls.models import ModelRegistry
from .calls.programs import ProgramStore
from .calls.quotas import Quotas
from .calls.scheduler import FairScheduler
from .calls.tenants import Tenants
from .calls.warming import WarmResult, start_warming
from .cluster import Cluster
from .console import Console
from .errors import install_error_handlers
from .metrics import Metrics, RequestMetricsMiddleware
from .runtimes import Runtime, RuntimePool, device_limits, frames, make_pool
from .settings import Settings

if TYPE_CHECKING:
    from jitserve.compiler import Compiler

__all__ = ["JitserveApp", "create_app", "make_compiler", "serving", "start_pool"]

log = logging.getLogger("jitserve")
# Less shared memory than this is said at start: a 256 MiB array, in and out, with the
# segments kept for reuse, takes most of it (a container's is 64 MiB unless set).
_SHM_WARN_BYTES = 1 << 30


def make_compiler(settings: Settings) -> Compiler:
    """A ``Compiler`` configured from ``settings``, as a runtime makes its own; for tools.

    It imports jax, which this process otherwise never does (``compiler.records``)."""
    from jitserve.compiler import Compiler

    return Compiler(settings.compiler_config())


async def start_pool(settings: Settings, *, own_loop: bool = False) -> RuntimePool:
    """Runtimes made from ``settings``, started and up (``close`` them when done).

    ``own_loop``: the running loop serves every caller of the pool for its whole
    life (an app's own pool), and reads the runtimes' answers itself.
    """
    pool = make_pool(settings)
    pool.start(asyncio.get_running_loop() if own_loop else None)
    try:
        await pool.wait_ready()
    except BaseException:
        await asyncio.to_thread(pool.close)
        raise
    return pool


class JitserveApp(FastAPI):
    """FastAPI, with the server's ``Services`` while its lifespan runs, and the execute
    lane in front of the middleware stack (``api.lane``): every call, batch of calls,
    fetch of a result and release goes through it.

    Args:
      settings: configuration.
      metrics: this process's counters (the middleware counts every request in them).
      console: this process's recent history (``/console``; the error handlers note
        refusals in it).
      runtimes: started runtimes to share (tests reuse them); the lifespan starts and
        stops its own when omitted.
    """

    def __init__(self, settings: Settings, metrics: Metrics, console: Console, *,
                 runtimes: RuntimePool | None = None, **kwargs: Any) -> None:
        super().__init__(lifespan=self._lifespan, **kwargs)
        self.settings = settings
        self.metrics = metrics
        self.console = console
        self._shared_runtimes = runtimes
        self._services: Services | None = None
        self.lane = ExecuteLane(self, lane_routes(
            (execute_routes.ROUTE, execute_routes.execute),
            (calls_routes.ROUTE, calls_routes.start_calls),
            (futures_routes.RESULT_ROUTE, futures_routes.result),
            (futures_routes.RELEASE_ROUTE, futures_routes.release)))

    @property
    def services(self) -> Services:
        """What the routes use; only while the lifespan runs."""
        if self._services is None:
            raise RuntimeError("the app's services exist only while its lifespan runs")
        return self._services

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = self.lane.take(scope)
        if call is None:
            await super().__call__(scope, receive, send)
        else:
            await self.lane.serve(scope, receive, send, call)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        shared = self._shared_runtimes
        pool = shared or await start_pool(self.settings, own_loop=True)
        try:
            async with serving(self.settings, self.metrics, pool,
                               console=self.console) as services:
                grpc_server = await v2.start_grpc(services, self.version)  # JITSERVE_GRPC_PORT
                ifrt_server = None
                if self.settings.ifrt_port is not None:  # JAX's own protocol (service/ifrt)
                    from .ifrt.server import start as start_ifrt

                    ifrt_server, ifrt = await start_ifrt(services.settings, pool, self.metrics,
                                                         self.console, services.futures,
                                                         services.tenants)
                    self.console.sessions_from(ifrt.describe)  # the console's sessions panel
                    services.drain.sessions = ifrt  # a SIGTERM waits for them, then ends them
                self._services = services
                try:
                    yield
                finally:
                    self._services = None
                    if ifrt_server is not None:
                        self.console.sessions_from(None)
                        # Sessions still open (no drain, or a second signal) hear why first.
                        await ifrt.end_all("jitserve is shutting down: this session's arrays and "
                                           "executables are gone; open a new session")
                        await ifrt_server.stop(5)
                    if grpc_server is not None:
                        await grpc_server.stop(5)
        finally:
            if shared is None:
                await asyncio.to_thread(pool.close)


def create_app(settings: Settings | None = None, *, runtimes: RuntimePool | None = None) -> JitserveApp:
    """The jitserve app.

    Args:
      settings: configuration; read from the environment when omitted.
      runtimes: started runtimes to share (tests reuse them); the app starts and
        stops its own when omitted.
    """
    settings = settings or Settings()
    metrics = Metrics()
    console = Console()
    app = JitserveApp(settings, metrics, console, runtimes=runtimes, title="jitserve",
                      version="0.1.0",
                      docs_url=None, redoc_url=None,  # served by install_docs, without a CDN
                      description="JIT-as-a-service for JAX and XLA: send programs, get array "
                                  "futures back. See docs/api.md.")
    app.add_middleware(AnnounceReplica)  # with replicas: answers name theirs
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    install_error_handlers(app, metrics, on_refused=lambda request, code, quota: console.refused(
        None if code == ErrorCode.UNAUTHORIZED else refused_owner(request), code, quota))
    install_docs(app)
    app.include_router(execute_routes.router)  # first: every call matches it
    app.include_router(calls_routes.router)
    app.include_router(health_routes.router)
    app.include_router(health_routes.devices_router)
    app.include_router(programs_routes.router)
    app.include_router(batching_routes.router)
    app.include_router(executables_routes.router)
    app.include_router(futures_routes.router)
    app.include_router(arrays_routes.router)
    app.include_router(console_routes.router)  # /v1/console/..., and the page at /console
    app.include_router(console_routes.page_router)
    app.include_router(v2.router)  # the Open Inference Protocol (docs/v2.md)
    return app


@contextlib.asynccontextmanager
async def serving(settings: Settings, metrics: Metrics, pool: RuntimePool, *,
                  on_warm: Callable[[WarmResult], None] | None = None,
                  console: Console | None = None) -> AsyncIterator[Services]:
    """The server's parts on started runtimes, built in dependency order, for as long as
    the context lasts (the app's lifespan; ``jitserve warm``).

    ``on_warm``: called with each result of the ``--warm`` manifest's compiles.
    ``console``: where the parts note what the console shows (a new one when omitted).
    """
    loop = asyncio.get_running_loop()
    settings = device_limits(settings, pool)  # the device-bytes limits left unset, from the devices
    console = console or Console()
    workers = settings.compile_workers
    quotas = Quotas.from_settings(settings, workers)
    tenants = Tenants(quotas, scoped=settings.auth_enabled,
                      share_executables=settings.tenant_share_executables)
    scheduler = FairScheduler(workers, quotas.compile_slots) if tenants.scoped else None
    # The store tells the replicas' mirror of each change, and the mirror asks the store
    # for its live futures when Redis comes back, and fails them if this replica was
    # declared lost: the cluster, built first, reaches the store through these closures.
    futures: FutureStore

    def finished(fut: Future) -> None:  # each future's end: counted in both
        metrics.execution_finished(fut.status.value)
        console.call_finished(fut)

    cluster = _cluster(settings, metrics, live=lambda: futures.live(),
                       on_self_lost=lambda old, new: futures.replica_lost(old, new))
    futures = FutureStore(
        ttl_s=settings.future_ttl_s, max_live=settings.max_live_futures,
        max_device_bytes=settings.device_bytes_limit,
        owner_max_live=quotas.live_futures if tenants.scoped else None,
        owner_max_device_bytes=quotas.device_bytes if tenants.scoped else None,
        on_final=finished,
        on_release=pool.release,
        on_change=cluster.mirror.changed if cluster is not None else None,
        id_prefix=f"{cluster.replica_id}." if cluster is not None else "")

    def lost(runtime: Runtime, generation: int, why: str) -> None:  # a supervisor thread
        console.runtime_exited(runtime.index, generation, why, runtime.last_exit_code)
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody left to tell
            loop.call_soon_threadsafe(futures.fail_lost, runtime, generation, why)

    executor = Executor(pool, futures, metrics, timeout_s=settings.execution_timeout_s,
                        max_run_bytes=settings.execution_bytes_limit)
    index = ExecutableIndex(settings.l1_max_entries)
    calls = Calls(pool, futures, executor, metrics, index,
                  lookup_timeout_s=settings.lookup_timeout_s, tenants=tenants,
                  scheduler=scheduler,
                  shared_batching=cluster.ownership if cluster is not None else None,
                  console=console)
    programs = ProgramStore(pool, tenants, max_entries=settings.programs_max_entries,
                            max_bytes=settings.programs_max_bytes,
                            timeout_s=settings.decode_timeout_s,
                            claims=cluster.ownership if cluster is not None else None)
    catalog = await asyncio.to_thread(Catalog.open, index.values, settings.redis_settings(),
                                      settings.compiler_cache_secret())
    # --warm: compile a manifest; /readyz says "warming" until it is done (calls/warming.py)
    warming = start_warming(settings, programs, calls, len(pool.runtimes), on_progress=on_warm)
    services = Services(settings=settings, metrics=metrics, runtimes=pool, tenants=tenants,
                        futures=futures, executor=executor, programs=programs, calls=calls,
                        models=ModelRegistry(tenants), catalog=catalog,
                        drain=Drain(futures, cluster, settings.drain_timeout_s),
                        cluster=cluster, warming=warming, console=console)
    pool.add_lost_listener(lost)
    sweeper = loop.create_task(futures.sweep_forever(settings.sweep_interval_s))
    try:
        if cluster is not None:
            await cluster.start()
        _log_startup(settings, pool, catalog)
        yield services
    finally:
        sweeper.cancel()
        if warming is not None:
            await warming.stop()
        if cluster is not None:
            await cluster.leave(futures.live())  # drained already, or stopped at once
            await cluster.close()
        pool.remove_lost_listener(lost)
        await calls.close()
        await executor.close()
        futures.clear()
        await asyncio.to_thread(catalog.close)


def _cluster(settings: Settings, metrics: Metrics, *, live: Callable[[], list[Future]],
             on_self_lost: Callable[[str, str], None]) -> Cluster[Future] | None:
    """This process as a replica of the service on the shared Redis (``None`` without one)."""
    redis = settings.redis_settings()
    if redis is None:
        return None
    return Cluster(redis, peer_url=settings.peer_url or _own_url(settings),
                   secret=settings.peer_secret_bytes(), heartbeat_s=settings.heartbeat_s,
                   future_ttl_s=settings.future_ttl_s, metrics=metrics,
                   document=_future_document, live=live, on_self_lost=on_self_lost,
                   peer_idle_s=settings.keepalive_timeout_s / 2)


def _future_document(fut: Future) -> dict[str, Any]:
    """A future's metadata, as the replicas mirror it: what ``GET /v1/futures/{id}`` shows."""
    return FutureView.of(fut).model_dump(mode="json")


def _own_url(settings: Settings) -> str:
    """Where peers reach this process: the bound address, or the host's own for 0.0.0.0."""
    host = settings.host
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostbyname(socket.gethostname())
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{settings.port}"


def _log_startup(settings: Settings, pool: RuntimePool, catalog: Catalog) -> None:
    """One line: the device, the runtimes, the cache tiers, whether auth is on, the main limits."""
    backend = pool.backend.get("backend", {})
    device = pool.backend.get("device", {})
    shared = catalog.shared_url
    tiers = ["memory", *([f"disk {settings.cache_dir}"] if settings.disk_cache else []),
             *([f"redis {shared} ({catalog.state})"] if shared else [])]
    auth = f"on ({len(settings.api_keys)} keys)" if settings.auth_enabled else "off"
    limits = {"max_body_bytes": settings.max_body_bytes,
              "max_program_bytes": settings.max_program_bytes,
              "max_device_bytes": settings.device_bytes_limit,
              "max_execution_bytes": settings.execution_bytes_limit,
              "max_live_futures": settings.max_live_futures,
              "compile_timeout_s": settings.compile_timeout_s,
              "execution_timeout_s": settings.execution_timeout_s,
              "future_ttl_s": settings.future_ttl_s}
    log.info("jitserve ready on %s %s (%d runtimes, pids %s), cache %s, auth %s, limits %s",
             backend.get("platform"), backend.get("device_kind"), len(pool.runtimes),
             ",".join(str(r.pid) for r in pool.runtimes), " + ".join(tiers), auth,
             ", ".join(f"{k}={v}" for k, v in limits.items()),
             extra={"fields": {"platform": backend.get("platform"),
                               "device_kind": backend.get("device_kind"),
                               "device": device, "runtimes": len(pool.runtimes),
                               "tiers": tiers, "auth": settings.auth_enabled,
                               "limits": limits}})
    shm = frames.shared_memory_bytes()
    if shm < _SHM_WARN_BYTES:
        log.warning("shared memory (%s) is %s MiB: arrays bigger than its free space are "
                    "refused (503 unavailable; RESOURCE_EXHAUSTED through the IFRT proxy). "
                    "Give the server %s GiB or more: docker run --shm-size, compose shm_size, "
                    "a Memory emptyDir on /dev/shm in Kubernetes (docs/deploy.md)",
                    frames.SHM_DIR, shm >> 20, _SHM_WARN_BYTES >> 30)
