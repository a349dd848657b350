"""Everything one deployment keeps in Redis, over one connection.

The ``Compiler`` builds this when its config names a Redis
(``CompilerConfig(redis=RedisSettings.from_url(...), cache_secret=...)``): executables (with the
compile lock and their catalog) and uploaded programs share one client, one
circuit breaker and one set of counters.
"""

from __future__ import annotations

import redis

from jitserve.compiler.cache import EXECUTABLES, PROGRAMS, BlobKind, CacheSecret, Tier
from jitserve.compiler.redis.blobs import RedisTier
from jitserve.compiler.redis.catalog import RedisCatalog
from jitserve.compiler.redis.connection import RedisConnection
from jitserve.compiler.redis.executables import ExecutableTier
from jitserve.compiler.redis.settings import RedisSettings

__all__ = ["RedisTiers"]


class RedisTiers:
    """The Redis tiers of each blob kind, and the catalog of executables.

    Args:
      settings: see ``RedisSettings``; an unreachable Redis does not raise (the
        tiers start degraded and a probe retries).
      secret: the ``CacheSecret`` every process on this Redis signs entries with.
      client: a ``redis.Redis`` to use instead of one built from the URL (tests).

    Example::

        shared = RedisTiers(RedisSettings.from_url("redis://:pw@cache:6379/0", prefix="prod"),
                            CacheSecret.from_value(os.environ["JITSERVE_CACHE_SECRET"]))
        shared.executables.get(key), shared.programs.get(program_id)
        shared.close()
    """

    def __init__(self, settings: RedisSettings, secret: CacheSecret, *,
                 client: redis.Redis | None = None) -> None:
        self.connection = RedisConnection(settings, client=client)
        self.executables = ExecutableTier(self.connection, secret)
        self.programs = RedisTier(self.connection, PROGRAMS)
        self.catalog = RedisCatalog(self.executables)

    def tier(self, kind: BlobKind) -> Tier:
        """The tier that keeps blobs of ``kind``."""
        tiers: dict[BlobKind, Tier] = {EXECUTABLES: self.executables, PROGRAMS: self.programs}
        return tiers[kind]

    def close(self) -> None:
        """Stop the probe thread and close the connection."""
        self.connection.close()
