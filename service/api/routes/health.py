"""Liveness, readiness, metrics (all open) and ``/v1/devices`` (behind auth)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, Response
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from jitserve.wire import ErrorCode

from ...errors import error_body
from ...metrics import CONTENT_TYPE_LATEST
from ..deps import ServicesDep, get_owner
from ..openapi import errors
from ..schemas import ErrorBody

__all__ = ["router"]

router = APIRouter(tags=["health"])
devices_router = APIRouter(prefix="/v1", tags=["devices"], dependencies=[Depends(get_owner)],
                           responses=errors(ErrorCode.UNAUTHORIZED))


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is up and serving HTTP."""
    return {"status": "ok"}


@router.get("/readyz", responses={503: {"model": ErrorBody, "description":
                                       "error: not_ready, with the failed checks"}})
async def readyz(services: ServicesDep) -> Response:
    """Ready for work: every runtime is up, and the cache directory (if used) is writable.

    ``runtimes`` lists each runtime's state (``up``, ``restarting``, ``backoff``
    after failing to start, with ``retry_in_s``), pid, restarts and last exit. A
    runtime that is restarting after a crash or a deadline is not ready for that
    moment (a second or two). ``cache`` is ``ok`` (the shared Redis is in use),
    ``degraded`` (configured but unreachable: serving from local tiers, retrying)
    or ``local`` (no Redis). A degraded cache is still ready (200): every request
    is served, only slower for executables this host has not seen, so dropping
    the pod would only lose capacity.

    With several replicas (Redis), ``cluster`` is ``ok`` or ``degraded`` (Redis
    unreachable: this replica serves its own futures, not the others'), and
    ``replica`` is this one's id. On SIGTERM the ``draining`` check fails first
    (service/calls/drain.py), so the load balancer stops sending new calls. With
    ``--warm``, the ``warming`` check fails until the manifest is compiled, and
    ``warming`` says how far it is (``done``, ``total``, ``failed``).
    """
    settings, pool = services.settings, services.runtimes
    runtimes = pool.describe()
    checks = {"runtimes": bool(runtimes) and all(r["state"] == "up" for r in runtimes)}
    if settings.disk_cache:
        checks["cache_dir"] = await run_in_threadpool(_writable, settings.cache_dir)
    if services.drain.draining:
        checks["draining"] = False
    warming = services.warming  # --warm: not ready until compiled
    if warming is not None:
        checks["warming"] = warming.finished
    cache = (await pool.report())["cache"]
    cluster = services.cluster
    more: dict[str, Any] = ({} if cluster is None else
                            {"cluster": cluster.state, "replica": cluster.replica_id})
    if warming is not None:
        more["warming"] = warming.describe()
    if all(checks.values()):
        return JSONResponse({"status": "ready", "checks": checks, "cache": cache, **more,
                             "runtimes": runtimes})
    failed = ", ".join(k for k, ok in checks.items() if not ok)
    return JSONResponse(error_body("not_ready", f"not ready: {failed}", checks=checks,
                                   cache=cache, runtimes=runtimes, **more), 503)


@router.get("/metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(services: ServicesDep) -> Response:
    """Prometheus metrics of this process and its runtimes."""
    metrics, futures, runtimes = services.metrics, services.futures, services.runtimes
    report = await runtimes.report(memory=True)
    metrics.relaid(report["relaid"])
    metrics.runs_waited(report["runs_waited"])
    metrics.runs_by_device(report["device_runs"])
    metrics.device_memory(report["device_memory"])
    shared = report["redis"]  # the runtimes use Redis; this process lists
    if shared is not None:
        mine = services.catalog.shared_stats() or {}
        metrics.redis({k: v + mine.get(k, 0) for k, v in shared.items()})
    metrics.runtimes(runtimes.stats())
    body = metrics.render(futures.counts(), futures.device_bytes)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@devices_router.get("/devices")
async def devices(services: ServicesDep) -> dict[str, Any]:
    """The backend, the host's devices, and the device groups: the runtimes that serve
    each, and the largest program it runs (``size`` devices). A single-device program
    runs on any device of its runtime's group (arrays put with ``POST /v1/arrays`` go
    to its first, ``default``), a program sharded across N on the first N of a group
    of at least N."""
    return services.runtimes.devices_document()


def _writable(path: Path) -> bool:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False
