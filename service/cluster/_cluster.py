"""Many replicas, one service: futures any replica can answer for, over Redis.

With ``REDIS_URL`` set, every ``jitserve serve`` process is a *replica* of one
service (docs/deploy.md, "Many replicas"). A future stays where it was computed:
its outputs live on its replica's device and are never copied into Redis. What
Redis holds is what the others need to answer for it:

- **Who is alive.** Each replica writes ``replica:<id>`` (its peer URL, whether
  it drains) every ``heartbeat_s``, expiring after three periods. A replica whose
  key expired is *lost*: the first to notice writes ``lost:<id>``, and from then
  on its futures report ``failed`` with ``replica_lost`` everywhere.
- **Each future's metadata** (``future:<id>``: owner digest, status, avals,
  error, timings), mirrored as it changes, and kept as long as the future. A
  writer task batches the changes into pipelines, a few at once but never two of
  one future, so a key's writes land in order. Each write is published on the
  future's own channel, to which a long-poll on another replica subscribes while
  it waits: it never polls, and replicas that do not wait hear nothing.
  An execute is answered only once its future's metadata is written, so no
  replica ever denies a future that was accepted. One that waits for its outputs
  holds its future back and writes it once, as it answers (a Redis round trip
  per call rather than one per change); one that also deletes it (``keep=false``)
  writes nothing.

A future's id starts with its replica's id (``<replica>.<token>``), so any
replica knows where its data is without asking. A request for another replica's
future is answered from the metadata (status, long-poll) or *forwarded* to that
replica (result, delete, release, and an execute whose inputs live there, which
then runs there: data moves only when one call reads futures of two replicas).
Forwarded requests go to the public routes with an ``X-Jitserve-Peer`` header:
an HMAC of the time, method, path and owner under ``JITSERVE_PEER_SECRET``,
which clients cannot make; a signed request is served locally, as its owner.
They travel on kept-alive connections of ``service.peers``' client.

Redis down: each replica keeps serving its own futures, ``/readyz`` says the
cluster is degraded, and another replica's futures answer ``503 unavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import math
import secrets
import time
import urllib.parse
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from jitserve.compiler import RedisSettings
from jitserve.wire import REPLICA_ID_HEX, ErrorCode, FutureStatus, replica_of

from ..calls.futures import Future
from ..errors import FutureFailed, NotFound, Unauthorized, Unavailable
from ..metrics import Metrics
from .peers import PeerClient, PeerError, PeerResponse

__all__ = ["PEER_HEADER", "OWNER_HEADER", "Cluster", "Peer", "ReplicaLost", "replica_of",
           "scope_path"]

log = logging.getLogger("jitserve.cluster")

PEER_HEADER = "x-jitserve-peer"
OWNER_HEADER = "x-jitserve-owner"
_CLOCK_SKEW_S = 60.0  # a signed request older (or newer) than this is refused
_FLUSH_WAIT_S = 1.0  # the longest an execute waits for its metadata to be written
_WRITES = 4  # metadata writes under way at once (each on its own Redis connection)
_CLAIM_TTL_S = 30 * 86400  # an API key's programs are remembered this long after an upload


class ReplicaLost(FutureFailed):
    """The replica holding a future is gone: the future failed with ``replica_lost``."""

    code = ErrorCode.REPLICA_LOST


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


class Cluster:
    """This replica's place among the others (one per server process).

    Args:
      redis: the shared Redis (its ``key_prefix`` names this deployment).
      peer_url: where the other replicas reach this one.
      secret: the key of forwarded requests' signatures (the same on every replica).
      heartbeat_s: how often this replica says it is alive.
      future_ttl_s: how long futures live (how long a lost replica is remembered).
      metrics: where bytes moved between replicas are counted.
      peer_idle_s: how long a connection to another replica may stay idle; less than
        the replicas' keep-alive timeout, so that no request is sent on a connection
        the peer is closing.
    """

    def __init__(self, redis: RedisSettings, *, peer_url: str, secret: bytes,
                 heartbeat_s: float, future_ttl_s: float, metrics: Metrics,
                 peer_idle_s: float = 2.0) -> None:
        self.replica_id = secrets.token_hex(REPLICA_ID_HEX // 2)
        self.peer_url = peer_url.rstrip("/")
        self.heartbeat_s = heartbeat_s
        self.draining = False
        self.state = "starting"  # "ok" once Redis answered, "degraded" while it does not
        self._on_self_lost: Callable[[str, str], None] | None = None  # (old id, new id)
        self._secret = secret
        self._metrics = metrics
        self._peer_in = metrics.peer_bytes_total.labels("in")
        self._peer_out = metrics.peer_bytes_total.labels("out")
        self._signatures: dict[tuple[str, str, str | None], tuple[float, str]] = {}
        self._checked: dict[str, tuple[tuple[str, str, str | None], float]] = {}
        self._ns = f"{redis.key_prefix}cluster:"
        self._ttl_ms = int(3 * heartbeat_s * 1000)
        self._lost_ttl_ms = int((2 * future_ttl_s + 60) * 1000)
        self._redis = aioredis.Redis.from_url(
            redis.url, socket_connect_timeout=redis.connect_timeout_s,
            socket_timeout=max(redis.socket_timeout_s, 2 * heartbeat_s), health_check_interval=30)
        self._http = PeerClient(idle_s=peer_idle_s)
        self._peers: dict[str, Peer] = {}
        self._lost: dict[str, float] = {}
        self._waiters: dict[str, set[asyncio.Event]] = {}  # long-polls, by future id
        self._confirmed: dict[str, asyncio.Event] = {}  # their channels: subscribed yet?
        self._pubsub: aioredis.client.PubSub | None = None  # the listener's, while connected
        self._sends: set[asyncio.Task[None]] = set()
        # A future's changes are numbered (its version); a write takes the futures that
        # changed and are in no write under way, so writes of one key never overlap and
        # land in order, while a new future need not wait for another's write.
        self._dirty: dict[str, Future] = {}  # changed since their last write began
        self._dirty_event = asyncio.Event()
        self._version: dict[str, int] = {}  # live futures' latest change
        self._stored: dict[str, int] = {}  # the version their last finished write carried
        self._inflight: set[str] = set()  # futures in a write under way
        self._held: set[str] = set()  # futures written only once their execute answers
        self._writes: set[asyncio.Task[None]] = set()
        self._written_event = asyncio.Event()
        self._left = False
        self._resync: Callable[[], list[Future]] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.started = time.time()

    # -- lifecycle -------------------------------------------------------------------

    async def start(self, live: Callable[[], list[Future]], *,
                    on_self_lost: Callable[[str, str], None] | None = None) -> None:
        """Join: first heartbeat (if Redis answers), then the background tasks.

        ``live``: this replica's live futures, written again after Redis was down.
        ``on_self_lost``: called with this replica's old and new ids when the others
        declared it lost while it ran, and it rejoins under a new id.
        """
        self._resync = live
        self._on_self_lost = on_self_lost
        with contextlib.suppress(RedisError, OSError):
            await self._beat()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._beat_forever(), name="jitserve-heartbeat"),
                       loop.create_task(self._write_forever(), name="jitserve-mirror"),
                       loop.create_task(self._listen_forever(), name="jitserve-listen")]
        log.info("replica %s joined at %s (cluster %s, heartbeat %.1fs)", self.replica_id,
                 self.peer_url, self.state, self.heartbeat_s,
                 extra={"fields": {"replica": self.replica_id, "peer_url": self.peer_url,
                                   "cluster": self.state}})

    async def leave(self, futures: Sequence[Future]) -> None:
        """Go: ``futures`` (those still held) report ``replica_lost`` from now on."""
        self._left = True  # no more writes start; the last, below, says they are lost
        batch = {fid: fut for fid, fut in self._dirty.items() if fut.removed is not None}
        batch.update((fut.future_id, fut) for fut in futures if fut.removed is None)
        self._dirty.clear()
        await asyncio.gather(*self._writes, return_exceptions=True)
        with contextlib.suppress(RedisError, OSError):
            await self._write(batch, lost=True)
            pipe = self._redis.pipeline(transaction=False)
            pipe.set(self._key("lost", self.replica_id), "left", px=self._lost_ttl_ms)
            pipe.delete(self._key("replica", self.replica_id))
            pipe.zrem(self._key("replicas"), self.replica_id)
            pipe.publish(self._key("events"), f"lost {self.replica_id}")
            await pipe.execute()
        log.info("replica %s left the cluster", self.replica_id)

    async def close(self) -> None:
        for task in [*self._tasks, *self._sends]:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._sends, return_exceptions=True)
        await self._http.close()
        with contextlib.suppress(RedisError, OSError):
            await self._redis.aclose()

    def _key(self, *parts: str) -> str:
        return self._ns + ":".join(parts)

    def _set_state(self, state: str, why: object = None) -> None:
        if state != self.state:
            level = logging.WARNING if state == "degraded" else logging.INFO
            log.log(level, "cluster %s%s", state, f": {why}" if why else "",
                    extra={"fields": {"cluster": state, "replica": self.replica_id}})
            self.state = state
            if state == "ok" and self._resync is not None:
                for fut in self._resync():  # what was not written while Redis was away
                    self._mark(fut)

    # -- heartbeats and membership ---------------------------------------------------

    async def _beat_forever(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await self._beat()
            except (RedisError, OSError) as e:
                self._set_state("degraded", e)
            except Exception:  # a bug must not stop the heartbeat for good
                log.exception("heartbeat failed")

    async def _beat(self) -> None:
        """Say this replica is alive, and notice the others that are not."""
        me = self.replica_id
        doc = json.dumps({"url": self.peer_url, "draining": self.draining,
                          "started": self.started})
        pipe = self._redis.pipeline(transaction=False)
        pipe.exists(self._key("lost", me))
        pipe.set(self._key("replica", me), doc, px=self._ttl_ms)
        pipe.zadd(self._key("replicas"), {me: time.time()})
        pipe.zrange(self._key("replicas"), 0, -1)
        was_lost, _, _, members = await pipe.execute()
        self._set_state("ok")
        if was_lost:
            await self._rejoin()
            return
        others = [m.decode() for m in members if m.decode() != me]
        docs = await self._redis.mget([self._key("replica", r) for r in others]) if others else []
        for rid, raw in zip(others, docs):
            if raw is None:
                await self._declare_lost(rid, "stopped sending heartbeats")
            else:
                self._peers[rid] = Peer.from_json(rid, raw)

    async def _declare_lost(self, rid: str, why: str) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(self._key("lost", rid), why, px=self._lost_ttl_ms, nx=True)
        pipe.zrem(self._key("replicas"), rid)
        pipe.publish(self._key("events"), f"lost {rid}")
        first, _, _ = await pipe.execute()
        if first:
            log.warning("replica %s lost: %s; its futures fail with replica_lost", rid, why,
                        extra={"fields": {"replica": rid, "why": why}})
        self._forget(rid)

    def _forget(self, rid: str) -> None:
        self._peers.pop(rid, None)
        if rid not in self._lost:
            self._metrics.replica_lost()
        self._lost[rid] = time.monotonic()
        self._wake(lambda fid: replica_of(fid) == rid)
        horizon = time.monotonic() - self._lost_ttl_ms / 1000
        for old in [r for r, t in self._lost.items() if t < horizon]:
            del self._lost[old]

    async def _rejoin(self) -> None:
        """The others declared this replica lost (Redis did not hear it for too long):
        its futures fail here too, as they do there, and it joins under a new id."""
        old, self.replica_id = self.replica_id, secrets.token_hex(REPLICA_ID_HEX // 2)
        log.error("replica %s was declared lost while it ran (Redis did not hear from it); "
                  "its futures fail with replica_lost, and it rejoins as %s", old,
                  self.replica_id)
        if self._on_self_lost is not None:
            self._on_self_lost(old, self.replica_id)
        await self._beat()

    async def beat_now(self) -> None:
        """A heartbeat now (to tell the others at once that this replica drains)."""
        try:
            await self._beat()
        except (RedisError, OSError) as e:
            self._set_state("degraded", e)

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
            raise _lost(rid)
        try:  # a replica newer than our last heartbeat, or one never seen
            raw = await self._redis.get(self._key("replica", rid))
        except (RedisError, OSError) as e:
            raise self._unreachable(e) from None
        if raw is None:
            raise _lost(rid)
        peer = self._peers[rid] = Peer.from_json(rid, raw)
        return peer

    def _unreachable(self, e: BaseException) -> Unavailable:
        self._set_state("degraded", e)
        return Unavailable("this future is held by another replica, and Redis (which says "
                           f"where replicas are) cannot be reached: {type(e).__name__}; "
                           "retry, or ask the replica that made it")

    # -- the futures' metadata ---------------------------------------------------------

    def changed(self, fut: Future) -> None:
        """``FutureStore.on_change``: write ``fut``'s state (soon, with others)."""
        self._mark(fut)

    def _mark(self, fut: Future) -> None:
        if self._left:
            return
        fid = fut.future_id
        self._dirty[fid] = fut
        self._version[fid] = self._version.get(fid, 0) + 1
        self._dirty_event.set()

    def hold(self, fut: Future) -> None:
        """Write nothing of ``fut`` until ``written(fut)`` or ``unhold(fut)``: an execute
        that waits for its outputs writes its future once, as it is when it answers,
        rather than once per change (queued, running, done: each a Redis round trip)."""
        self._held.add(fut.future_id)

    def unhold(self, fut: Future) -> None:
        """Let ``fut``'s changes be written again (a future never written and since
        removed needs no write at all)."""
        fid = fut.future_id
        self._held.discard(fid)
        if fid in self._dirty:
            self._dirty_event.set()

    async def written(self, fut: Future) -> None:
        """Wait until ``fut`` is in Redis as it is now: one write, which starts at once
        unless one of ``fut`` is under way. Its later changes are not waited for, and
        nothing is while Redis is down (a second at most)."""
        self.unhold(fut)
        fid = fut.future_id
        want = self._version.get(fid, 0)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_FLUSH_WAIT_S):
                while (self.state != "degraded" and fid in self._version
                       and self._stored.get(fid, 0) < want):
                    await self._written_event.wait()

    async def _write_forever(self) -> None:
        while True:
            await self._dirty_event.wait()
            self._dirty_event.clear()
            while len(self._writes) >= _WRITES:
                await asyncio.wait(set(self._writes), return_when=asyncio.FIRST_COMPLETED)
            batch = self._take()
            if batch:
                self._inflight.update(batch)
                task = asyncio.get_running_loop().create_task(self._flush(batch))
                self._writes.add(task)
                task.add_done_callback(self._writes.discard)

    def _take(self) -> dict[str, Future]:
        """The changed futures a write may carry now: none under way or held."""
        batch: dict[str, Future] = {}
        for fid, fut in list(self._dirty.items()):
            if fid in self._inflight or fid in self._held:
                continue
            del self._dirty[fid]
            if fut.removed is not None and fid not in self._stored:
                self._version.pop(fid, None)  # never written: there is nothing to delete
                self._notify_written()
            else:
                batch[fid] = fut
        return batch

    def _notify_written(self) -> None:
        """Wake ``written``'s waiters to look again."""
        self._written_event.set()
        self._written_event = asyncio.Event()

    async def _flush(self, batch: dict[str, Future]) -> None:
        versions = {fid: self._version[fid] for fid in batch}
        try:
            await self._write(batch, lost=False)
        except (RedisError, OSError) as e:
            self._set_state("degraded", e)  # rewritten when it is back (_set_state)
        except Exception:
            log.exception("writing futures' metadata failed")
        finally:
            for fid, fut in batch.items():
                self._inflight.discard(fid)
                if fut.removed is not None and fid not in self._dirty:
                    self._version.pop(fid, None)  # gone, and its deletion written (or tried)
                    self._stored.pop(fid, None)
                else:
                    self._stored[fid] = versions[fid]
            self._notify_written()
            if self._dirty:  # changes of these futures made while they were written
                self._dirty_event.set()

    async def _write(self, batch: dict[str, Future], lost: bool) -> None:
        if batch:
            pipe = self._redis.pipeline(transaction=False)
            for fid, fut in batch.items():
                key = self._key("future", fid)
                if fut.removed is not None:
                    pipe.delete(key)
                else:
                    doc = _metadata(fut, self.replica_id, lost)
                    pipe.set(key, json.dumps(doc, default=str),
                             pxat=int((max(fut.expires_at, time.time()) + 1) * 1000))
                pipe.publish(self._key("changed", fid), "changed")
            await pipe.execute()

    async def metadata(self, future_id: str, owner: str | None) -> dict[str, Any]:
        """Another replica's future as ``GET /v1/futures/{id}`` shows it.

        ``NotFound`` when it is unknown or not ``owner``'s; a future whose replica is
        lost reads ``failed`` with ``replica_lost`` (its outputs went with it).
        """
        rid = replica_of(future_id)
        try:
            pipe = self._redis.pipeline(transaction=False)
            pipe.get(self._key("future", future_id))
            pipe.exists(self._key("replica", rid or "-"))
            raw, alive = await pipe.execute()
        except (RedisError, OSError) as e:
            raise self._unreachable(e) from None
        if raw is None:
            raise NotFound(f"no future {future_id!r:.80} (unknown, expired or deleted)")
        doc = json.loads(raw)
        if not _same_owner(doc.pop("owner", None), owner):
            raise NotFound(f"no future {future_id!r:.80} (unknown, expired or deleted)")
        lost = not alive or (rid is not None and rid in self._lost)
        status = doc["status"]
        if lost and rid is not None and (status == FutureStatus.DONE or status not in _FINAL):
            doc["status"] = FutureStatus.FAILED.value
            doc["error"] = _lost_error(rid)
        doc.pop("replica", None)
        return doc

    async def wait_change(self, future_id: str, owner: str | None, seen: str | None,
                          timeout: float) -> dict[str, Any]:
        """``metadata`` once its status is no longer ``seen`` (or final), or after
        ``timeout`` seconds; woken by the owner's publication, never by polling."""
        deadline = time.monotonic() + timeout
        event = asyncio.Event()
        waiting = self._waiters.setdefault(future_id, set())
        waiting.add(event)
        try:
            await self._watch(future_id)
            while True:
                event.clear()  # a change from here on reads the metadata again
                doc = await self.metadata(future_id, owner)
                left = deadline - time.monotonic()
                if doc["status"] in _FINAL or (seen is not None and doc["status"] != seen) \
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

    async def _watch(self, future_id: str) -> None:
        """Subscribe to ``future_id``'s changes, and wait until Redis confirms it (a
        second at most), so that none between the read and the wait is missed.

        Each future has its own channel, and only replicas with a long-poll on it
        listen: a write costs the others nothing (one shared channel cost every
        replica about 0.15 ms per write, whoever waited)."""
        channel = self._key("changed", future_id)
        confirmed = self._confirmed.get(channel)
        if confirmed is None:
            confirmed = self._confirmed[channel] = asyncio.Event()
            if self._pubsub is not None:
                with contextlib.suppress(RedisError, OSError):
                    await self._pubsub.subscribe(channel)
        if self.state != "degraded":
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(_FLUSH_WAIT_S):
                    await confirmed.wait()

    def _unwatch(self, future_id: str) -> None:
        channel = self._key("changed", future_id)
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

    async def _listen_forever(self) -> None:
        """Hear of lost replicas, and of changes of the futures this replica's long-polls
        wait for (``_watch``)."""
        backoff = 0.1
        while True:
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(self._key("events"), *self._confirmed)
                self._pubsub = pubsub
                backoff = 0.1
                self._wake(lambda _fid: True)  # anything missed while away: read it again
                async for message in pubsub.listen():
                    self._heard(message)
            except (RedisError, OSError) as e:
                self._set_state("degraded", e)
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
        if kind == "message" and channel == self._key("events"):
            what, _, name = message["data"].decode().partition(" ")
            if what == "lost" and name != self.replica_id:
                self._forget(name)
        elif kind == "message":
            for event in self._waiters.get(channel.removeprefix(self._key("changed", "")), ()):
                event.set()
        elif kind == "subscribe" and (confirmed := self._confirmed.get(channel)) is not None:
            confirmed.set()
        elif kind == "unsubscribe" and channel in self._confirmed and self._pubsub is not None:
            self._send(self._pubsub.subscribe(channel))  # wanted again since: subscribe again

    # -- who owns which program (API keys on) ------------------------------------------

    async def claim_program(self, owner: str, program_id: str) -> None:
        """Note that ``owner`` uploaded ``program_id``, for the other replicas."""
        key = self._key("programs", owner)
        with contextlib.suppress(RedisError, OSError):
            pipe = self._redis.pipeline(transaction=False)
            pipe.sadd(key, program_id)
            pipe.expire(key, _CLAIM_TTL_S)
            await pipe.execute()

    async def owns_program(self, owner: str, program_id: str) -> bool:
        """Whether ``owner`` uploaded ``program_id`` through any replica."""
        with contextlib.suppress(RedisError, OSError):
            return bool(await self._redis.sismember(self._key("programs", owner), program_id))
        return False

    async def drop_program(self, owner: str, program_id: str) -> None:
        with contextlib.suppress(RedisError, OSError):
            await self._redis.srem(self._key("programs", owner), program_id)

    async def set_batching(self, owner: str | None, program_id: str,
                           config: dict[str, Any] | None) -> None:
        """Keep ``owner``'s batching of ``program_id`` (``None``: off) for the other
        replicas (service/calls/batching.py); ``Unavailable`` when Redis cannot take it."""
        key = self._key("batching", owner or "")
        try:
            if config is None:
                await self._redis.hdel(key, program_id)
            else:
                pipe = self._redis.pipeline(transaction=False)
                pipe.hset(key, program_id, json.dumps(config))
                pipe.expire(key, _CLAIM_TTL_S)
                await pipe.execute()
        except (RedisError, OSError) as e:
            raise Unavailable(f"the shared Redis could not keep the batching: {e}") from None

    async def batching(self, owner: str | None, program_id: str) -> dict[str, Any] | None:
        """``owner``'s batching of ``program_id`` as any replica set it; ``None`` when off.
        ``RedisError`` or ``OSError`` when Redis does not answer."""
        raw = await self._redis.hget(self._key("batching", owner or ""), program_id)
        return None if raw is None else json.loads(raw)

    # -- forwarding ----------------------------------------------------------------------

    def sign(self, method: str, path: str, owner: str | None) -> str:
        """The ``X-Jitserve-Peer`` value of a request this replica forwards.

        A signature is fresh for ``_CLOCK_SKEW_S``: one made for the same request in
        the last second is used again (a chain's calls all sign one path)."""
        now = time.time()
        key = (method, path, owner)
        made = self._signatures.get(key)
        if made is not None and now - made[0] < 1.0:
            return made[1]
        stamp = f"{now:.3f}"
        mac = hmac.new(self._secret, _signed(stamp, method, path, owner), hashlib.sha256)
        value = f"{self.replica_id}.{stamp}.{mac.hexdigest()}"
        if len(self._signatures) >= 1024:
            self._signatures.clear()
        self._signatures[key] = (now, value)
        return value

    def check(self, value: str, method: str, path: str, owner: str | None) -> None:
        """``Unauthorized`` unless ``value`` is a fresh signature of this request.

        A signature found good is remembered, with what it signed, while it is fresh:
        senders reuse theirs for a second (``sign``), and each check costs an HMAC."""
        now, request = time.time(), (method, path, owner)
        seen = self._checked.get(value)
        if seen is not None and seen[0] == request and abs(now - seen[1]) <= _CLOCK_SKEW_S:
            return
        _, _, rest = value.partition(".")
        stamp, _, mac = rest.rpartition(".")
        try:
            made = float(stamp)
        except ValueError:
            made = math.nan  # never fresh
        want = hmac.new(self._secret, _signed(stamp, method, path, owner), hashlib.sha256)
        if not abs(now - made) <= _CLOCK_SKEW_S or not hmac.compare_digest(want.hexdigest(), mac):
            raise Unauthorized("bad or stale peer signature (replicas must share "
                               "JITSERVE_PEER_SECRET and keep their clocks within a minute)")
        if len(self._checked) >= 4096:
            self._checked.clear()
        self._checked[value] = (request, made)

    async def request(self, rid: str, method: str, path: str, owner: str | None, *,
                      query: str = "", raw_path: str | None = None,
                      content: bytes | None = None, headers: dict[str, str] | None = None,
                      wait_s: float = 0.0) -> PeerResponse:
        """Send a request to replica ``rid`` as ``owner``; its answer, whose body the
        caller reads (``read``) or streams, and then releases.

        ``path`` is the path as the peer will read it (and checks the signature of);
        ``raw_path`` and ``query``, when given, are sent as they came (percent-encoded).
        ``ReplicaLost`` when ``rid`` is gone (before, or by the time it fails to answer).
        """
        peer = await self.peer(rid)
        sent = {**headers} if headers else {}
        sent[PEER_HEADER] = self.sign(method, path, owner)
        sent[OWNER_HEADER] = owner or ""
        if content:
            self._peer_out.inc(len(content))
        try:
            return await self._http.request(method, peer.url, _target(path, query, raw_path),
                                            sent, content, read_s=30.0 + wait_s)
        except (PeerError, TimeoutError) as e:
            if await self._gone(rid):
                raise _lost(rid) from None
            raise Unavailable(f"replica {rid} at {peer.url} did not answer: "
                              f"{type(e).__name__}") from None

    @contextlib.asynccontextmanager
    async def forward(self, rid: str, method: str, path: str, owner: str | None, *,
                      params: dict[str, str] | None = None, content: bytes | None = None,
                      headers: dict[str, str] | None = None,
                      wait_s: float = 0.0) -> AsyncIterator[PeerResponse]:
        """``request`` as a context that releases the answer; ``params`` makes the query."""
        response = await self.request(rid, method, path, owner,
                                      query=urllib.parse.urlencode(params or {}),
                                      content=content, headers=headers, wait_s=wait_s)
        try:
            yield response
        finally:
            response.release()

    async def read(self, rid: str, response: PeerResponse) -> bytes:
        """The whole body of ``forward``'s answer, counted; ``Unavailable`` (or
        ``ReplicaLost``) when the peer stops sending it."""
        try:
            body = await response.read()
        except (PeerError, TimeoutError) as e:
            if await self._gone(rid):
                raise _lost(rid) from None
            raise Unavailable(f"replica {rid} broke off its answer: {type(e).__name__}") from None
        self.received(len(body))
        return body

    async def _gone(self, rid: str) -> bool:
        with contextlib.suppress(RedisError, OSError):
            if not await self._redis.exists(self._key("replica", rid)):
                self._forget(rid)
                return True
        return False

    def received(self, nbytes: int) -> None:
        """Count bytes that came from another replica."""
        self._peer_in.inc(nbytes)


_FINAL = {s.value for s in FutureStatus if s.is_final}


def _target(path: str, query: str, raw_path: str | None) -> str:
    """A peer request's target: ``raw_path`` (as the caller sent it) or ``path``
    percent-encoded, and the query as it came."""
    target = raw_path or urllib.parse.quote(path)
    return f"{target}?{query}" if query else target


def scope_path(scope: Mapping[str, Any]) -> str:
    """A request's path as ``Request.url.path`` gives it (what a signature covers),
    without building the whole URL."""
    return scope["path"].replace("?", "%3F").replace("#", "%23").replace("\\", "%5C")


def _signed(stamp: str, method: str, path: str, owner: str | None) -> bytes:
    return f"{stamp}\n{method.upper()}\n{path}\n{owner or ''}".encode()


def _lost_error(rid: str) -> dict[str, str]:
    return {"code": ErrorCode.REPLICA_LOST.value,
            "message": f"replica {rid}, which held this future, is gone (crashed, or drained "
                       "and stopped); its outputs went with it: run the call again"}


def _lost(rid: str) -> ReplicaLost:
    error = _lost_error(rid)
    return ReplicaLost(error["message"], cause=error)


def _metadata(fut: Future, replica_id: str, lost: bool) -> dict[str, Any]:
    from ..api.schemas import FutureView  # schemas imports futures: no cycle

    doc = FutureView.of(fut).model_dump(mode="json")
    if lost and not (fut.status.is_final and fut.status is not FutureStatus.DONE):
        doc["status"] = FutureStatus.FAILED.value
        doc["error"] = _lost_error(replica_id)
    doc["owner"] = fut.owner
    doc["replica"] = replica_id
    return doc


def _same_owner(have: str | None, want: str | None) -> bool:
    if have is None or want is None:
        return have is want
    return hmac.compare_digest(have, want)
