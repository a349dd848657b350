"""Fair turns at the compiler: blocking lookups queued per tenant, served round-robin.

``Compiler.lookup`` blocks (disk, Redis, an XLA compile in a worker process), and
the compile pool runs ``compile_workers`` compiles at once. Handed to a thread
pool directly, lookups would queue first come, first served: one tenant's burst
of slow compiles would hold every worker, and another tenant's one-op first call
would wait behind all of them. ``FairScheduler`` runs at most ``slots`` lookups at
once (what the pool can really run), at most ``per_tenant`` of them for any one
tenant, and when a slot frees it goes to the next tenant in turn that has a
lookup waiting and room under its share, not to the oldest waiter. With
``per_tenant`` below ``slots``, a tenant's queue of slow compiles gets its turns
but never holds more than its share of the slots, and the other tenants' calls
take turns on the rest instead of queueing behind it.

Every method runs on the event loop; only the lookups run in threads.

    scheduler = FairScheduler(slots=2, per_tenant=1)
    lookup = await scheduler.run("tenant-a", compiler.lookup, program, avals, "")
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.concurrency import run_in_threadpool

__all__ = ["FairScheduler"]

T = TypeVar("T")


class FairScheduler:
    """At most ``slots`` blocking calls at once, ``per_tenant`` per tenant, round-robin.

    Args:
      slots: calls running at once, overall.
      per_tenant: calls running at once for one tenant (clamped to ``slots``).
    """

    def __init__(self, slots: int, per_tenant: int) -> None:
        self.slots = max(1, slots)
        self.per_tenant = max(1, min(per_tenant, self.slots))
        self._running: collections.Counter[str] = collections.Counter()
        self._total = 0
        # Tenants with waiters, in turn order: the one served goes to the back.
        self._waiting: dict[str, collections.deque[asyncio.Future[None]]] = {}

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a thread once ``tenant``'s turn comes; its result.

        A caller cancelled while it runs leaves it running: its slot is taken until
        the thread ends, so the slots never overstate what the pool has free.
        """
        return await self.run_async(tenant, run_in_threadpool, fn, *args)

    async def run_async(self, tenant: str, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """``await fn(*args)`` once ``tenant``'s turn comes (a runtime's compile, say)."""
        await self._acquire(tenant)
        task = asyncio.ensure_future(fn(*args))
        task.add_done_callback(lambda t: self._finished(tenant, t))
        return await asyncio.shield(task)

    def running(self, tenant: str) -> int:
        """How many of ``tenant``'s calls run now."""
        return self._running[tenant]

    def waiting(self, tenant: str) -> int:
        """How many of ``tenant``'s calls wait for a turn."""
        return len(self._waiting.get(tenant, ()))

    async def _acquire(self, tenant: str) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(tenant, collections.deque()).append(waiter)
        self._dispatch()
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release(tenant)  # granted just as the caller went away
            else:
                self._forget(tenant, waiter)
            raise

    def _finished(self, tenant: str, task: asyncio.Future[Any]) -> None:
        if not task.cancelled():
            task.exception()  # retrieved: a caller that went away must not log it as lost
        self._release(tenant)

    def _release(self, tenant: str) -> None:
        self._running[tenant] -= 1
        if self._running[tenant] <= 0:
            del self._running[tenant]
        self._total -= 1
        self._dispatch()

    def _forget(self, tenant: str, waiter: asyncio.Future[None]) -> None:
        queue = self._waiting.get(tenant)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._waiting[tenant]

    def _dispatch(self) -> None:
        """Grant free slots to waiting tenants in turn."""
        while self._total < self.slots:
            tenant = self._next_tenant()
            if tenant is None:
                return
            queue = self._waiting[tenant]
            waiter = queue.popleft()
            if not queue:
                del self._waiting[tenant]
            if waiter.done():
                continue  # cancelled; its caller is forgetting it
            self._running[tenant] += 1
            self._total += 1
            waiter.set_result(None)

    def _next_tenant(self) -> str | None:
        """The first tenant in turn with room under its share, moved to the back."""
        for tenant in self._waiting:
            if self._running[tenant] < self.per_tenant:
                self._waiting[tenant] = self._waiting.pop(tenant)
                return tenant
        return None
