"""One connection to the deployment's Redis, shared by every tier that uses it.

``RedisConnection`` owns the client, the key names, the counters and a circuit
breaker. Tiers hand it their commands as ``op(client)`` callables: ``run`` turns
a Redis failure into a default answer (a miss, a skipped write), ``query`` into
``RedisUnavailable`` for questions that have no local answer (listings). After a
connection failure the breaker keeps everyone off Redis, at no cost per call,
while a background probe retries with exponential backoff.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.commands.core import Script
from redis.retry import Retry

from jitserve.compiler.cache import CacheUnavailable
from jitserve.compiler.redis.settings import RedisSettings

__all__ = ["RedisConnection", "RedisUnavailable"]

logger = logging.getLogger("jitserve.compiler.redis")

_T = TypeVar("_T")


class RedisUnavailable(CacheUnavailable):
    """Redis could not answer a query that has no local fallback (listing, metadata)."""


class RedisConnection:
    """A ``redis.Redis`` client with key names, counters and a circuit breaker.

    Args:
      settings: see ``RedisSettings``.
      client: a ``redis.Redis`` to use instead of one built from the URL (tests).

    Example::

        connection = RedisConnection(RedisSettings.from_url("redis://cache:6379/0"))
        data = connection.run("get", lambda r: r.get(connection.key("exe", key)), None)
    """

    def __init__(self, settings: RedisSettings, *, client: redis.Redis | None = None) -> None:
        settings.check()
        self.settings = settings
        self.client = client if client is not None else _connect(settings)
        self._scripts: list[Script] = []
        self._breaker = _Breaker(self._probe, self._drop_connections, settings.max_backoff_s,
                                 settings.redacted_url)
        self._counts_lock = threading.Lock()
        self._counts = {"hits": 0, "misses": 0, "bytes_read": 0, "bytes_written": 0}
        self.run("connect", lambda r: r.ping(), None)  # a dead Redis at start: degraded now

    def key(self, kind: str, name: str) -> str:
        """The key of record ``name`` of ``kind`` (``exe``, ``meta``, ``prog``, ``lock``, ...)."""
        return f"{self.settings.key_prefix}{kind}:{name}"

    def script(self, source: str) -> Script:
        """A Lua script, loaded now and again whenever Redis comes back (perhaps empty).

        Loaded up front so that hot paths can ``EVALSHA`` without a ``SCRIPT EXISTS``
        round trip.
        """
        script = self.client.register_script(source)
        self._scripts.append(script)
        self.run("script load", lambda r: r.script_load(source), None)
        return script

    def run(self, what: str, op: Callable[[redis.Redis], _T], default: _T) -> _T:
        """``op(client)``, or ``default`` when Redis is down or fails (counted, logged)."""
        if self._breaker.is_open:
            return default
        try:
            return op(self.client)
        except (redis.ConnectionError, redis.TimeoutError) as e:
            self._breaker.failed(what, e)
        except redis.RedisError as e:
            # Redis answered (e.g. OOM under noeviction): count and go on, breaker shut.
            self._breaker.count()
            logger.warning("Redis %s failed: %r", what, e)
        return default

    def query(self, what: str, op: Callable[[redis.Redis], _T]) -> _T:
        """``op(client)`` for questions with no local answer: ``RedisUnavailable`` on failure."""
        if self._breaker.is_open:
            raise RedisUnavailable(f"Redis at {self.settings.redacted_url} is unreachable; retrying")
        try:
            return op(self.client)
        except redis.RedisError as e:
            if isinstance(e, (redis.ConnectionError, redis.TimeoutError)):
                self._breaker.failed(what, e)
            else:
                self._breaker.count()
            raise RedisUnavailable(f"Redis {what} failed: {e}") from e

    def count(self, counter: str | None = None, *, bytes_read: int = 0,
              bytes_written: int = 0) -> None:
        """Add to the counters ``stats`` reports: a ``hits`` or ``misses``, and bytes moved."""
        with self._counts_lock:
            if counter:
                self._counts[counter] += 1
            self._counts["bytes_read"] += bytes_read
            self._counts["bytes_written"] += bytes_written

    @property
    def available(self) -> bool:
        """Whether Redis is in use now (``False``: degraded, probing)."""
        return not self._breaker.is_open

    def stats(self) -> dict[str, Any]:
        """Counters for metrics: ``state``, ``errors``, ``hits``, ``misses``, ``bytes_read``,
        ``bytes_written`` (all since start, monotonic; hits and misses of every blob kind)."""
        with self._counts_lock:
            counts = dict(self._counts)
        return {"state": "ok" if self.available else "degraded",
                "errors": self._breaker.errors, **counts}

    def close(self) -> None:
        """Stop the probe thread and close connections."""
        self._breaker.close()
        with contextlib.suppress(redis.RedisError):
            self.client.close()

    def _probe(self) -> None:
        self.client.ping()
        for script in self._scripts:
            self.client.script_load(script.script)

    def _drop_connections(self) -> None:
        # Pooled connections to a Redis that restarted are dead; start afresh.
        with contextlib.suppress(Exception):
            self.client.connection_pool.disconnect()


class _Breaker:
    """Keeps everyone off Redis after a connection failure, until a probe gets an answer.

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


def _connect(settings: RedisSettings) -> redis.Redis:
    """A client with small timeouts and one quick retry (a pooled connection may be stale)."""
    return redis.Redis.from_url(
        settings.url, socket_connect_timeout=settings.connect_timeout_s,
        socket_timeout=settings.socket_timeout_s, retry=Retry(NoBackoff(), 1),
        client_name="jitserve")
