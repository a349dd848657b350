"""The FastAPI application.

    from jitserve.service.app import create_app
    app = create_app()              # settings from the JITSERVE_* environment
    # uvicorn.run(app, host="127.0.0.1", port=8000)

The lifespan builds the shared objects (compiler, with its Redis tiers when
``REDIS_URL`` is set, program store, future store, executor) on ``app.state``;
route handlers reach them through ``service.deps``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

from jitserve.compiler import Compiler, CompilerConfig
from jitserve.service.calls import Calls
from jitserve.service.errors import install_error_handlers
from jitserve.service.executor import Executor
from jitserve.service.futures import FutureStore
from jitserve.service.metrics import Metrics, RequestMetricsMiddleware
from jitserve.service.openapi import install_docs
from jitserve.service.programs import ProgramStore
from jitserve.service.quotas import Quotas
from jitserve.service.routes import executables as executables_routes
from jitserve.service.routes import futures as futures_routes
from jitserve.service.routes import health as health_routes
from jitserve.service.routes import programs as programs_routes
from jitserve.service.scheduler import FairScheduler
from jitserve.service.settings import Settings
from jitserve.service.tenants import Tenants

__all__ = ["create_app", "make_compiler"]

log = logging.getLogger("jitserve")


def make_compiler(settings: Settings) -> Compiler:
    """A ``Compiler`` configured from ``settings``: L1, disk (unless off), Redis (if set)."""
    limits = settings.compiler_limits()
    # An unreachable Redis does not stop the start: its tiers begin degraded and retry.
    return Compiler(CompilerConfig(
        cache_dir=settings.cache_dir if settings.disk_cache else None,
        l1_max_entries=settings.l1_max_entries, l1_max_bytes=settings.l1_max_bytes,
        programs_max_entries=settings.programs_max_entries,
        programs_max_bytes=settings.programs_max_bytes,
        compile_timeout_s=settings.compile_timeout_s, compile_workers=settings.compile_workers,
        disk_max_bytes=settings.disk_cache_max_bytes,
        limits=limits, redis=settings.redis_settings(),
        cache_secret=settings.compiler_cache_secret()))


def create_app(settings: Settings | None = None, *, compiler: Compiler | None = None) -> FastAPI:
    """The jitserve app.

    Args:
      settings: configuration; read from the environment when omitted.
      compiler: a compiler to share (tests reuse one); the app makes and closes
        its own when omitted.
    """
    settings = settings or Settings()
    metrics = Metrics()
    app = FastAPI(title="jitserve", version="0.1.0", lifespan=_lifespan_for(compiler),
                  docs_url=None, redoc_url=None,  # served by install_docs, without a CDN
                  description="JIT-as-a-service for JAX and XLA: send programs, get array "
                              "futures back. See docs/api.md.")
    app.state.settings = settings
    app.state.metrics = metrics
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)
    install_error_handlers(app)
    install_docs(app)
    app.include_router(health_routes.router)
    app.include_router(health_routes.devices_router)
    app.include_router(programs_routes.router)
    app.include_router(executables_routes.router)
    app.include_router(futures_routes.router)
    return app


def _lifespan_for(shared: Compiler | None):  # noqa: ANN202 - FastAPI's lifespan type
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings: Settings = app.state.settings
        compiler = shared or await asyncio.to_thread(make_compiler, settings)
        try:
            async with _serving(app, settings, compiler):
                yield
        finally:
            if shared is None:
                await asyncio.to_thread(compiler.close)  # and its Redis connection

    return lifespan


@contextlib.asynccontextmanager
async def _serving(app: FastAPI, settings: Settings, compiler: Compiler) -> AsyncIterator[None]:
    """Everything that lives as long as the server, on ``app.state``."""
    metrics: Metrics = app.state.metrics
    # Tenants: scoping and quotas
    workers = compiler.config.compile_workers
    quotas = Quotas.from_settings(settings, workers)
    tenants = Tenants(quotas, scoped=settings.auth_enabled)
    scheduler = FairScheduler(workers, quotas.compile_slots) if tenants.scoped else None
    futures = FutureStore(ttl_s=settings.future_ttl_s, max_live=settings.max_live_futures,
                          max_device_bytes=settings.max_device_bytes,
                          owner_max_live=quotas.live_futures if tenants.scoped else None,
                          owner_max_device_bytes=quotas.device_bytes if tenants.scoped else None)
    futures.on_final = lambda fut: metrics.execution_finished(fut.status.value)
    executor = Executor(compiler.device, futures, metrics, settings.executor_threads,
                        max_run_bytes=settings.execution_bytes_limit)
    state = app.state
    state.compiler = compiler
    state.tenants = tenants
    state.programs = ProgramStore(compiler.programs, tenants)
    state.futures = futures
    state.executor = executor
    state.calls = Calls(compiler, futures, executor, metrics, tenants, scheduler)
    sweeper = asyncio.create_task(futures.sweep_forever(settings.sweep_interval_s))
    _log_startup(settings, compiler)
    try:
        yield
    finally:
        sweeper.cancel()
        await executor.close()
        futures.clear()


def _log_startup(settings: Settings, compiler: Compiler) -> None:
    """One line: the device, the cache tiers, whether auth is on, the main limits."""
    backend = compiler.backend_info()
    shared = compiler.catalog.shared_url
    tiers = ["memory", *([f"disk {settings.cache_dir}"] if settings.disk_cache else []),
             *([f"redis {shared} ({compiler.catalog.state})"] if shared else [])]
    auth = f"on ({len(settings.api_keys)} keys)" if settings.auth_enabled else "off"
    limits = {"max_body_bytes": settings.max_body_bytes,
              "max_program_bytes": settings.max_program_bytes,
              "max_device_bytes": settings.max_device_bytes,
              "max_live_futures": settings.max_live_futures,
              "compile_timeout_s": settings.compile_timeout_s,
              "future_ttl_s": settings.future_ttl_s}
    log.info("jitserve ready on %s %s (%s), cache %s, auth %s, limits %s",
             backend["platform"], backend["device_kind"], compiler.device, " + ".join(tiers),
             auth, ", ".join(f"{k}={v}" for k, v in limits.items()),
             extra={"fields": {"platform": backend["platform"],
                               "device_kind": backend["device_kind"], "tiers": tiers,
                               "auth": settings.auth_enabled, "limits": limits}})
