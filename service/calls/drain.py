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
4. the process exits.

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

__all__ = ["Drain", "Draining", "Replica"]

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


class Drain:
    """The drain of one server process (``Services.drain``).

    Args:
      futures: this process's futures.
      cluster: the replicas, or ``None`` (one process: nothing to fetch through).
      timeout_s: how long finished results stay fetchable after the signal.
    """

    def __init__(self, futures: FutureStore, cluster: Replica | None, timeout_s: float) -> None:
        self.futures = futures
        self.cluster = cluster
        self.timeout_s = timeout_s
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
            cluster = self.cluster
            busy = self.futures.busy()
            log.info("draining: %d calls to finish, %d futures held; new calls refused",
                     busy, len(self.futures), extra={"fields": {"busy": busy}})
            if cluster is not None:
                await cluster.drain()
            # One process alone (no Redis): nobody fetches through another replica
            # afterwards, so the drain timeout bounds the wait for the runs as well.
            until = None if cluster is not None else start + self.timeout_s
            while self.futures.busy() and (until is None or time.monotonic() < until):
                await asyncio.sleep(_POLL_S)
            if cluster is not None:
                deadline = start + self.timeout_s
                while len(self.futures) and time.monotonic() < deadline:
                    await asyncio.sleep(_POLL_S)
                left = self.futures.live()
                await cluster.leave(left)
                log.info("drained in %.1fs; %d futures not fetched report replica_lost",
                         time.monotonic() - start, len(left))
        except Exception:
            log.exception("draining failed; exiting")
        finally:
            done()

