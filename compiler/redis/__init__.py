"""The Redis L2 tier: compiled executables and uploaded programs shared by every process.

Every jitserve process that points at the same Redis shares what any of them
compiled: an executable compiled on one host is a cache hit on every other host
with the same device kind and versions (both are in the cache key, and
``compiler.cache.decode_entry`` refuses an entry whose jaxlib version, platform
or device kind does not match). Entries are signed with the deployment's cache
secret and bound to their key, so a writer to Redis without the secret cannot
make a server run what it wrote; still, point it only at a Redis that is
private to the deployment: a writer can delete or flood the cache
(docs/redis.md, "Trust boundary").

One module per concern, the way arq keeps connections, constants and jobs apart::

    settings     RedisSettings (URL, prefix, TTLs, timeouts) and LAYOUT_VERSION;
                 imports neither redis nor jax
    connection   RedisConnection: the client, key names, circuit breaker, counters;
                 RedisUnavailable
    blobs        RedisTier: one kind of blob (programs) as ``<kind>:<key>`` strings
    executables  ExecutableTier: entries with their metadata records and the lock
    lock         CompileLock: one compile per key across processes (SET NX PX, pub/sub)
    catalog      RedisCatalog: list and describe the stored executables
    tiers        RedisTiers: all of the above over one connection

Key layout under ``jitserve:v<LAYOUT_VERSION>:<deployment prefix>:``::

    exe:<executable_id>     the entry bytes (``encode_entry``: signed, zstd)
    meta:<executable_id>    a hash beside it: sizes, compile seconds, hits, versions
    keys:<program_id>       a hash: the key parts of the program's executables (history)
    prog:<program_id>       the program blob (``compiler.program_store``: format, bytes)
    lock:<executable_id>    the compile lock: a random token, with an expiry
    flight:<executable_id>  a pub/sub channel: "stored" / "released" wake waiters

A Redis failure never fails a request: reads miss and writes are skipped while a
circuit breaker keeps every tier off Redis; a background probe retries with
exponential backoff and resumes on the first answer. The ``Compiler`` builds the
tiers from its config::

    compiler = Compiler(CompilerConfig(
        redis=RedisSettings.from_url("redis://:pw@cache:6379/0", prefix="prod"),
        cache_secret=CacheSecret.from_value(os.environ["JITSERVE_CACHE_SECRET"])))

The names below load on first use: ``RedisSettings`` is read at every start, and
a deployment without Redis never imports the ``redis`` package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jitserve.compiler.redis.blobs import RedisTier
    from jitserve.compiler.redis.catalog import RedisCatalog
    from jitserve.compiler.redis.connection import RedisConnection, RedisUnavailable
    from jitserve.compiler.redis.executables import ExecutableTier
    from jitserve.compiler.redis.lock import CompileLock
    from jitserve.compiler.redis.settings import LAYOUT_VERSION, RedisSettings
    from jitserve.compiler.redis.tiers import RedisTiers

__all__ = [
    "CompileLock",
    "ExecutableTier",
    "LAYOUT_VERSION",
    "RedisCatalog",
    "RedisConnection",
    "RedisSettings",
    "RedisTier",
    "RedisTiers",
    "RedisUnavailable",
]

# Which module of this package defines each public name.
_HOMES = {
    "CompileLock": "lock",
    "ExecutableTier": "executables",
    "LAYOUT_VERSION": "settings",
    "RedisCatalog": "catalog",
    "RedisConnection": "connection",
    "RedisSettings": "settings",
    "RedisTier": "blobs",
    "RedisTiers": "tiers",
    "RedisUnavailable": "connection",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # the next access skips this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
