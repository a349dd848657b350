"""What an API key did through one replica, known to all of them.

With API keys on, a program is seen only by the keys that uploaded it
(``calls.tenants``). Through a balancer a key's upload and its calls land on
different replicas, so each upload is noted in ``programs:<owner>``, and a
replica that has not seen the key upload a program asks there before it says
``404``. A program's batching (service/calls/batching.py) is kept in
``batching:<owner>`` for the same reason: a caller's calls batch alike on every
replica.

Redis down: a claim is not noted (the upload still succeeds here), a program is
owned only where it was uploaded, and setting a batching fails ``503``, since
the other replicas would not batch alike.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from ..errors import Unavailable
from .keys import Keys

__all__ = ["Ownership"]

_CLAIM_TTL_S = 30 * 86400  # an API key's programs are remembered this long after an upload


class Ownership:
    """Program claims and batching configurations shared between replicas.

    Args:
      redis: the shared Redis.
      keys: the deployment's key names.
    """

    def __init__(self, redis: aioredis.Redis, keys: Keys) -> None:
        self._redis = redis
        self._keys = keys

    async def claim(self, owner: str, program_id: str) -> None:
        """Note that ``owner`` uploaded ``program_id``, for the other replicas."""
        key = self._keys.programs(owner)
        with contextlib.suppress(RedisError, OSError):
            pipe = self._redis.pipeline(transaction=False)
            pipe.sadd(key, program_id)
            pipe.expire(key, _CLAIM_TTL_S)
            await pipe.execute()

    async def owns(self, owner: str, program_id: str) -> bool:
        """Whether ``owner`` uploaded ``program_id`` through any replica."""
        with contextlib.suppress(RedisError, OSError):
            return bool(await self._redis.sismember(self._keys.programs(owner), program_id))
        return False

    async def drop(self, owner: str, program_id: str) -> None:
        """``owner`` deleted ``program_id``: no replica finds it ``owner``'s from now on."""
        with contextlib.suppress(RedisError, OSError):
            await self._redis.srem(self._keys.programs(owner), program_id)

    async def set_batching(self, owner: str | None, program_id: str,
                           config: dict[str, Any] | None) -> None:
        """Keep ``owner``'s batching of ``program_id`` (``None``: off) for the other
        replicas (service/calls/batching.py); ``Unavailable`` when Redis cannot take it."""
        key = self._keys.batching(owner)
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
        raw = await self._redis.hget(self._keys.batching(owner), program_id)
        return None if raw is None else json.loads(raw)
