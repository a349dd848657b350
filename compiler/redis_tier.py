"""A Redis L2 tier: compiled executables and uploaded programs shared by every process.

Every jitserve process that points at the same Redis shares what any of them
compiled: an executable compiled on one host is a cache hit on every other host
with the same device kind and versions (both are in the cache key, and
``compiler.cache.decode_entry`` refuses an entry whose checksum, jaxlib version,
platform or device kind does not match).

Executables are code. Point this tier only at a Redis that is private to the
deployment and trusted: whoever can write to it can make the servers run what
they wrote. Use ``rediss://`` and a password or ACL user off a private network.

Key layout under ``jitserve:v<LAYOUT_VERSION>:<deployment prefix>:``::

    exe:<executable_id>     the entry bytes (``encode_entry``: checksummed, zstd)
    meta:<executable_id>    a hash beside it: sizes, compile seconds, hits, versions
    prog:<program_id>       a hash: the uploaded program's bytes and format
    lock:<executable_id>    the compile lock: a random token, with an expiry
    flight:<executable_id>  a pub/sub channel: "stored" / "released" wake waiters

A Redis failure never fails a request: the tier counts it, logs it once, and
answers "miss" (or skips the write) while a circuit breaker keeps it off Redis;
a background probe retries with exponential backoff and resumes on the first
answer. Example::

    tier = RedisTier(RedisSettings.from_url("redis://:pw@cache:6379/0", prefix="prod"))
    compiler = Compiler(CompilerConfig(cache_dir=None, extra_tiers=(tier,)))
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import re
import secrets
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from jitserve.compiler.cache import CorruptEntry, decode_entry
from jitserve.wire import TierName

__all__ = [
    "EntryPage",
    "LAYOUT_VERSION",
    "RedisSettings",
    "RedisTier",
    "RedisUnavailable",
    "StoredProgram",
]

logger = logging.getLogger("jitserve.compiler.redis")

# Layout of keys and records in Redis. 2026-11-21: 1, first layout. A new layout
# gets a new key prefix, so old and new servers never read each other's records.
LAYOUT_VERSION = 1

_PREFIX_RE = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # no glob characters: the prefix goes into SCAN MATCH
_SCHEMES = ("redis", "rediss", "unix")
_T = TypeVar("_T")

# On a hit: count it and refresh the expiries, only if the record is still there
# (under allkeys-lru either key may have been evicted on its own).
_TOUCH = """
if redis.call('EXISTS', KEYS[2]) == 1 and redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HINCRBY', KEYS[2], 'hits', 1)
  redis.call('HSET', KEYS[2], 'last_hit', ARGV[1])
end
local ttl = tonumber(ARGV[2])
if ttl > 0 then
  redis.call('PEXPIRE', KEYS[1], ttl)
  redis.call('PEXPIRE', KEYS[2], ttl)
end
return 1
"""

# One round trip to decide: the entry is there, we now hold the lock, or another
# process does (answer: its lock's milliseconds left).
_ACQUIRE = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 'entry' end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 'locked' end
return redis.call('PTTL', KEYS[1])
"""

# Renew or release only a lock we still hold: compare the token, then act.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2], 'released')
  return 1
end
return 0
"""

_META_FLOATS = ("compile_seconds", "created", "last_hit")
_META_INTS = ("size", "raw_size", "hits")


class RedisUnavailable(Exception):
    """Redis could not answer a query that has no local fallback (listing, metadata)."""


@dataclasses.dataclass(frozen=True)
class RedisSettings:
    """How to reach Redis and how to use it.

    Attributes:
      url: ``redis://[user:password@]host:port/db``, ``rediss://...`` (TLS) or
        ``unix:///path.sock``. A password or ACL user goes in the URL.
      prefix: the deployment's name inside the key prefix
        ``jitserve:v1:<prefix>:``; deployments sharing a Redis keep apart by it.
      ttl_s: entries and programs expire this long after their last write or hit;
        ``None`` keeps them until Redis evicts them (``maxmemory`` + ``allkeys-lru``).
      lock_ttl_s: a compile lock's expiry; the holder renews it every third of
        that, so a dead holder blocks others for at most this long.
      wait_s: how long a process waits for another's compile of the same key
        before compiling itself.
      connect_timeout_s, socket_timeout_s: small, so a dead Redis costs little.
      max_backoff_s: the longest pause between probes of a Redis that is down.
    """

    url: str
    prefix: str = "default"
    ttl_s: float | None = None
    lock_ttl_s: float = 10.0
    wait_s: float = 60.0
    connect_timeout_s: float = 0.5
    socket_timeout_s: float = 5.0
    max_backoff_s: float = 30.0

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisSettings:
        """Settings for ``url``; ``options`` are the other fields, checked here.

        Example: ``RedisSettings.from_url("rediss://jitserve:pw@cache:6380/0", prefix="prod")``.
        """
        settings = cls(url=url, **options)
        settings.check()
        return settings

    def check(self) -> None:
        """Raise ``ValueError`` naming the first field that is wrong."""
        scheme = urllib.parse.urlsplit(self.url).scheme
        if scheme not in _SCHEMES:
            raise ValueError(f"Redis URL scheme is {scheme!r}; expected one of {', '.join(_SCHEMES)}")
        if not _PREFIX_RE.fullmatch(self.prefix):
            raise ValueError(f"Redis key prefix {self.prefix!r} must be 1-64 of A-Z a-z 0-9 _ . -")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise ValueError(f"Redis ttl_s is {self.ttl_s}; expected a positive number or None")
        for name in ("lock_ttl_s", "connect_timeout_s", "socket_timeout_s", "max_backoff_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Redis {name} is {getattr(self, name)}; expected > 0")
        if self.wait_s < 0:
            raise ValueError(f"Redis wait_s is {self.wait_s}; expected >= 0")

    @property
    def key_prefix(self) -> str:
        return f"jitserve:v{LAYOUT_VERSION}:{self.prefix}:"

    @property
    def redacted_url(self) -> str:
        """The URL with its password masked, for logs and status pages."""
        parts = urllib.parse.urlsplit(self.url)
        if parts.password is None:
            return self.url
        user = parts.username or ""
        host = parts.hostname or ""
        netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
        return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


@dataclasses.dataclass(frozen=True)
class StoredProgram:
    """An uploaded program as kept in Redis: its bytes and declared format."""

    data: bytes = dataclasses.field(repr=False)
    format: str | None


@dataclasses.dataclass(frozen=True)
class EntryPage:
    """One page of ``RedisTier.list_entries``.

    Attributes:
      entries: metadata records (see ``RedisTier.metadata``).
      next_cursor: pass it back for the next page; ``None`` after the last one.
    """

    entries: list[dict[str, Any]]
    next_cursor: str | None


class _Breaker:
    """Keeps the tier off Redis after a connection failure, until a probe gets an answer.

    While open, operations cost nothing: they are local misses. A daemon thread
    pings Redis after 0.5 s, 1 s, 2 s, ... up to ``max_backoff_s`` and closes the
    breaker on the first answer.
    """

    def __init__(self, probe: Callable[[], None], on_close: Callable[[], None],
                 max_backoff_s: float, describe: str) -> None:
        self._probe, self._on_close = probe, on_close
        self._max_backoff_s, self._describe = max_backoff_s, describe
        self._open = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors = 0

    @property
    def is_open(self) -> bool:
        return self._open

    def failed(self, what: str, error: BaseException) -> None:
        """Count a failure; the first one while closed opens the breaker and starts probing."""
        with self._lock:
            self.errors += 1
            if self._open or self._stop.is_set():
                return
            self._open = True
            self._thread = threading.Thread(target=self._probe_loop, name="jitserve-redis-probe",
                                            daemon=True)
            self._thread.start()
        logger.warning("Redis at %s failed (%s: %r); serving from local tiers and retrying "
                       "with backoff", self._describe, what, error)

    def count(self) -> None:
        """Count an error that does not open the breaker (Redis answered, with an error)."""
        with self._lock:
            self.errors += 1

    def close(self) -> None:
        """Stop probing (at shutdown)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _probe_loop(self) -> None:
        backoff = 0.5
        while not self._stop.wait(backoff):
            try:
                self._probe()
            except redis.RedisError as e:
                self.count()
                logger.debug("Redis probe failed (%r); next in %.1f s", e, backoff)
                backoff = min(backoff * 2, self._max_backoff_s)
                continue
            self._on_close()  # before reopening: drop connections to the old server
            with self._lock:
                self._open = False
            logger.warning("Redis at %s is back; using it again", self._describe)
            return


class RedisTier:
    """Serialized executables and programs in Redis, with a cross-process compile lock.

    Implements ``compiler.cache.Tier`` (``get``/``put``/``delete``) and
    ``compiler.cache.SharedTier`` (``compile_lock``). Its methods never raise a
    Redis error into a request: reads miss and writes are skipped while Redis
    is unreachable. ``list_entries`` and ``metadata`` raise ``RedisUnavailable``
    instead, as they have no local answer.

    Args:
      settings: see ``RedisSettings``.
      client: a ``redis.Redis`` to use instead of one built from the URL (tests).
    """

    name = TierName.REDIS

    def __init__(self, settings: RedisSettings, *, client: redis.Redis | None = None) -> None:
        settings.check()
        self.settings = settings
        self._prefix = settings.key_prefix
        self._ttl_ms = int(settings.ttl_s * 1000) if settings.ttl_s else 0
        self._lock_ttl_ms = max(1, int(settings.lock_ttl_s * 1000))
        self._redis = client if client is not None else _connect(settings)
        self._touch = self._redis.register_script(_TOUCH)
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._renew = self._redis.register_script(_RENEW)
        self._release = self._redis.register_script(_RELEASE)
        self._breaker = _Breaker(self._ping, self._drop_connections, settings.max_backoff_s,
                                 settings.redacted_url)
        self._counts_lock = threading.Lock()
        self._counts = {"hits": 0, "misses": 0, "bytes_read": 0, "bytes_written": 0}
        self._run("connect", self._load_scripts, None)  # a dead Redis at start: degraded now

    # -- Tier ----------------------------------------------------------------------

    def get(self, key: str) -> bytes | None:
        """The entry bytes of ``key``, or ``None`` (a miss, or Redis is down)."""
        touch_keys = [self._k("exe", key), self._k("meta", key)]
        touch_args = [repr(time.time()), self._ttl_ms]

        def op(r: redis.Redis) -> Any:
            # One round trip: EVALSHA directly, since a pipeline running a Script
            # object first asks SCRIPT EXISTS every time.
            pipe = r.pipeline(transaction=False)
            pipe.get(touch_keys[0])
            pipe.evalsha(self._touch.sha, 2, *touch_keys, *touch_args)
            data, touched = pipe.execute(raise_on_error=False)
            if isinstance(data, Exception):
                raise data
            if isinstance(touched, redis.exceptions.NoScriptError):  # Redis restarted
                self._touch(keys=touch_keys, args=touch_args)
            return data

        data = self._run("get", op, None)
        self._count("hits" if data is not None else "misses",
                    bytes_read=len(data) if data is not None else 0)
        return data

    def put(self, key: str, data: bytes) -> None:
        """Store an entry (``encode_entry`` bytes) with its metadata record beside it."""
        try:
            entry = decode_entry(data, {"key": key})
        except CorruptEntry as e:
            logger.warning("not storing a bad entry for %s in Redis: %s", key, e)
            return
        meta = self._meta_record(key, len(data), entry.meta, len(entry.executable))

        def op(r: redis.Redis) -> None:
            pipe = r.pipeline(transaction=True)  # readers see both records or neither
            pipe.set(self._k("exe", key), data, px=self._ttl_ms or None)
            pipe.delete(self._k("meta", key))
            pipe.hset(self._k("meta", key), mapping=meta)
            if self._ttl_ms:
                pipe.pexpire(self._k("meta", key), self._ttl_ms)
            pipe.publish(self._k("flight", key), "stored")
            pipe.execute()
            self._count(bytes_written=len(data))

        self._run("put", op, None)

    def delete(self, key: str) -> None:
        """Drop an entry and its metadata (a corrupt entry, or an operator's request)."""
        self._run("delete", lambda r: r.delete(self._k("exe", key), self._k("meta", key)), None)

    # -- metadata and listing (for /v1/executables) --------------------------------------

    def metadata(self, key: str) -> dict[str, Any] | None:
        """The metadata record of ``key``, or ``None`` when it is not cached.

        Fields: ``executable_id``, ``program_id``, ``size`` (stored bytes,
        compressed), ``raw_size`` (executable bytes), ``compile_seconds``,
        ``created``, ``last_hit`` (Unix seconds or ``None``), ``hits``,
        ``jax_version``, ``jaxlib_version``, ``platform``, ``device_kind``.
        Raises ``RedisUnavailable`` when Redis cannot answer.
        """
        def op(r: redis.Redis) -> list[Any]:
            pipe = r.pipeline(transaction=False)
            pipe.hgetall(self._k("meta", key))
            pipe.exists(self._k("exe", key))
            return pipe.execute()

        raw, exists = self._query("metadata", op)
        return _parse_meta(raw) if raw and exists else None

    def list_entries(self, cursor: str | None = None, limit: int = 100) -> EntryPage:
        """A page of metadata records, by ``SCAN`` over this prefix's records.

        A page holds about ``limit`` records (``SCAN``'s count is a hint); follow
        ``next_cursor`` until it is ``None``. As with ``SCAN``, a record present
        the whole time is listed at least once. Raises ``RedisUnavailable``.
        """
        scan_cursor = _parse_cursor(cursor)
        keys: list[bytes] = []
        while True:
            scan_cursor, batch = self._query("list", lambda r: r.scan(
                scan_cursor, match=self._k("meta", "*"), count=max(limit, 10)))
            keys.extend(batch)
            if scan_cursor == 0 or len(keys) >= limit:
                break
        entries = self._read_records(keys)
        return EntryPage(entries, str(scan_cursor) if scan_cursor else None)

    # -- programs (for the service's program store) ---------------------------------------

    def put_program(self, program_id: str, data: bytes, format: str | None) -> None:
        """Keep an uploaded program, so that any process can execute it."""
        def op(r: redis.Redis) -> None:
            pipe = r.pipeline(transaction=True)
            pipe.hset(self._k("prog", program_id), mapping={"data": data, "format": format or ""})
            if self._ttl_ms:
                pipe.pexpire(self._k("prog", program_id), self._ttl_ms)
            pipe.execute()
            self._count(bytes_written=len(data))

        self._run("put_program", op, None)

    def has_program(self, program_id: str) -> bool | None:
        """Whether Redis keeps ``program_id``; ``None`` when Redis cannot say."""
        exists = self._run("has_program", lambda r: r.exists(self._k("prog", program_id)), None)
        return None if exists is None else bool(exists)

    def get_program(self, program_id: str) -> StoredProgram | None:
        """The program stored under ``program_id``; ``None`` if absent, damaged, or Redis is down.

        The bytes are untrusted input: the caller decodes and validates them as
        it would an upload. Their sha256 must be ``program_id``.
        """
        def op(r: redis.Redis) -> list[Any]:
            if self._ttl_ms:
                r.pexpire(self._k("prog", program_id), self._ttl_ms)
            return r.hmget(self._k("prog", program_id), ["data", "format"])

        data, fmt = self._run("get_program", op, [None, None])
        if data is None:
            return None
        self._count(bytes_read=len(data))
        if hashlib.sha256(data).hexdigest() != program_id:
            logger.warning("Redis program %s does not match its hash; dropping it", program_id)
            self._run("delete_program", lambda r: r.delete(self._k("prog", program_id)), None)
            return None
        return StoredProgram(data, (fmt or b"").decode() or None)

    # -- the cross-process compile lock ---------------------------------------------------

    @contextlib.contextmanager
    def compile_lock(self, key: str) -> Iterator[bool]:
        """Elect one compiler of ``key`` among all processes sharing this Redis.

        Yields ``True`` when the caller should compile: it holds the lock (renewed
        in the background, released on exit by compare-and-delete), or Redis is
        down, or it waited ``wait_s`` in vain. Yields ``False`` when the entry
        appeared meanwhile: re-read the tiers. Never raises a Redis error.
        """
        lease = self._acquire_or_wait(key)
        if lease is None:
            yield False
            return
        try:
            yield True
        finally:
            lease.release()

    # -- health and counters --------------------------------------------------------------

    @property
    def available(self) -> bool:
        """Whether the tier is using Redis now (``False``: degraded, probing)."""
        return not self._breaker.is_open

    def stats(self) -> dict[str, Any]:
        """Counters for metrics: ``state``, ``errors``, ``hits``, ``misses``, ``bytes_read``,
        ``bytes_written`` (all since start, monotonic)."""
        with self._counts_lock:
            counts = dict(self._counts)
        return {"state": "ok" if self.available else "degraded",
                "errors": self._breaker.errors, **counts}

    def close(self) -> None:
        """Stop the probe thread and close connections."""
        self._breaker.close()
        with contextlib.suppress(redis.RedisError):
            self._redis.close()

    # -- internals ------------------------------------------------------------------------

    def _k(self, kind: str, name: str) -> str:
        return f"{self._prefix}{kind}:{name}"

    def _run(self, what: str, op: Callable[[redis.Redis], _T], default: _T) -> _T:
        """``op(redis)``, or ``default`` when Redis is down or fails (counted, logged)."""
        if self._breaker.is_open:
            return default
        try:
            return op(self._redis)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            self._breaker.failed(what, e)
        except redis.RedisError as e:
            # Redis answered (e.g. OOM under noeviction): count and go on, breaker shut.
            self._breaker.count()
            logger.warning("Redis %s failed: %r", what, e)
        return default

    def _query(self, what: str, op: Callable[[redis.Redis], _T]) -> _T:
        """``op(redis)`` for queries with no local answer: ``RedisUnavailable`` on failure."""
        if self._breaker.is_open:
            raise RedisUnavailable(f"Redis at {self.settings.redacted_url} is unreachable; retrying")
        try:
            return op(self._redis)
        except redis.RedisError as e:
            if isinstance(e, (redis.ConnectionError, redis.TimeoutError)):
                self._breaker.failed(what, e)
            else:
                self._breaker.count()
            raise RedisUnavailable(f"Redis {what} failed: {e}") from e

    def _ping(self) -> None:
        self._load_scripts(self._redis)

    def _load_scripts(self, r: redis.Redis) -> None:
        # Loaded up front (and again after Redis comes back empty), so that hot
        # paths can EVALSHA without a SCRIPT EXISTS round trip.
        for script in (self._touch, self._acquire, self._renew, self._release):
            r.script_load(script.script)

    def _drop_connections(self) -> None:
        # Pooled connections to a Redis that restarted are dead; start afresh.
        with contextlib.suppress(Exception):
            self._redis.connection_pool.disconnect()

    def _count(self, counter: str | None = None, *, bytes_read: int = 0,
               bytes_written: int = 0) -> None:
        with self._counts_lock:
            if counter:
                self._counts[counter] += 1
            self._counts["bytes_read"] += bytes_read
            self._counts["bytes_written"] += bytes_written

    def _meta_record(self, key: str, size: int, meta: dict[str, Any], raw_size: int) -> dict[str, str]:
        return {"executable_id": key, "program_id": str(meta.get("program_id", "")),
                "size": str(size), "raw_size": str(raw_size),
                "compile_seconds": repr(float(meta.get("compile_seconds", 0.0))),
                "created": repr(float(meta.get("created", time.time()))), "hits": "0",
                "jax_version": jax.__version__,
                "jaxlib_version": str(meta.get("jaxlib_version", "")),
                "platform": str(meta.get("platform", "")),
                "device_kind": str(meta.get("device_kind", ""))}

    def _read_records(self, meta_keys: list[bytes]) -> list[dict[str, Any]]:
        """The records behind ``meta_keys``; records whose entry is gone are dropped."""
        if not meta_keys:
            return []
        meta_prefix = self._k("meta", "").encode()

        def op(r: redis.Redis) -> list[Any]:
            pipe = r.pipeline(transaction=False)
            for mk in meta_keys:
                pipe.hgetall(mk)
                pipe.exists(self._k("exe", mk[len(meta_prefix):].decode()))
            return pipe.execute()

        answers = self._query("list", op)
        records, orphans = [], []
        for mk, raw, exists in zip(meta_keys, answers[::2], answers[1::2]):
            if raw and exists:
                records.append(_parse_meta(raw))
            elif raw:
                orphans.append(mk)  # its entry was evicted or expired alone
        if orphans:
            self._run("list", lambda r: r.delete(*orphans), None)
        return records

    def _acquire_or_wait(self, key: str) -> _Lease | None:
        """A lease to compile ``key`` (maybe unlocked), or ``None`` when its entry appeared."""
        token = secrets.token_hex(16)
        deadline = time.monotonic() + self.settings.wait_s
        pubsub: Any = None
        try:
            while True:
                answer = self._run("lock", lambda r: self._acquire(
                    keys=[self._k("lock", key), self._k("exe", key)],
                    args=[token, self._lock_ttl_ms]), None)
                if answer is None:
                    return _Lease(self, key, None)  # Redis is down: compile alone
                if answer == b"entry":
                    return None
                if answer == b"locked":
                    return _Lease(self, key, token)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning("waited %.1f s for another process to compile %s; compiling "
                                   "here", self.settings.wait_s, key)
                    return _Lease(self, key, None)
                if pubsub is None:
                    # Subscribe first, then look again: a "stored" published between
                    # our look and our subscription would otherwise be missed.
                    pubsub = self._subscribe(key)
                    if pubsub is None:
                        return _Lease(self, key, None)
                    continue
                # Wake on "stored"/"released", or when the holder's lock would expire.
                self._wait_message(pubsub, min(remaining, int(answer) / 1000 + 0.05))
        finally:
            if pubsub is not None:
                with contextlib.suppress(Exception):
                    pubsub.close()

    def _subscribe(self, key: str) -> Any:
        def op(r: redis.Redis) -> Any:
            pubsub = r.pubsub(ignore_subscribe_messages=False)
            pubsub.subscribe(self._k("flight", key))
            # Wait for the confirmation, so that our next look happens after it.
            deadline = time.monotonic() + self.settings.socket_timeout_s
            while time.monotonic() < deadline:
                message = pubsub.get_message(timeout=deadline - time.monotonic())
                if message and message["type"] == "subscribe":
                    return pubsub
            pubsub.close()
            raise redis.TimeoutError("no confirmation of SUBSCRIBE")

        return self._run("subscribe", op, None)

    def _wait_message(self, pubsub: Any, timeout: float) -> None:
        self._run("wait", lambda r: pubsub.get_message(timeout=max(timeout, 0.01)), None)


class _Lease:
    """A compile lease: with a token it is a held Redis lock, renewed until released."""

    def __init__(self, tier: RedisTier, key: str, token: str | None) -> None:
        self._tier, self._key, self._token = tier, key, token
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if token is not None:
            self._thread = threading.Thread(target=self._renew_loop, daemon=True,
                                            name=f"jitserve-lock-{key[:12]}")
            self._thread.start()

    def release(self) -> None:
        """Stop renewing and delete the lock if it is still ours; wakes the waiters."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        tier = self._tier
        tier._run("unlock", lambda r: tier._release(
            keys=[tier._k("lock", self._key)], args=[self._token, tier._k("flight", self._key)]),
            None)

    def _renew_loop(self) -> None:
        tier = self._tier
        while not self._stop.wait(tier._lock_ttl_ms / 3000):
            held = tier._run("renew", lambda r: tier._renew(
                keys=[tier._k("lock", self._key)], args=[self._token, tier._lock_ttl_ms]), None)
            if held == 0:
                logger.warning("lost the compile lock of %s (expired); compiling on anyway",
                               self._key)
                return


def _connect(settings: RedisSettings) -> redis.Redis:
    """A client with small timeouts and one quick retry (a pooled connection may be stale)."""
    return redis.Redis.from_url(
        settings.url, socket_connect_timeout=settings.connect_timeout_s,
        socket_timeout=settings.socket_timeout_s, retry=Retry(NoBackoff(), 1),
        client_name="jitserve")


def _parse_cursor(cursor: str | None) -> int:
    if cursor is None or cursor == "":
        return 0
    if not cursor.isdigit():
        raise ValueError(f"cursor {cursor!r:.40} is not one this listing returned")
    return int(cursor)


def _parse_meta(raw: dict[bytes, bytes]) -> dict[str, Any]:
    record: dict[str, Any] = {k.decode(): v.decode() for k, v in raw.items()}
    for name in _META_INTS:
        record[name] = int(record.get(name, 0) or 0)
    for name in _META_FLOATS:
        value = record.get(name)
        record[name] = float(value) if value else None
    return record
