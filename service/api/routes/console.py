"""The console: ``GET /console`` (a page) and the JSON behind each of its panels.

The page is a view: it asks for an API key (kept in the browser's ``sessionStorage``,
sent as ``Authorization: Bearer``), then polls ``/v1/console/devices``, ``compiles``,
``work`` and ``sessions`` and draws them (``static/console.js``, ``console.css``; no
script, font or style from anywhere but this server). The JSON routes are ``/v1``
routes like the others: behind the same keys, and an admin key (or auth off) sees
every key's, any other key only its own programs, sessions, refusals and futures'
memory. Devices and runtimes are the server's, seen by every key (as ``/v1/devices``).

What they show is kept by ``service.console``, in this process, for the last
minutes; nothing here decodes or runs a program.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query
from fastapi.responses import HTMLResponse

from jitserve.wire import ErrorCode

from ...console import WINDOW_S, Viewer, key_label
from ..deps import Owner, ServicesDep, get_owner
from ..openapi import STATIC_DIR, errors
from ..schemas import ConsoleCompiles, ConsoleDevices, ConsoleSessions, ConsoleWork

__all__ = ["page_router", "router"]

router = APIRouter(prefix="/v1/console", tags=["console"], dependencies=[Depends(get_owner)],
                   responses=errors(ErrorCode.UNAUTHORIZED))
page_router = APIRouter()

# The page's own files only; scripts and styles from this server, no inline script.
_PAGE_HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
}

Seconds = Annotated[int, Query(ge=10, le=WINDOW_S, description=(
    f"how far back, in seconds (at most {WINDOW_S}: what the server keeps)"))]


async def get_viewer(services: ServicesDep, owner: Owner) -> Viewer:
    """The caller, and whether it sees every key's (``Settings.is_admin``)."""
    return Viewer(owner, services.settings.is_admin(owner))


ViewerDep = Annotated[Viewer, Depends(get_viewer)]


def _viewer(viewer: Viewer) -> dict[str, Any]:
    return {"key": key_label(viewer.owner), "admin": viewer.admin}


@functools.cache
def _page() -> str:
    return (STATIC_DIR / "console.html").read_text(encoding="utf-8")


@page_router.get("/console", include_in_schema=False)
async def console_page() -> HTMLResponse:
    """The console: devices, compiles, work and sessions, in a browser."""
    return HTMLResponse(_page(), headers=_PAGE_HEADERS)


@router.get("/devices", response_model=ConsoleDevices)
async def console_devices(services: ServicesDep, viewer: ViewerDep) -> dict[str, Any]:
    """Each device with its group and memory, the runtimes (state, restarts, work in
    flight, last exit and why), recent runtime exits, and which keys' futures hold
    device memory (the caller's only, unless it is an admin)."""
    pool, futures, settings = services.runtimes, services.futures, services.settings
    doc = pool.devices_document()
    memory = (await pool.report(memory=True)).get("device_memory", {})
    for device in doc["devices"]:
        device["memory"] = memory.get(device["id"], {})
    exits = services.console.last_exits()
    for runtime in doc["runtimes"]:
        last = exits.get(runtime["index"])
        if last is not None:
            runtime.update(last_exit_at=last["at"], last_exit_code=last["code"])
    holders = [{"key": key_label(owner), "live_futures": live, "device_bytes": held}
               for owner, live, held in sorted(futures.holders(), key=lambda h: -h[2])
               if viewer.sees(owner)]
    return {**doc, "viewer": _viewer(viewer), "exits": services.console.exits(),
            "holders": holders, "device_bytes_in_use": futures.device_bytes,
            "max_device_bytes": settings.device_bytes_limit, "live_futures": len(futures),
            "max_live_futures": settings.max_live_futures}


@router.get("/compiles", response_model=ConsoleCompiles, responses=errors(ErrorCode.BAD_REQUEST))
async def console_compiles(services: ServicesDep, viewer: ViewerDep,
                           seconds: Seconds = 300) -> dict[str, Any]:
    """Recent compiles (newest first): program, signature, tier, seconds and
    ``recompiled_because``, or the refusal; the slowest and the most recompiled
    programs among those kept; and the cache hit rate by tier over ``seconds``."""
    return {"viewer": _viewer(viewer), **services.console.compiles(viewer, seconds)}


@router.get("/work", response_model=ConsoleWork, responses=errors(ErrorCode.BAD_REQUEST))
async def console_work(services: ServicesDep, viewer: ViewerDep,
                       seconds: Seconds = 300) -> dict[str, Any]:
    """Calls per second, latency percentiles (accepted to ended), errors by code and
    quota refusals by key, over ``seconds``, in points of ``step_s`` and in all."""
    return {"viewer": _viewer(viewer), **services.console.work(viewer, seconds)}


@router.get("/sessions", response_model=ConsoleSessions)
async def console_sessions(services: ServicesDep, viewer: ViewerDep) -> dict[str, Any]:
    """The open IFRT proxy sessions: key, runtime, age, requests, bytes each way, and
    the device memory their arrays hold."""
    sessions = services.console.sessions(viewer)
    return {"viewer": _viewer(viewer), "enabled": sessions is not None,
            "sessions": sessions or []}
