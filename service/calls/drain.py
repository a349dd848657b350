"""Graceful shutdown: on SIGTERM a replica drains before it exits.

Kubernetes sends SIGTERM on a rolling update or a scale-down, then waits
``terminationGracePeriodSeconds`` before SIGKILL. Draining, in order:

1. ``/readyz`` answers 503 ``draining`` (the Service stops sending traffic), the
   heartbeat says so (peers stop forwarding calls here), and new executes and
   puts get ``503 unavailable`` with ``Retry-After``;
2. what was accepted compiles and runs to its end (each run is bounded by
   ``JITSERVE_EXECUTION_TIMEOUT_S``; one process alone, without Redis, waits for
   them at most ``JITSERVE_DRAIN_TIMEOUT_S``);
3. with other replicas (Redis), the finished results stay fetchable through any
   of them until every one was fetched and released, or ``JITSERVE_DRAIN_TIMEOUT_S``
   passed since the signal; the replica then leaves, and the futures it still
   holds report ``failed`` with ``replica_lost`` everywhere;
4. open sessions (``Sessions``: the IFRT proxy's, whose arrays live here and cannot
   move) go on until their programs close them, or ``JITSERVE_DRAIN_TIMEOUT_S``
   passed since the signal; those still open then end with a status that says the
   server shut down, and new ones are refused from the signal on;
5. the process exits.

A second SIGTERM (or a SIGINT) stops at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from ..errors import Unavailable
from .futures import Future, FutureStore

__all__ = ["Drain", "Draining", "Replica", "Sessions"]

log = logging.getLogger("jitserve.drain")

_POLL_S = 0.1


class Draining(Unavailable):
    """This replica is shutting down and takes no new work."""

    def __init__(self, retry_after_s: float) -> None:
        super().__init__("this replica is shutting down (draining) and takes no new calls; "
                         "retry, and the load balancer sends it to another replica")
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, round(self.retry_after_s)))}


class Replica(Protocol):
    """What a drain tells the other replicas (``service.cluster.Cluster``)."""

    async def drain(self) -> None: ...

    async def leave(self, futures: Sequence[Future]) -> None: ...


class Sessions(Protocol):
    """Long-lived sessions a drain waits for (``service.ifrt.IfrtService``)."""

    def refuse_new(self) -> None:
        """Open no session from now on, refusing each with a status that says why."""

    def open_count(self) -> int:
        """How many sessions are open."""

    async def end_all(self, reason: str) -> None:
        """End every open session with ``reason`` as its status; return once they
        closed, or a few seconds passed."""


class Drain:
    """The drain of one server process (``Services.drain``).

    Args:
      futures: this process's futures.
      cluster: the replicas, or ``None`` (one process: nothing to fetch through).
      timeout_s: how long finished results stay fetchable, and sessions stay open,
        after the signal.
      sessions: the IFRT proxy's sessions, when it serves (set once it started).
    """

    def __init__(self, futures: FutureStore, cluster: Replica | None, timeout_s: float) -> None:
        self.futures = futures
        self.cluster = cluster
        self.timeout_s = timeout_s
        self.sessions: Sessions | None = None
        self.draining = False
        self._task: asyncio.Task[None] | None = None

    def check_accepting(self) -> None:
        """``Draining`` (a 503) once the drain began."""
        if self.draining:
            raise Draining(self.timeout_s)

    def begin(self, done: Callable[[], None]) -> None:
        """Start draining (on the event loop); ``done`` is called when the process may exit."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(done))

    async def _run(self, done: Callable[[], None]) -> None:
        start = time.monotonic()
        try:
            self.draining = True
            cluster, sessions = self.cluster, self.sessions
            if sessions is not None:
                sessions.refuse_new()
            busy = self.futures.busy()
            open_sessions = sessions.open_count() if sessions is not None else 0
            log.info("draining: %d calls to finish, %d futures held, %d sessions open; new calls "
                     "and sessions refused", busy, len(self.futures), open_sessions,
                     extra={"fields": {"busy": busy, "sessions": open_sessions}})
            if cluster is not None:
                await cluster.drain()
            # One process alone (no Redis): nobody fetches through another replica
            # afterwards, so the drain timeout bounds the wait for the runs as well.
            until = None if cluster is not None else start + self.timeout_s
            while self.futures.busy() and (until is None or time.monotonic() < until):
                await asyncio.sleep(_POLL_S)
            deadline = start + self.timeout_s
            while (((cluster is not None and len(self.futures))
                    or (sessions is not None and sessions.open_count()))
                   and time.monotonic() < deadline):
                await asyncio.sleep(_POLL_S)
            if sessions is not None and sessions.open_count():
                log.info("draining: %d sessions still open after %g s (JITSERVE_DRAIN_TIMEOUT_S) "
                         "end now", sessions.open_count(), self.timeout_s)
                await sessions.end_all(
                    f"jitserve is shutting down (SIGTERM): this session was still open when the "
                    f"server's drain of {self.timeout_s:g} s (JITSERVE_DRAIN_TIMEOUT_S) ended; "
                    "its arrays and executables are gone; open a new session")
            if cluster is not None:
                left = self.futures.live()
                await cluster.leave(left)
                log.info("drained in %.1fs; %d futures not fetched report replica_lost",
                         time.monotonic() - start, len(left))
        except Exception:
            log.exception("draining failed; exiting")
        finally:
            done()

