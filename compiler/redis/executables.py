"""The executable tier in Redis: entries, their metadata records, and the compile lock.

Executables are code. Entries are signed (``compiler.cache.encode_entry``: an
HMAC with the deployment's ``CacheSecret`` over the key and the body), so a
writer to Redis without the secret can neither forge an entry nor move one
under another key; ``compiler.cache.decode_entry`` refuses such an entry, and
one whose jaxlib version, platform or device kind does not match. The
metadata records are not signed: they describe, they are never loaded. Keep
the Redis private all the same (docs/redis.md, "Trust boundary").

Records (under ``RedisSettings.key_prefix``)::

    exe:<executable_id>     the entry bytes (``encode_entry``: signed, zstd)
    meta:<executable_id>    a hash beside it: sizes, compile seconds, hits, versions, the
                            key's parts, why it compiled, XLA's cost and memory analyses
    keys:<program_id>       a hash of the program's executables: id -> its key's parts
                            (JSON, with when), what a new key of the program is compared with
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any, cast

import redis

from jitserve.compiler.cache import EXECUTABLES, CacheSecret, CorruptEntry, Entry, decode_entry
from jitserve.compiler.redis.blobs import RedisTier
from jitserve.compiler.redis.connection import RedisConnection
from jitserve.compiler.redis.lock import CompileLock

__all__ = ["ExecutableTier", "meta_record", "parse_meta"]

logger = logging.getLogger("jitserve.compiler.redis")

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

_META_FLOATS = ("compile_seconds", "created", "last_hit")
_META_INTS = ("size", "raw_size", "hits")
# Structured fields, kept as JSON strings in the hash.
_META_JSON = ("key_parts", "recompiled_because", "cost", "memory", "sharding")


class ExecutableTier(RedisTier):
    """Serialized executables in Redis, each with a metadata record, and the compile lock.

    Implements ``compiler.cache.SharedTier``: ``get``/``put``/``delete`` (hits
    count in the record) and ``compile_lock``. Never raises a Redis error.

    Args:
      connection: the deployment's ``RedisConnection``.
      secret: the deployment's ``CacheSecret``: ``put`` stores only entries
        signed with it for their key.
    """

    def __init__(self, connection: RedisConnection, secret: CacheSecret) -> None:
        super().__init__(connection, EXECUTABLES)
        self.secret = secret
        self.lock = CompileLock(connection, EXECUTABLES)
        self._touch = connection.script(_TOUCH)

    def meta_key(self, key: str) -> str:
        """The Redis key of the metadata record of ``key``."""
        return self.connection.key("meta", key)

    def records(self, key: str) -> list[str]:
        return [self.key(key), self.meta_key(key)]

    def history_key(self, program_id: str) -> str:
        """The Redis key of the hash of ``program_id``'s keys' parts."""
        return self.connection.key("keys", program_id)

    def history(self, program_id: str) -> dict[str, tuple[float, dict[str, str]]]:
        """``program_id``'s stored keys: ``{executable_id: (created, parts)}``; empty when
        Redis is down (a compile's reasons then come from this process alone)."""
        # bytes: the client never decodes responses (no decode_responses)
        raw = self.connection.run("history", lambda r: cast(
            "dict[bytes, bytes]", r.hgetall(self.history_key(program_id))), None) or {}
        out = {}
        for key, value in raw.items():
            try:
                doc = json.loads(value)
                out[key.decode()] = (float(doc["at"]), {str(k): str(v)
                                                        for k, v in doc["parts"].items()})
            except (ValueError, KeyError, TypeError, AttributeError):
                continue  # not one of ours: it explains nothing
        return out

    def delete(self, key: str) -> None:
        """Drop the entry, its record and its place in its program's history."""
        def op(r: redis.Redis) -> None:
            program_id = cast("bytes | None", r.hget(self.meta_key(key), "program_id"))
            pipe = r.pipeline(transaction=True)
            pipe.delete(*self.records(key))
            if program_id:
                pipe.hdel(self.history_key(program_id.decode()), key)
            pipe.execute()

        self.connection.run("delete executables", op, None)

    def put(self, key: str, data: bytes) -> None:
        """Store an entry (``encode_entry`` bytes) with its metadata record; wake the waiters."""
        try:
            entry = decode_entry(key, data, self.secret, {"key": key})
        except CorruptEntry as e:
            logger.warning("not storing a bad entry for %s in Redis: %s", key, e)
            return
        meta = meta_record(key, len(data), entry)
        self._store(key, data, lambda pipe: self._add_meta(pipe, key, meta))

    def compile_lock(self, key: str) -> contextlib.AbstractContextManager[bool]:
        """``CompileLock.hold``: whether to compile ``key`` here (see ``SharedTier``)."""
        return self.lock.hold(key)

    def _add_meta(self, pipe: Any, key: str, meta: dict[str, str]) -> None:
        ttl_ms = self.connection.settings.ttl_ms
        pipe.delete(self.meta_key(key))
        pipe.hset(self.meta_key(key), mapping=meta)
        if ttl_ms:
            pipe.pexpire(self.meta_key(key), ttl_ms)
        if meta.get("program_id") and meta.get("key_parts") not in (None, "null"):
            history = self.history_key(meta["program_id"])
            pipe.hset(history, key, json.dumps({"at": float(meta["created"]),
                                                "parts": json.loads(meta["key_parts"])}))
            if ttl_ms:
                pipe.pexpire(history, ttl_ms)
        pipe.publish(self.lock.channel(key), "stored")

    def _read(self, r: redis.Redis, key: str) -> bytes | None:
        """The entry, and a touch of its record (hits, last hit, expiries): one round trip."""
        touch_keys = self.records(key)
        touch_args: list[str | int] = [repr(time.time()), self.connection.settings.ttl_ms]
        # EVALSHA directly, since a pipeline running a Script object first asks
        # SCRIPT EXISTS every time.
        pipe = r.pipeline(transaction=False)
        pipe.get(touch_keys[0])
        pipe.evalsha(self._touch.sha, 2, *touch_keys, *touch_args)
        data, touched = pipe.execute(raise_on_error=False)
        if isinstance(data, Exception):
            raise data
        if isinstance(touched, redis.exceptions.NoScriptError):  # Redis restarted
            self._touch(keys=touch_keys, args=touch_args)
        return cast("bytes | None", data)


def meta_record(key: str, size: int, entry: Entry) -> dict[str, str]:
    """The metadata record stored beside entry ``key`` of ``size`` bytes (see ``parse_meta``).

    Written where executables are compiled, which has jax loaded; the catalog that reads
    these records runs in the API process too, which never imports it."""
    import jax

    meta = entry.meta
    return {"executable_id": key, "program_id": str(meta.get("program_id", "")),
            "size": str(size), "raw_size": str(len(entry.executable)),
            "compile_seconds": repr(float(meta.get("compile_seconds", 0.0))),
            "created": repr(float(meta.get("created", time.time()))), "hits": "0",
            "jax_version": jax.__version__,
            "jaxlib_version": str(meta.get("jaxlib_version", "")),
            "platform": str(meta.get("platform", "")),
            "device_kind": str(meta.get("device_kind", "")),
            **{name: json.dumps(meta.get(name)) for name in _META_JSON}}


def parse_meta(raw: dict[bytes, bytes]) -> dict[str, Any]:
    """A metadata record as read back: numbers as numbers, a missing time as ``None``."""
    record: dict[str, Any] = {k.decode(): v.decode() for k, v in raw.items()}
    for name in _META_INTS:
        record[name] = int(record.get(name, 0) or 0)
    for name in _META_FLOATS:
        value = record.get(name)
        record[name] = float(value) if value else None
    for name in _META_JSON:
        try:
            record[name] = json.loads(record.get(name) or "null")
        except ValueError:
            record[name] = None
    return record
