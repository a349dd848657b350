"""The FastAPI application.

    from jitserve.service.app import create_app
    app = create_app()              # settings from the JITSERVE_* environment
    # uvicorn.run(app, host="127.0.0.1", port=8000)

The lifespan starts the runtime processes (``service.runtimes``: they decode,
compile and run programs; this process never does) and builds the shared
objects (program store, future store, executor, catalog, with Redis when
``REDIS_URL`` is set) on ``app.state``; route handlers reach them through
``service.deps``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from jitserve.compiler import Catalog, Compiler

from . import v2
from .api.announce import AnnounceReplica
from .api.openapi import install_docs
from .api.routes import arrays as arrays_routes
from .api.routes import batching as batching_routes
from .api.routes import executables as executables_routes
from .api.routes import execute as execute_routes
from .api.routes import futures as futures_routes
from .api.routes import health as health_routes
from .api.routes import programs as programs_routes
from .api.schemas import FutureView
from .calls.batching import Batcher
from .calls.calls import Calls
from .calls.drain import Drain
from .calls.executables import ExecutableIndex
from .calls.executor import Executor
from .calls.futures import Future, FutureStore
from .calls.programs import ProgramStore
from .calls.quotas import Quotas
from .calls.scheduler import FairScheduler
from .calls.tenants import Tenants
from .calls.warming import start_warming
from .cluster import Cluster
from .errors import install_error_handlers
from .metrics import Metrics, RequestMetricsMiddleware
from .runtimes import RuntimePool, make_pool
from .settings import Settings

if TYPE_CHECKING:
    from jitserve.compiler.redis.tiers import RedisTiers

__all__ = ["create_app", "make_compiler", "start_pool"]

log = logging.getLogger("jitserve")


def make_compiler(settings: Settings) -> Compiler:
    """A ``Compiler`` configured from ``settings`` (what each runtime runs; tools use it too)."""
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


class _App(FastAPI):
    """FastAPI, with the execute route's lane in front of the middleware stack
    (``routes.execute.ExecuteLane``): every call goes through it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lane = execute_routes.ExecuteLane(self)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        call = self.lane.take(scope)
        if call is None:
            await super().__call__(scope, receive, send)
        else:
            await self.lane.serve(scope, receive, send, call)


def create_app(settings: Settings | None = None, *, runtimes: RuntimePool | None = None) -> FastAPI:
    """The jitserve app.

    Args:
      settings: configuration; read from the environment when omitted.
      runtimes: started runtimes to share (tests reuse them); the app starts and
        stops its own when omitted.
    """
    settings = settings or Settings()
    metrics = Metrics()
    app = _App(title="jitserve", version="0.1.0", lifespan=_lifespan_for(runtimes),
                  docs_url=None, redoc_url=None,  # served by install_docs, without a CDN
                  description="JIT-as-a-service for JAX and XLA: send programs, get array "
                              "futures back. See docs/api.md.")
    app.state.settings = settings
    app.state.metrics = metrics
    app.add_middleware(AnnounceReplica)  # with replicas: answers name theirs
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    install_error_handlers(app)
    install_docs(app)
    app.include_router(execute_routes.router)  # first: every call matches it
    app.include_router(health_routes.router)
    app.include_router(health_routes.devices_router)
    app.include_router(programs_routes.router)
    app.include_router(batching_routes.router)
    app.include_router(executables_routes.router)
    app.include_router(futures_routes.router)
    app.include_router(arrays_routes.router)
    app.include_router(v2.router)  # the Open Inference Protocol (docs/v2.md)
    return app


def _lifespan_for(shared: RuntimePool | None):  # noqa: ANN202 - FastAPI's lifespan type
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings: Settings = app.state.settings
        pool = shared or await start_pool(settings, own_loop=True)
        try:
            async with _serving(app, settings, pool):
                yield
        finally:
            if shared is None:
                await asyncio.to_thread(pool.close)

    return lifespan


def _open_shared(settings: Settings) -> RedisTiers | None:
    """The shared Redis, for the catalog's listing (the runtimes open their own)."""
    redis = settings.redis_settings()
    secret = settings.compiler_cache_secret()
    if redis is None or secret is None:
        return None
    from jitserve.compiler.redis.tiers import RedisTiers

    return RedisTiers(redis, secret)


@contextlib.asynccontextmanager
async def _serving(app: FastAPI, settings: Settings, pool: RuntimePool) -> AsyncIterator[None]:
    """Everything that lives as long as the server, on ``app.state``."""
    metrics: Metrics = app.state.metrics
    loop = asyncio.get_running_loop()
    # Tenants: scoping and quotas
    workers = settings.compile_workers
    quotas = Quotas.from_settings(settings, workers)
    tenants = Tenants(quotas, scoped=settings.auth_enabled)
    scheduler = FairScheduler(workers, quotas.compile_slots) if tenants.scoped else None
    futures = FutureStore(ttl_s=settings.future_ttl_s, max_live=settings.max_live_futures,
                          max_device_bytes=settings.max_device_bytes,
                          owner_max_live=quotas.live_futures if tenants.scoped else None,
                          owner_max_device_bytes=quotas.device_bytes if tenants.scoped else None)
    futures.on_final = lambda fut: metrics.execution_finished(fut.status.value)
    futures.on_release = pool.release

    def lost(runtime: object, generation: int, why: str) -> None:  # a supervisor thread
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody left to tell
            loop.call_soon_threadsafe(futures.fail_lost, runtime, generation, why)

    pool.add_lost_listener(lost)
    executor = Executor(pool, futures, metrics, timeout_s=settings.execution_timeout_s,
                        max_run_bytes=settings.execution_bytes_limit)
    index = ExecutableIndex(settings.l1_max_entries)
    shared = await asyncio.to_thread(_open_shared, settings)
    cluster = _join_cluster(settings, futures, metrics)
    state = app.state
    state.cluster = cluster
    state.drain = Drain(futures, cluster, settings.drain_timeout_s)
    state.runtimes = pool
    state.catalog = Catalog(index.values, shared)
    state.tenants = tenants
    state.models = v2.ModelRegistry(tenants)  # v2 model names -> programs
    state.programs = ProgramStore(pool, tenants, max_entries=settings.programs_max_entries,
                                  max_bytes=settings.programs_max_bytes,
                                  timeout_s=settings.decode_timeout_s)
    state.programs.cluster = cluster
    state.futures = futures
    state.executor = executor
    state.calls = Calls(pool, futures, executor, metrics, index,
                        lookup_timeout_s=2 * settings.compile_timeout_s + 60,
                        tenants=tenants, scheduler=scheduler)
    state.calls.batcher = Batcher(state.calls.compile, pool, futures, executor, metrics)
    # the replicas share their callers' batching
    state.calls.batcher.shared = None if cluster is None else cluster.ownership
    sweeper = asyncio.create_task(futures.sweep_forever(settings.sweep_interval_s))
    if cluster is not None:
        await cluster.start()
    _log_startup(settings, pool, state.catalog)
    # --warm: compile a manifest; /readyz says "warming" until it is done (service/calls/warming.py)
    state.warming = start_warming(settings, state.programs, state.calls, len(pool.runtimes))
    grpc_server = None
    try:
        grpc_server = await v2.start_grpc(app, settings)  # JITSERVE_GRPC_PORT, else None
        yield
    finally:
        if grpc_server is not None:
            await grpc_server.stop(5)
        sweeper.cancel()
        if state.warming is not None:
            await state.warming.stop()
        if cluster is not None:
            await cluster.leave(futures.live())  # drained already, or stopped at once
            await cluster.close()
        pool.remove_lost_listener(lost)
        await state.calls.close()
        await executor.close()
        futures.clear()
        if shared is not None:
            await asyncio.to_thread(shared.close)


def _join_cluster(settings: Settings, futures: FutureStore,
                  metrics: Metrics) -> Cluster[Future] | None:
    """This process as a replica of the service on the shared Redis (``None`` without one)."""
    redis = settings.redis_settings()
    if redis is None:
        return None

    def lost(old: str, new: str) -> None:  # the others gave up on this replica
        futures.fail_all("replica_lost", f"replica {old}, which held this future, was "
                                         "declared lost (Redis did not hear from it)")
        futures.id_prefix = f"{new}."

    cluster = Cluster(redis, peer_url=settings.peer_url or _own_url(settings),
                      secret=settings.peer_secret_bytes(), heartbeat_s=settings.heartbeat_s,
                      future_ttl_s=settings.future_ttl_s, metrics=metrics,
                      document=_future_document, live=futures.live, on_self_lost=lost,
                      peer_idle_s=settings.keepalive_timeout_s / 2)
    futures.id_prefix = f"{cluster.replica_id}."
    futures.on_change = cluster.mirror.changed
    return cluster


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
              "max_device_bytes": settings.max_device_bytes,
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
