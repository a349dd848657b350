"""A Redis L2 tier for one kind of blob: ``<prefix><kind>:<key>`` holds the bytes.

Programs use it as it is; executables extend it with a metadata record and the
compile lock (``compiler.redis.executables``). Like every tier it never raises a
Redis error: while Redis is unreachable, reads miss and writes are skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import redis

from jitserve.compiler.cache import BlobKind
from jitserve.compiler.redis.connection import RedisConnection
from jitserve.wire import TierName

__all__ = ["RedisTier"]


class RedisTier:
    """Blobs of ``kind`` in Redis: implements ``compiler.cache.Tier``.

    Every write and hit pushes the record's expiry out again when the settings
    give a ``ttl_s``.

    Args:
      connection: the deployment's ``RedisConnection`` (shared by every tier).
      kind: which blobs (``compiler.cache.PROGRAMS``, ...); its ``key`` names the records.
    """

    name = TierName.REDIS

    def __init__(self, connection: RedisConnection, kind: BlobKind) -> None:
        self.connection = connection
        self.kind = kind

    def key(self, key: str) -> str:
        """The Redis key of blob ``key``."""
        return self.connection.key(self.kind.key, key)

    def records(self, key: str) -> list[str]:
        """Every Redis key that belongs to blob ``key`` (what ``delete`` removes)."""
        return [self.key(key)]

    def get(self, key: str) -> bytes | None:
        """The bytes of ``key``, or ``None`` (a miss, or Redis is down)."""
        data = self.connection.run(f"get {self.kind.name}", lambda r: self._read(r, key), None)
        self.connection.count("hits" if data is not None else "misses",
                              bytes_read=len(data) if data is not None else 0)
        return data

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``."""
        self._store(key, data)

    def delete(self, key: str) -> None:
        """Drop the blob (a damaged one, or an operator's request)."""
        self.connection.run(f"delete {self.kind.name}", lambda r: r.delete(*self.records(key)),
                            None)

    def contains(self, key: str) -> bool:
        """Whether Redis holds ``key``; ``False`` too when Redis cannot say."""
        return bool(self.connection.run(f"exists {self.kind.name}",
                                        lambda r: r.exists(self.key(key)), 0))

    def _read(self, r: redis.Redis, key: str) -> bytes | None:
        ttl_ms = self.connection.settings.ttl_ms
        if not ttl_ms:
            # bytes: the client never decodes responses (no decode_responses)
            return cast("bytes | None", r.get(self.key(key)))
        pipe = r.pipeline(transaction=False)
        pipe.get(self.key(key))
        pipe.pexpire(self.key(key), ttl_ms)
        data: bytes | None = pipe.execute()[0]
        return data

    def _store(self, key: str, data: bytes, also: Callable[[Any], None] = lambda pipe: None) -> None:
        """``SET`` the blob, and whatever ``also`` adds, in one transaction."""
        def op(r: redis.Redis) -> bool:
            pipe = r.pipeline(transaction=True)  # readers see every record of a blob or none
            pipe.set(self.key(key), data, px=self.connection.settings.ttl_ms or None)
            also(pipe)
            pipe.execute()
            return True

        if self.connection.run(f"put {self.kind.name}", op, False):
            self.connection.count(bytes_written=len(data))
