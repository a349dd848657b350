"""What the shared executable tier holds: its metadata records, one or a page at a time.

For operators (``GET /v1/executables``). Unlike the tiers, these queries have no
local answer, so a Redis failure raises ``RedisUnavailable`` instead of missing.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import redis

from jitserve.compiler.catalog import EntryPage, parse_cursor
from jitserve.compiler.redis.executables import ExecutableTier, parse_meta

__all__ = ["RedisCatalog"]


class RedisCatalog:
    """Lists and describes the executables stored in Redis by any process.

    Args:
      executables: the executable tier, whose records it reads (and whose
        connection it queries).
    """

    def __init__(self, executables: ExecutableTier) -> None:
        self.executables = executables
        self.connection = executables.connection

    def metadata(self, key: str) -> dict[str, Any] | None:
        """The metadata record of ``key``, or ``None`` when it is not cached.

        Fields: ``executable_id``, ``program_id``, ``size`` (stored bytes,
        compressed), ``raw_size`` (executable bytes), ``compile_seconds``,
        ``created``, ``last_hit`` (Unix seconds or ``None``), ``hits``,
        ``jax_version``, ``jaxlib_version``, ``platform``, ``device_kind``,
        ``key_parts``, ``recompiled_because``, ``cost``, ``memory`` (``None`` in
        records stored before they were kept).
        Raises ``RedisUnavailable`` when Redis cannot answer.
        """
        def op(r: redis.Redis) -> list[Any]:
            pipe = r.pipeline(transaction=False)
            pipe.hgetall(self.executables.meta_key(key))
            pipe.exists(self.executables.key(key))
            return pipe.execute()

        raw, exists = self.connection.query("metadata", op)
        return parse_meta(raw) if raw and exists else None

    def list_entries(self, cursor: str | None = None, limit: int = 100) -> EntryPage:
        """A page of metadata records, by ``SCAN`` over this prefix's records.

        A page holds about ``limit`` records (``SCAN``'s count is a hint); follow
        ``next_cursor`` until it is ``None``. As with ``SCAN``, a record present
        the whole time is listed at least once. Raises ``ValueError`` for a cursor
        this listing did not return, ``RedisUnavailable`` when Redis cannot answer.
        """
        scan_cursor = parse_cursor(cursor)
        match = self.executables.meta_key("*")
        keys: list[bytes] = []
        while True:
            scan_cursor, batch = self.connection.query(
                "list", functools.partial(_scan, scan_cursor, match, max(limit, 10)))
            keys.extend(batch)
            if scan_cursor == 0 or len(keys) >= limit:
                break
        return EntryPage(self._read_records(keys), str(scan_cursor) if scan_cursor else None)

    def _read_records(self, meta_keys: list[bytes]) -> list[dict[str, Any]]:
        """The records behind ``meta_keys``; records whose entry is gone are dropped."""
        if not meta_keys:
            return []
        meta_prefix = self.executables.meta_key("").encode()

        def op(r: redis.Redis) -> list[Any]:
            pipe = r.pipeline(transaction=False)
            for mk in meta_keys:
                pipe.hgetall(mk)
                pipe.exists(self.executables.key(mk[len(meta_prefix):].decode()))
            return pipe.execute()

        answers = self.connection.query("list", op)
        records, orphans = [], []
        for mk, raw, exists in zip(meta_keys, answers[::2], answers[1::2]):
            if raw and exists:
                records.append(parse_meta(raw))
            elif raw:
                orphans.append(mk)  # its entry was evicted or expired alone
        if orphans:
            self.connection.run("list", lambda r: r.delete(*orphans), None)
        return records


def _scan(cursor: int, match: str, count: int, r: redis.Redis) -> tuple[int, list[bytes]]:
    """One ``SCAN`` step: the next cursor and a batch of keys (bytes: the client never
    decodes responses)."""
    return cast("tuple[int, list[bytes]]", r.scan(cursor, match=match, count=count))
