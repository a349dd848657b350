"""``Cluster``: this replica's place among the others, made of the package's parts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Generic

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from jitserve import wire
from jitserve.compiler import RedisSettings

from ..metrics import Metrics
from .keys import Keys
from .membership import Membership
from .mirror import F, Mirror
from .ownership import Ownership
from .peers import PeerClient
from .relay import Relay
from .signing import Signing
from .watch import Watch

__all__ = ["Cluster", "remote_replica", "replica_header"]

log = logging.getLogger("jitserve.cluster")

_REPLICA_HEADER = wire.REPLICA_HEADER.encode()


class Cluster(Generic[F]):
    """This replica's place among the others (one per server process).

    Its parts, built in this order, each handed what it needs (the shared Redis
    connection, ``keys``: the names of its keys, and the parts before it):

    - ``membership``: this replica's id, its heartbeat, the others (``Membership``);
    - ``mirror``: this replica's futures' metadata in Redis, and any replica's read
      back (``Mirror``);
    - ``watch``: long-polls on other replicas' futures (``Watch``);
    - ``ownership``: programs and batching shared between replicas (``Ownership``);
    - ``signing``: signatures of forwarded requests (``Signing``);
    - ``relay``: requests forwarded to other replicas (``Relay``).

    Args:
      redis: the shared Redis (its ``key_prefix`` names this deployment).
      peer_url: where the other replicas reach this one.
      secret: the key of forwarded requests' signatures (the same on every replica).
      heartbeat_s: how often this replica says it is alive.
      future_ttl_s: how long futures live (how long a lost replica is remembered).
      metrics: where lost replicas, and bytes moved between replicas, are counted.
      document: a future's metadata as ``GET /v1/futures/{id}`` shows it.
      live: this replica's live futures (written again after Redis was down).
      on_self_lost: called with ``(old id, new id)`` when the others declared this
        replica lost while it ran; it rejoins under the new id.
      peer_idle_s: how long a connection to another replica may stay idle; less than
        the replicas' keep-alive timeout, so that no request is sent on a connection
        the peer is closing.
    """

    def __init__(self, redis: RedisSettings, *, peer_url: str, secret: bytes,
                 heartbeat_s: float, future_ttl_s: float, metrics: Metrics,
                 document: Callable[[F], dict[str, Any]], live: Callable[[], Iterable[F]],
                 on_self_lost: Callable[[str, str], None] | None = None,
                 peer_idle_s: float = 2.0) -> None:
        # One quick retry of a command whose connection broke: after Redis restarts,
        # each pooled connection opened before fails once, and a request on it would
        # answer 503 for nothing (the compiler's client does the same).
        self._redis = aioredis.Redis.from_url(
            redis.url, socket_connect_timeout=redis.connect_timeout_s,
            socket_timeout=max(redis.socket_timeout_s, 2 * heartbeat_s), health_check_interval=30,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)))
        self._http = PeerClient(idle_s=peer_idle_s)
        keys = self.keys = Keys(redis.key_prefix)
        self.membership = Membership(self._redis, keys, peer_url=peer_url,
                                     heartbeat_s=heartbeat_s, future_ttl_s=future_ttl_s,
                                     metrics=metrics, on_ok=self._redis_back,
                                     on_forget=self._replica_lost, on_self_lost=on_self_lost)
        self.mirror: Mirror[F] = Mirror(self._redis, keys, self.membership,
                                        document=document, live=live)
        self.watch = Watch(self._redis, keys, self.membership, self.mirror)
        self.ownership = Ownership(self._redis, keys)
        self.signing = Signing(secret, self.membership)
        self.relay = Relay(self.membership, self.signing, self.mirror, self._http, metrics)
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def replica_id(self) -> str:
        """This replica's id, which starts its futures' ids (a new one if it rejoins)."""
        return self.membership.replica_id

    @property
    def state(self) -> str:
        """``ok`` while Redis answers, ``degraded`` while it does not (``starting``
        before the first heartbeat)."""
        return self.membership.state

    async def start(self) -> None:
        """Join: first heartbeat (if Redis answers), then the background tasks."""
        membership = self.membership
        with contextlib.suppress(RedisError, OSError):
            await membership.beat()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(membership.run(), name="jitserve-heartbeat"),
                       loop.create_task(self.mirror.run(), name="jitserve-mirror"),
                       loop.create_task(self.watch.run(), name="jitserve-listen")]
        log.info("replica %s joined at %s (cluster %s, heartbeat %.1fs)", self.replica_id,
                 membership.peer_url, self.state, membership.heartbeat_s,
                 extra={"fields": {"replica": self.replica_id, "peer_url": membership.peer_url,
                                   "cluster": self.state}})

    async def drain(self) -> None:
        """Tell the others, now and at every heartbeat, that this replica drains."""
        await self.membership.drain()

    async def leave(self, futures: Sequence[F]) -> None:
        """Go: ``futures`` (those still held) report ``replica_lost`` from now on."""
        with contextlib.suppress(RedisError, OSError):
            await self.mirror.leave(futures)
            await self.membership.leave()
        log.info("replica %s left the cluster", self.replica_id)

    async def close(self) -> None:
        """Stop the background tasks, and close the connections (after ``leave``)."""
        for task in self._tasks:
            task.cancel()
        await self.watch.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._http.close()
        with contextlib.suppress(RedisError, OSError):
            await self._redis.aclose()

    # Membership's news for the parts built after it (so handed to it as callbacks):

    def _redis_back(self) -> None:
        """Redis answers again: what was not written meanwhile is written now."""
        self.mirror.resync()

    def _replica_lost(self, rid: str) -> None:
        """Replica ``rid`` is lost: the long-polls on its futures read them again."""
        self.watch.wake_replica(rid)


def remote_replica(cluster: Cluster[Any] | None, future_id: str) -> str | None:
    """The replica holding ``future_id`` when it is another one (and this request may
    be forwarded); ``None`` to serve it here."""
    return None if cluster is None else cluster.membership.elsewhere(future_id)


def replica_header(cluster: Cluster[Any]) -> tuple[bytes, bytes]:
    """The raw header that names this replica in an answer, as it is named now (a
    replica that rejoins is renamed)."""
    return _REPLICA_HEADER, cluster.replica_id.encode()
