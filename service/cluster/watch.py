"""Long-polls on other replicas' futures, woken by Redis pub/sub, never by polling.

A long-poll (``GET /v1/futures/{id}?wait=``) on another replica's future reads
its metadata (``mirror``), and waits on the future's own channel,
``changed:<id>``, for its replica's next write. Each future has its own
channel, and only replicas with a long-poll on it listen: a write costs the
others nothing (one shared channel cost every replica about 0.15 ms per write,
whoever waited).

One pub/sub connection per replica carries those channels and ``events``, where
lost replicas are announced (``membership`` forgets them, and the long-polls on
their futures wake). When that connection breaks it is made again, with every
channel still wanted, and every long-poll reads its future again: a write missed
meanwhile is not missed for long.

A module of its own rather than part of the mirror: the mirror writes and reads
keys, on any connection of the pool; this part keeps one connection of its own,
subscribed, with its reconnections and its subscription confirmations.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from jitserve.wire import replica_of

from .keys import Keys
from .membership import Membership
from .mirror import FINAL, Mirror

__all__ = ["Watch"]

log = logging.getLogger("jitserve.cluster")

_CONFIRM_WAIT_S = 1.0  # the longest a long-poll waits for Redis to confirm its subscription


class Watch:
    """This replica's long-polls on other replicas' futures, and its pub/sub listener.

    Args:
      redis: the shared Redis.
      keys: the deployment's key names.
      membership: whether Redis answers, and the replicas found lost.
      mirror: where the futures' metadata is read.
    """

    def __init__(self, redis: aioredis.Redis, keys: Keys, membership: Membership,
                 mirror: Mirror[Any]) -> None:
        self._redis = redis
        self._keys = keys
        self._membership = membership
        self._mirror = mirror
        self._waiters: dict[str, set[asyncio.Event]] = {}  # long-polls, by future id
        self._confirmed: dict[str, asyncio.Event] = {}  # their channels: subscribed yet?
        self._pubsub: aioredis.client.PubSub | None = None  # the listener's, while connected
        self._sends: set[asyncio.Task[None]] = set()

    async def wait_change(self, future_id: str, owner: str | None, seen: str | None,
                          timeout: float) -> dict[str, Any]:
        """``Mirror.metadata`` once its status is no longer ``seen`` (or final), or after
        ``timeout`` seconds; woken by the owner's publication, never by polling."""
        deadline = time.monotonic() + timeout
        event = asyncio.Event()
        waiting = self._waiters.setdefault(future_id, set())
        waiting.add(event)
        try:
            await self._watch(future_id)
            while True:
                event.clear()  # a change from here on reads the metadata again
                doc = await self._mirror.metadata(future_id, owner)
                left = deadline - time.monotonic()
                if doc["status"] in FINAL or (seen is not None and doc["status"] != seen) \
                        or left <= 0:
                    return doc
                seen = doc["status"]
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await event.wait()
        finally:
            waiting.discard(event)
            if not waiting and self._waiters.get(future_id) is waiting:
                del self._waiters[future_id]
                self._unwatch(future_id)

    def wake_replica(self, rid: str) -> None:
        """Replica ``rid`` is lost: its futures' long-polls read them again (failed now)."""
        self._wake(lambda fid: replica_of(fid) == rid)

    async def _watch(self, future_id: str) -> None:
        """Subscribe to ``future_id``'s changes, and wait until Redis confirms it (a
        second at most), so that none between the read and the wait is missed."""
        channel = self._keys.changed(future_id)
        confirmed = self._confirmed.get(channel)
        if confirmed is None:
            confirmed = self._confirmed[channel] = asyncio.Event()
            if self._pubsub is not None:
                with contextlib.suppress(RedisError, OSError):
                    await self._pubsub.subscribe(channel)
        if self._membership.state != "degraded":
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_CONFIRM_WAIT_S):
                    await confirmed.wait()

    def _unwatch(self, future_id: str) -> None:
        channel = self._keys.changed(future_id)
        if self._confirmed.pop(channel, None) is not None and self._pubsub is not None:
            self._send(self._pubsub.unsubscribe(channel))

    def _send(self, command: Any) -> None:
        """Run a pub/sub command in the background (its answer comes to the listener)."""
        async def run() -> None:
            with contextlib.suppress(RedisError, OSError):
                await command

        task = asyncio.get_running_loop().create_task(run())
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    def _wake(self, which: Callable[[str], bool]) -> None:
        for fid in [f for f in self._waiters if which(f)]:
            for event in self._waiters.get(fid, ()):
                event.set()

    # -- the listener ----------------------------------------------------------------

    async def run(self) -> None:
        """Hear of lost replicas, and of changes of the futures this replica's
        long-polls wait for, forever (a task of ``Cluster.start``)."""
        backoff = 0.1
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self._keys.events(), *self._confirmed)
                self._pubsub = pubsub
                backoff = 0.1
                self._wake(lambda _fid: True)  # anything missed while away: read it again
                async for message in pubsub.listen():
                    self._heard(message)
            except (RedisError, OSError) as e:
                self._membership.redis_failed(e)
            except Exception:
                log.exception("listening for futures' changes failed")
            finally:
                self._pubsub = None
                for confirmed in self._confirmed.values():
                    confirmed.clear()  # subscribed again, and confirmed, on the next connection
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()
            await asyncio.sleep(backoff)
            backoff = min(2 * backoff, 5.0)

    def _heard(self, message: dict[str, Any]) -> None:
        if message.get("channel") is None:  # a health check's pong
            return
        kind, channel = message["type"], message["channel"].decode()
        if kind == "message" and channel == self._keys.events():
            what, _, name = message["data"].decode().partition(" ")
            if what == "lost" and name != self._membership.replica_id:
                self._membership.forget(name)
        elif kind == "message":
            for event in self._waiters.get(self._keys.changed_future(channel), ()):
                event.set()
        elif kind == "subscribe" and (confirmed := self._confirmed.get(channel)) is not None:
            confirmed.set()
        elif kind == "unsubscribe" and channel in self._confirmed and self._pubsub is not None:
            self._send(self._pubsub.subscribe(channel))  # wanted again since: subscribe again

    async def close(self) -> None:
        """Stop the pub/sub commands still under way."""
        sends = list(self._sends)
        for task in sends:
            task.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
