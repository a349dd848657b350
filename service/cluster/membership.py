"""Who is alive: heartbeats, the peers' table, and lost replicas.

Each replica writes ``replica:<id>`` (its peer URL, whether it drains) every
``heartbeat_s``, expiring after three periods. A replica whose key expired is
*lost*: the first to notice writes ``lost:<id>`` and says so on ``events``, and
from then on its futures report ``failed`` with ``replica_lost`` everywhere.

A replica the others gave up on while it ran (Redis did not hear it for three
periods) finds its own ``lost:`` key at its next beat: its futures fail here too,
as they do there, and it joins again under a new id.

The heartbeat is also how a replica learns that Redis is down or back: its
``state`` is ``ok`` while Redis answers and ``degraded`` while it does not
(``/readyz`` says which).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from jitserve.wire import REPLICA_ID_HEX, ErrorCode, replica_of

from ..errors import FutureFailed, Unavailable
from ..metrics import Metrics
from .keys import Keys

__all__ = ["Membership", "Peer", "ReplicaLost", "lost_error", "replica_lost"]

log = logging.getLogger("jitserve.cluster")


class ReplicaLost(FutureFailed):
    """The replica holding a future is gone: the future failed with ``replica_lost``."""

    code = ErrorCode.REPLICA_LOST


def lost_error(replica_id: str) -> dict[str, str]:
    """The error a future of the lost replica ``replica_id`` reports."""
    return {"code": ErrorCode.REPLICA_LOST.value,
            "message": f"replica {replica_id}, which held this future, is gone (crashed, or "
                       "drained and stopped); its outputs went with it: run the call again"}


def replica_lost(replica_id: str) -> ReplicaLost:
    """``ReplicaLost`` for a request that needed the lost replica ``replica_id``."""
    error = lost_error(replica_id)
    return ReplicaLost(error["message"], cause=error)


class Peer:
    """Another replica, as its heartbeat describes it."""

    __slots__ = ("draining", "replica_id", "url")

    def __init__(self, replica_id: str, url: str, draining: bool) -> None:
        self.replica_id = replica_id
        self.url = url.rstrip("/")
        self.draining = draining

    @classmethod
    def from_json(cls, replica_id: str, raw: bytes | str) -> Peer:
        doc = json.loads(raw)
        return cls(replica_id, str(doc["url"]), bool(doc.get("draining")))


class Membership:
    """This replica among the others: its id, its heartbeat, what it knows of them.

    Args:
      redis: the shared Redis.
      keys: the deployment's key names.
      peer_url: where the other replicas reach this one.
      heartbeat_s: how often this replica says it is alive.
      future_ttl_s: how long futures live (how long a lost replica is remembered).
      metrics: where lost replicas are counted.
      on_ok: called when Redis answers again (and at the first heartbeat that
        gets through): what could not be written meanwhile is written now.
      on_forget: called with a replica found lost, to wake what waits on its futures.
      on_self_lost: called with ``(old id, new id)`` when this replica was
        declared lost while it ran, before it rejoins under the new id.
    """

    def __init__(self, redis: aioredis.Redis, keys: Keys, *, peer_url: str,
                 heartbeat_s: float, future_ttl_s: float, metrics: Metrics,
                 on_ok: Callable[[], None], on_forget: Callable[[str], None],
                 on_self_lost: Callable[[str, str], None] | None = None) -> None:
        self.replica_id = secrets.token_hex(REPLICA_ID_HEX // 2)
        self.peer_url = peer_url.rstrip("/")
        self.heartbeat_s = heartbeat_s
        self.draining = False
        self.state = "starting"  # "ok" once Redis answered, "degraded" while it does not
        self.started = time.time()
        self._redis = redis
        self._keys = keys
        self._metrics = metrics
        self._on_ok = on_ok
        self._on_forget = on_forget
        self._on_self_lost = on_self_lost
        self._ttl_ms = int(3 * heartbeat_s * 1000)
        self._lost_ttl_ms = int((2 * future_ttl_s + 60) * 1000)
        self._peers: dict[str, Peer] = {}
        self._lost: dict[str, float] = {}

    # -- Redis up or down ------------------------------------------------------------

    def redis_failed(self, error: BaseException) -> None:
        """Redis did not answer: degraded until a heartbeat gets through again."""
        self._set_state("degraded", error)

    def unreachable(self, error: BaseException) -> Unavailable:
        """The error of a request that needs Redis to find another replica's future."""
        self.redis_failed(error)
        return Unavailable("this future is held by another replica, and Redis (which says "
                           f"where replicas are) cannot be reached: {type(error).__name__}; "
                           "retry, or ask the replica that made it")

    def _set_state(self, state: str, why: object = None) -> None:
        if state != self.state:
            level = logging.WARNING if state == "degraded" else logging.INFO
            log.log(level, "cluster %s%s", state, f": {why}" if why else "",
                    extra={"fields": {"cluster": state, "replica": self.replica_id}})
            self.state = state
            if state == "ok":
                self._on_ok()

    # -- heartbeats ------------------------------------------------------------------

    async def run(self) -> None:
        """Beat every ``heartbeat_s``, forever (a task of ``Cluster.start``)."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self.beat()
            except (RedisError, OSError) as e:
                self.redis_failed(e)
            except Exception:  # a bug must not stop the heartbeat for good
                log.exception("heartbeat failed")

    async def beat(self) -> None:
        """Say this replica is alive, and notice the others that are not.

        ``RedisError`` or ``OSError`` when Redis does not answer."""
        me = self.replica_id
        doc = json.dumps({"url": self.peer_url, "draining": self.draining,
                          "started": self.started})
        keys = self._keys
        pipe = self._redis.pipeline(transaction=False)
        pipe.exists(keys.lost(me))
        pipe.set(keys.replica(me), doc, px=self._ttl_ms)
        pipe.zadd(keys.replicas(), {me: time.time()})
        pipe.zrange(keys.replicas(), 0, -1)
        was_lost, _, _, members = await pipe.execute()
        self._set_state("ok")
        if was_lost:
            await self._rejoin()
            return
        others = [m.decode() for m in members if m.decode() != me]
        docs = await self._redis.mget([keys.replica(r) for r in others]) if others else []
        for rid, raw in zip(others, docs):
            if raw is None:
                await self._declare_lost(rid, "stopped sending heartbeats")
            else:
                self._peers[rid] = Peer.from_json(rid, raw)

    async def drain(self) -> None:
        """Say at once, and at every heartbeat from now on, that this replica drains:
        the others stop sending it calls (service/calls/drain.py)."""
        self.draining = True
        try:
            await self.beat()
        except (RedisError, OSError) as e:
            self.redis_failed(e)

    async def leave(self) -> None:
        """Tell the others this replica is gone (its futures are written lost first,
        ``Mirror.leave``). ``RedisError`` or ``OSError`` when Redis does not answer."""
        me, keys = self.replica_id, self._keys
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(keys.lost(me), "left", px=self._lost_ttl_ms)
        pipe.delete(keys.replica(me))
        pipe.zrem(keys.replicas(), me)
        pipe.publish(keys.events(), f"lost {me}")
        await pipe.execute()

    async def _rejoin(self) -> None:
        """The others declared this replica lost (Redis did not hear it for too long):
        its futures fail here too, as they do there, and it joins under a new id."""
        old, self.replica_id = self.replica_id, secrets.token_hex(REPLICA_ID_HEX // 2)
        log.error("replica %s was declared lost while it ran (Redis did not hear from it); "
                  "its futures fail with replica_lost, and it rejoins as %s", old,
                  self.replica_id)
        if self._on_self_lost is not None:
            self._on_self_lost(old, self.replica_id)
        await self.beat()

    # -- the others ------------------------------------------------------------------

    async def _declare_lost(self, rid: str, why: str) -> None:
        keys = self._keys
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(keys.lost(rid), why, px=self._lost_ttl_ms, nx=True)
        pipe.zrem(keys.replicas(), rid)
        pipe.publish(keys.events(), f"lost {rid}")
        first, _, _ = await pipe.execute()
        if first:
            log.warning("replica %s lost: %s; its futures fail with replica_lost", rid, why,
                        extra={"fields": {"replica": rid, "why": why}})
        self.forget(rid)

    def forget(self, rid: str) -> None:
        """Replica ``rid`` is lost: never ask it again, and wake what waits on its futures."""
        self._peers.pop(rid, None)
        if rid not in self._lost:
            self._metrics.replica_lost()
        self._lost[rid] = time.monotonic()
        self._on_forget(rid)
        horizon = time.monotonic() - self._lost_ttl_ms / 1000
        for old in [r for r, t in self._lost.items() if t < horizon]:
            del self._lost[old]

    def is_lost(self, rid: str) -> bool:
        """Whether replica ``rid`` is known here to be lost."""
        return rid in self._lost

    def peer_draining(self, rid: str) -> bool:
        """Whether replica ``rid`` said at its last heartbeat that it drains."""
        peer = self._peers.get(rid)
        return peer is not None and peer.draining

    async def peer(self, rid: str) -> Peer:
        """The live replica ``rid``; ``ReplicaLost`` when it is gone, ``Unavailable``
        when Redis cannot say."""
        peer = self._peers.get(rid)
        if peer is not None:
            return peer
        if rid in self._lost:
            raise replica_lost(rid)
        try:  # a replica newer than our last heartbeat, or one never seen
            raw = await self._redis.get(self._keys.replica(rid))
        except (RedisError, OSError) as e:
            raise self.unreachable(e) from None
        if raw is None:
            raise replica_lost(rid)
        peer = self._peers[rid] = Peer.from_json(rid, raw)
        return peer

    async def gone(self, rid: str) -> bool:
        """Whether replica ``rid``'s heartbeat expired (then it is forgotten here);
        ``False`` when Redis cannot say."""
        try:
            alive = await self._redis.exists(self._keys.replica(rid))
        except (RedisError, OSError):
            return False
        if not alive:
            self.forget(rid)
            return True
        return False

    def elsewhere(self, future_id: str) -> str | None:
        """The replica holding ``future_id`` when it is another one; ``None`` when it
        is this one's, or its id names no replica."""
        rid = replica_of(future_id)
        return rid if rid is not None and rid != self.replica_id else None
