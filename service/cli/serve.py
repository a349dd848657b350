"""``jitserve serve``: the app under uvicorn, where a first SIGTERM drains before the exit.

Kubernetes sends SIGTERM on a rolling update or a scale-down, then SIGKILL after
``terminationGracePeriodSeconds``; the drain (``service.calls.drain``) uses that
time to finish what was accepted. A second SIGTERM (or a SIGINT) stops at once.
"""

from __future__ import annotations

import asyncio
import gc
import signal
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..app import JitserveApp
    from ..metrics import Metrics
    from ..settings import Settings

__all__ = ["connection_options", "retain_freed_memory", "run_server"]


def run_server(app: JitserveApp, **options: Any) -> None:
    """``uvicorn.run(app, **options)``, where a first SIGTERM drains (``Services.drain``)
    before the server stops."""
    import uvicorn

    class _DrainingServer(uvicorn.Server):
        draining = False

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            try:
                drain = app.services.drain
            except RuntimeError:  # not serving yet, or any more
                drain = None
            if sig != signal.SIGTERM or drain is None or self.draining or self.should_exit:
                super().handle_exit(sig, frame)
                return
            self.draining = True
            try:
                loop = asyncio.get_running_loop()  # the handler runs on the loop's thread
            except RuntimeError:
                super().handle_exit(sig, frame)
                return
            loop.call_soon_threadsafe(drain.begin, lambda: super(_DrainingServer, self)
                                      .handle_exit(sig, None))

        async def startup(self, sockets: Any = None) -> None:
            from ..memory import freeze_startup_objects

            await super().startup(sockets=sockets)
            freeze_startup_objects()
            # Read once: counting them walks them all (13 ms for 120,000).
            app.metrics.gc_frozen.set(gc.get_freeze_count())

    _DrainingServer(uvicorn.Config(app, **options)).run()


def retain_freed_memory(max_bytes: int) -> None:
    """Keep freed heap memory up to ``max_bytes`` for the next bodies (``service.memory``)."""
    from ..memory import HeapTrimmer
    from ..memory import retain_freed_memory as retain

    if retain(max_bytes):
        HeapTrimmer(max_bytes).start()  # a daemon thread: it ends with the process


def connection_options(settings: Settings, metrics: Metrics) -> dict[str, Any]:
    """uvicorn's options for slow, idle and big-headed connections (``service.api.connections``)."""
    from ..api.connections import HeadLimits, guarded_protocol

    limits = HeadLimits(settings.header_timeout_s, settings.max_head_bytes,
                        metrics.connection_closed)
    # ws="none": no route speaks WebSocket, and an upgraded connection would outlive the guard.
    return {"http": guarded_protocol(limits), "ws": "none",
            "timeout_keep_alive": settings.keepalive_timeout_s,
            "h11_max_incomplete_event_size": settings.max_head_bytes,
            "limit_concurrency": settings.max_connections}
