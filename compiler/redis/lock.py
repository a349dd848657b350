"""The cross-process compile lock: one compile of an executable among all processes.

A process that finds no entry takes ``lock:<key>`` with ``SET NX PX`` and a random
token, renews it from a background thread while it compiles, and releases it with
a Lua compare-and-delete (only its own token). Others subscribe to
``flight:<key>`` and sleep until ``stored`` or ``released`` arrives, or until the
holder's lock would expire: no polling loop.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import redis

from jitserve.compiler.cache import EXECUTABLES, BlobKind
from jitserve.compiler.redis.connection import RedisConnection

__all__ = ["CompileLock"]

logger = logging.getLogger("jitserve.compiler.redis")

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


class CompileLock:
    """Elects one compiler per key among all processes sharing a Redis.

    Args:
      connection: the deployment's ``RedisConnection``.
      kind: the blobs whose presence ends a wait (``EXECUTABLES``): their writer
        publishes ``stored`` on ``flight:<key>``.
    """

    def __init__(self, connection: RedisConnection, kind: BlobKind = EXECUTABLES) -> None:
        self.connection = connection
        self.kind = kind
        self.ttl_ms = max(1, int(connection.settings.lock_ttl_s * 1000))
        self._acquire = connection.script(_ACQUIRE)
        self._renew = connection.script(_RENEW)
        self._release = connection.script(_RELEASE)

    def channel(self, key: str) -> str:
        """The pub/sub channel that wakes the waiters for ``key``."""
        return self.connection.key("flight", key)

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[bool]:
        """Yields ``True`` when the caller should compile ``key``, ``False`` when its entry appeared.

        ``True``: the caller holds the lock (renewed in the background, released
        on exit), or Redis is down, or it waited ``wait_s`` in vain. ``False``:
        another process stored the entry meanwhile; re-read the tiers. Never
        raises a Redis error.
        """
        lease = self._acquire_or_wait(key)
        if lease is None:
            yield False
            return
        try:
            yield True
        finally:
            lease.release()

    def renew(self, key: str, token: str) -> int | None:
        """Push the lock's expiry out if ``token`` still holds it: 1, else 0 (``None``: Redis down)."""
        renewed: int | None = self.connection.run("renew", lambda r: self._renew(
            keys=[self._lock_key(key)], args=[token, self.ttl_ms]), None)
        return renewed

    def release(self, key: str, token: str) -> None:
        """Delete the lock if ``token`` still holds it, and wake the waiters."""
        self.connection.run("unlock", lambda r: self._release(
            keys=[self._lock_key(key)], args=[token, self.channel(key)]), None)

    def _lock_key(self, key: str) -> str:
        return self.connection.key("lock", key)

    def _try(self, key: str, token: str) -> Any:
        """``b"entry"``, ``b"locked"``, the holder's milliseconds left, or ``None`` (Redis down)."""
        return self.connection.run("lock", lambda r: self._acquire(
            keys=[self._lock_key(key), self.connection.key(self.kind.key, key)],
            args=[token, self.ttl_ms]), None)

    def _acquire_or_wait(self, key: str) -> _Lease | None:
        """A lease to compile ``key`` (maybe unlocked), or ``None`` when its entry appeared."""
        token = secrets.token_hex(16)
        deadline = time.monotonic() + self.connection.settings.wait_s
        pubsub: Any = None
        try:
            while True:
                answer = self._try(key, token)
                if answer is None:
                    return _Lease(self, key, None)  # Redis is down: compile alone
                if answer == b"entry":
                    return None
                if answer == b"locked":
                    return _Lease(self, key, token)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    logger.warning("waited %.1f s for another process to compile %s; compiling "
                                   "here", self.connection.settings.wait_s, key)
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
            pubsub.subscribe(self.channel(key))
            # Wait for the confirmation, so that our next look happens after it.
            deadline = time.monotonic() + self.connection.settings.socket_timeout_s
            while time.monotonic() < deadline:
                message = pubsub.get_message(timeout=deadline - time.monotonic())
                if message and message["type"] == "subscribe":
                    return pubsub
            pubsub.close()
            raise redis.TimeoutError("no confirmation of SUBSCRIBE")

        return self.connection.run("subscribe", op, None)

    def _wait_message(self, pubsub: Any, timeout: float) -> None:
        self.connection.run("wait", lambda r: pubsub.get_message(timeout=max(timeout, 0.01)), None)


class _Lease:
    """A compile lease: with a token it is a held Redis lock, renewed until released."""

    def __init__(self, lock: CompileLock, key: str, token: str | None) -> None:
        self._lock, self._key, self._token = lock, key, token
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if token is not None:
            self._thread = threading.Thread(target=self._renew_loop, daemon=True,
                                            name=f"jitserve-lock-{key[:12]}")
            self._thread.start()

    def release(self) -> None:
        """Stop renewing and delete the lock if it is still ours; wakes the waiters."""
        if self._thread is None or self._token is None:
            return
        self._stop.set()
        self._thread.join()
        self._lock.release(self._key, self._token)

    def _renew_loop(self) -> None:
        assert self._token is not None
        while not self._stop.wait(self._lock.ttl_ms / 3000):
            if self._lock.renew(self._key, self._token) == 0:
                logger.warning("lost the compile lock of %s (expired); compiling on anyway",
                               self._key)
                return
