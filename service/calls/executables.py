"""What the API process knows about executables: the runtimes' answers to lookups.

Executables live in the runtimes (loaded, on the device) and in the cache
tiers; the API process keeps only their signatures (``RemoteExecutable``), by
call (program, input avals, static key), so that a cached call needs no lookup
round trip: it goes straight to a run. ``ExecutableIndex`` is that LRU; its
records are also the catalog's local listing (``compiler.Catalog``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from jitserve.compiler.cache import MemoryCache
from jitserve.compiler.records import MemoryStats, check_inputs
from jitserve.wire import Aval

__all__ = ["CallKey", "CallOptions", "ExecutableIndex", "RemoteExecutable", "Resolved", "call_key",
           "canonical", "host_aval"]

# One object per distinct aval among those calls name every time (executables' in
# and out avals, host arrays'): a call's avals then compare with an executable's
# by identity, so finding its executable and checking its inputs cost no Python
# ``__eq__`` per leaf (a model's 25 leaves were 108 such calls per step). A cache,
# not a registry: emptied when full, since clients choose the shapes.
_CANONICAL: dict[Aval, Aval] = {}
_HOST: dict[tuple[tuple[int, ...], Any], Aval] = {}
_CANONICAL_MAX = 4096


def canonical(aval: Aval) -> Aval:
    """The one object kept for avals equal to ``aval`` (``aval``, the first time)."""
    kept = _CANONICAL.get(aval)
    if kept is None:
        if len(_CANONICAL) >= _CANONICAL_MAX:
            _CANONICAL.clear()
        kept = _CANONICAL[aval] = aval
    return kept


def host_aval(array: np.ndarray) -> Aval:
    """``Aval.of(array)``, canonical, without making one per call."""
    key = (array.shape, array.dtype)
    aval = _HOST.get(key)
    if aval is None:
        if len(_HOST) >= _CANONICAL_MAX:
            _HOST.clear()
        aval = _HOST[key] = canonical(Aval.of(array))
    return aval


@dataclasses.dataclass(frozen=True)
class CallOptions:
    """What picks an executable besides the inputs' avals: the caller's static key,
    the inputs a run may consume (``donate``, sorted input indices), the tenant's
    scope (``Tenants.scope``: its own keys, unless keys share executables) and the
    caller's XLA options (``jax.jit``'s ``compiler_options``: sorted pairs, checked
    by ``compiler.options.check_compiler_options``)."""

    static_key: str = ""
    donate: tuple[int, ...] = ()
    scope: str = ""
    compiler_options: tuple[tuple[str, Any], ...] = ()


@dataclasses.dataclass(frozen=True, eq=False)
class RemoteExecutable:
    """An executable's static signature and record, as its runtime described it."""

    executable_id: str
    in_avals: tuple[Aval, ...]
    out_avals: tuple[Aval, ...]
    out_tree: Any
    memory: MemoryStats | None
    meta: dict[str, Any]
    nbytes: int

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> RemoteExecutable:
        return cls(doc["executable_id"],
                   tuple(canonical(Aval.from_json(a)) for a in doc["in_avals"]),
                   tuple(canonical(Aval.from_json(a)) for a in doc["out_avals"]), doc.get("out_tree"),
                   MemoryStats.from_json(doc.get("memory")), dict(doc.get("meta") or {}),
                   int(doc.get("nbytes") or 0))

    @functools.cached_property
    def in_avals_json(self) -> list[dict[str, Any]]:
        """``in_avals`` as every run request of it names them (made once: read, never changed)."""
        return [a.to_json() for a in self.in_avals]

    def check_inputs(self, avals: Sequence[Aval]) -> None:
        """Raise ``SignatureMismatch`` naming the first input that does not fit."""
        check_inputs(self.in_avals, avals)

    @property
    def out_device_bytes(self) -> tuple[int, ...]:
        """Device bytes each output of a sharded executable takes on all its devices (its
        replicas each count); empty for a single-device one, whose outputs take their size."""
        sharded = (self.meta.get("sharding") or {}).get("out_device_bytes")
        if isinstance(sharded, list) and len(sharded) == len(self.out_avals):
            return tuple(int(n) for n in sharded)
        return ()


@dataclasses.dataclass(frozen=True)
class Resolved:
    """Where a call's executable came from: ``tier`` (``memory``, ``disk``, ``redis``,
    ``compiled``) and the seconds a compile took (0 unless ``compiled``)."""

    executable: RemoteExecutable
    executable_id: str
    tier: str
    compile_seconds: float


CallKey = tuple[str, "tuple[Aval, ...] | None", str, tuple[int, ...], str, tuple[tuple[str, Any], ...]]


def call_key(program_id: str, in_avals: Sequence[Aval] | None, options: CallOptions) -> CallKey:
    """What an ``ExecutableIndex`` knows a call by (avals compare by shape, dtype and
    weak type: a tuple, not JSON, since every call looks one up)."""
    return (program_id, None if in_avals is None else tuple(in_avals), options.static_key,
            options.donate, options.scope, options.compiler_options)


class ExecutableIndex:
    """Signatures by call, least recently used evicted first (bounded like L1)."""

    def __init__(self, max_entries: int) -> None:
        self._by_call: MemoryCache[RemoteExecutable] = MemoryCache(max_entries, 1 << 62)

    def get(self, key: CallKey) -> RemoteExecutable | None:
        return self._by_call.get(key)

    def put(self, key: CallKey, executable: RemoteExecutable) -> None:
        self._by_call.put(key, executable, 1)

    def forget(self, executable_id: str) -> bool:
        """Drop every call that names ``executable_id``; whether any did."""
        calls = [k for k, exe in self._by_call.items() if exe.executable_id == executable_id]
        for key in calls:
            self._by_call.pop(key)
        return bool(calls)

    def values(self) -> list[RemoteExecutable]:
        """One record per executable id (several calls may share one)."""
        seen: dict[str, RemoteExecutable] = {}
        for exe in self._by_call.values():
            seen[exe.executable_id] = exe
        return list(seen.values())
