"""What the executable caches hold, for operators: one record, a page, the cache's state.

With Redis configured the records are the shared ones, kept beside each entry in
Redis (every process's compiles, hit counts across all of them); without it,
they are the executables loaded in this process. Redis configured but down
raises ``CacheUnavailable`` (a ``compiler.cache`` error): a local listing would
silently answer another question.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal, Protocol

from jitserve.wire import TierName

if TYPE_CHECKING:
    from jitserve.compiler.cache import CacheSecret
    from jitserve.compiler.records import MemoryStats
    from jitserve.compiler.redis.settings import RedisSettings
    from jitserve.compiler.redis.tiers import RedisTiers

__all__ = ["CacheState", "Catalog", "EntryPage", "LoadedExecutable", "parse_cursor"]

CacheState = Literal["local", "ok", "degraded"]


@dataclasses.dataclass(frozen=True)
class EntryPage:
    """One page of a listing of cached executables.

    Attributes:
      entries: records (see ``Catalog.describe``); ``source`` says whose they are.
      next_cursor: pass it back for the next page; ``None`` after the last one.
    """

    entries: list[dict[str, Any]]
    next_cursor: str | None


class LoadedExecutable(Protocol):
    """What a local listing reads of a loaded executable.

    The compiler's ``Executable`` is one; so is the service's record of an
    executable that one of its runtime processes holds (the catalog never needs
    the loaded program itself, only its record).
    """

    @property
    def executable_id(self) -> str: ...

    @property
    def meta(self) -> Mapping[str, Any]: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def memory(self) -> MemoryStats | None: ...


def parse_cursor(cursor: str | None) -> int:
    """The position a listing's ``next_cursor`` stands for; ``ValueError`` for any other string."""
    if cursor is None or cursor == "":
        return 0
    # "³".isdigit() is true; Redis's SCAN cursor is an unsigned 64-bit integer, and
    # it answers a bigger one with an error that is no fault of the shared cache.
    if not (cursor.isascii() and cursor.isdigit()) or int(cursor) >= 1 << 64:
        raise ValueError(f"cursor {cursor!r:.40} is not one this listing returned")
    return int(cursor)


class Catalog:
    """The compiler's catalog of cached executables: ``Compiler.catalog``.

    Args:
      loaded: the executables loaded in this process (``Compiler.loaded``), or
        their records (``LoadedExecutable``).
      shared: the Redis tiers, when the compiler has them.

    Example::

        page = compiler.catalog.page(limit=100)     # follow page.next_cursor
        record = compiler.catalog.describe(executable_id)
    """

    def __init__(self, loaded: Callable[[], Iterable[LoadedExecutable]],
                 shared: RedisTiers | None = None) -> None:
        self._loaded, self._shared = loaded, shared

    @classmethod
    def open(cls, loaded: Callable[[], Iterable[LoadedExecutable]], redis: RedisSettings | None,
             secret: CacheSecret | None) -> Catalog:
        """A catalog of ``loaded`` and, when ``redis`` and ``secret`` are given, of the shared
        Redis tiers it connects to (``close`` it). Blocks while it connects: call it from a
        thread. The Redis code loads only here, so a process without Redis never imports it.
        """
        if redis is None or secret is None:
            return cls(loaded)
        from jitserve.compiler.redis.tiers import RedisTiers

        return cls(loaded, RedisTiers(redis, secret))

    def close(self) -> None:
        """Close the connection to the shared tiers, if any."""
        if self._shared is not None:
            self._shared.close()

    @property
    def state(self) -> CacheState:
        """``ok`` (the shared Redis is in use), ``degraded`` (configured, unreachable:
        serving from local tiers, retrying) or ``local`` (no Redis)."""
        if self._shared is None:
            return "local"
        return "ok" if self._shared.connection.available else "degraded"

    @property
    def shared_url(self) -> str | None:
        """The shared cache's URL with its password masked; ``None`` without one."""
        return None if self._shared is None else self._shared.connection.settings.redacted_url

    def shared_stats(self) -> dict[str, Any] | None:
        """The shared cache's counters (``RedisConnection.stats``); ``None`` without one."""
        return None if self._shared is None else self._shared.connection.stats()

    def page(self, cursor: str | None = None, limit: int = 100) -> EntryPage:
        """A page of records; follow ``next_cursor`` until it is ``None``.

        Raises ``ValueError`` for a cursor this listing did not return and
        ``CacheUnavailable`` when the shared cache cannot answer.
        """
        if self._shared is None:
            return self._local_page(cursor, limit)
        page = self._shared.catalog.list_entries(cursor, limit)
        return EntryPage([_shared_record(r) for r in page.entries], page.next_cursor)

    def describe(self, executable_id: str) -> dict[str, Any] | None:
        """One executable's record, or ``None`` when no tier has it.

        Fields: ``executable_id``, ``program_id``, ``raw_size`` (executable bytes),
        ``compile_seconds``, ``created``, ``jaxlib_version``, ``platform``,
        ``device_kind``, ``key_parts`` (the cache key's named parts),
        ``recompiled_because`` (the parts that differed from the program's nearest
        earlier key when it compiled; ``None`` for its first), ``cost`` (XLA's cost
        analysis: ``flops``, ``transcendentals``, ``bytes_accessed``), ``memory``
        (``MemoryStats``), ``sharding`` (a sharded executable's devices and HLO
        shardings, ``compile.sharding_doc``; ``None`` for one device), ``source``
        (``redis`` or ``memory``); shared records add ``size`` (stored bytes),
        ``hits``, ``last_hit`` and ``jax_version``.
        Raises ``CacheUnavailable`` when the shared cache cannot answer.
        """
        if self._shared is not None:
            record = self._shared.catalog.metadata(executable_id)
            if record is not None:
                return _shared_record(record)
        for executable in self._loaded():
            if executable.executable_id == executable_id:
                return _local_record(executable)
        return None

    def _local_page(self, cursor: str | None, limit: int) -> EntryPage:
        """This process's L1, by executable id; the cursor is an offset."""
        start = parse_cursor(cursor)
        loaded = sorted(self._loaded(), key=lambda e: e.executable_id)
        more = start + limit < len(loaded)
        return EntryPage([_local_record(e) for e in loaded[start:start + limit]],
                         str(start + limit) if more else None)


def _shared_record(record: dict[str, Any]) -> dict[str, Any]:
    return {**record, "source": TierName.REDIS.value}


def _local_record(executable: LoadedExecutable) -> dict[str, Any]:
    meta = executable.meta
    memory = executable.memory
    return {"executable_id": executable.executable_id, "program_id": meta.get("program_id"),
            "raw_size": executable.nbytes, "compile_seconds": meta.get("compile_seconds"),
            "created": meta.get("created"), "jaxlib_version": meta.get("jaxlib_version"),
            "platform": meta.get("platform"), "device_kind": meta.get("device_kind"),
            "jax_version": (meta.get("key_parts") or {}).get("jax"),
            "key_parts": meta.get("key_parts"), "recompiled_because": meta.get("recompiled_because"),
            "cost": meta.get("cost"), "memory": None if memory is None else memory.to_json(),
            "sharding": meta.get("sharding"), "source": TierName.MEMORY.value}

