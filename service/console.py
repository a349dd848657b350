"""The console's memory: the last minutes of this API process, bounded, for ``/console``.

Prometheus keeps counts; the console (``service.api.routes.console``) also shows what
a time series cannot hold: each recent compile (program, signature, tier, seconds,
why it recompiled), the runtimes' last exits, the keys behind quota refusals. This
module keeps that, in the API process, bounded whatever the traffic::

    per second and owner, the last ``WINDOW_S``   calls, their latency (a histogram of
                                                  fixed bins), the tier each call's
                                                  executable came from, errors by
                                                  code, quota refusals by quota
    the last ``COMPILES_KEPT`` compiles           ``CompileRecord``
    the last ``EXITS_KEPT`` runtime exits         ``RuntimeExit``

A call costs a few counter bumps in its second's bucket (``call_finished``, which the
future store calls as each future ends): no lock, since the event loop is the only
writer but for runtime exits, which a bounded deque takes from the supervisor
threads; nothing is allocated but the bucket of a new second (or of an owner's
first call in it). Nothing here reads a program's content: only the ids, names and
avals the runtimes reported, and the codes of refusals.

Whose is what: each record keeps its owner (an API-key digest, ``None`` without
keys) and a ``Viewer`` sees only its own, unless it is an admin (or auth is off).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

from jitserve.wire import FutureStatus, TierName

from .owners import same_owner

__all__ = [
    "COMPILES_KEPT",
    "EXITS_KEPT",
    "WINDOW_S",
    "CompileRecord",
    "Console",
    "Finished",
    "RuntimeExit",
    "Viewer",
    "key_label",
]

_compile_log = logging.getLogger("jitserve.compile")

WINDOW_S = 600  # seconds of per-second history
COMPILES_KEPT = 512
EXITS_KEPT = 64
# Owners counted apart within one second; past that (keys made up by the thousand,
# say), the rest share one bucket, so a second's memory stays bounded.
_OWNERS_PER_SECOND = 64
_OTHERS = "(others)"
# Latency bins: ten per decade from 100 us (bin 0: at most that) up to 1000 s.
_BINS = 71
_FLOOR_S = 1e-4
_CACHE_TIERS = (TierName.MEMORY.value, TierName.DISK.value, TierName.REDIS.value)
_LOOKUP_TIERS = (*_CACHE_TIERS, TierName.COMPILED.value)
_MESSAGE_CHARS = 400


def key_label(owner: str | None) -> str:
    """How the console names an owner: the first 12 hex digits of its key's digest (as
    the logs do), or ``"none"`` without keys. The key itself is never known here."""
    return "none" if owner is None else owner[:12]


@dataclasses.dataclass(frozen=True)
class Viewer:
    """Who asks: their owner id, and whether they see everyone's (an admin key, or auth off)."""

    owner: str | None
    admin: bool

    def sees(self, owner: str | None) -> bool:
        return self.admin or same_owner(owner, self.owner)


class Finished(Protocol):
    """What ``call_finished`` reads of a future (``service.calls.futures.Future``)."""

    owner: str | None
    created: float  # wall-clock seconds
    tier: str
    status: FutureStatus
    error: dict[str, Any] | None


@dataclasses.dataclass(frozen=True)
class CompileRecord:
    """One lookup that the API process's index could not answer: where the executable
    came from (``tier``: memory, disk, redis, compiled), or why there is none (``error``).

    Attributes:
      at: wall-clock seconds.
      owner: the caller's key digest (``None`` without keys).
      program_id, name: the program (``name``: the exported function's, when known).
      signature: the input avals, e.g. ``float32[8], int32[]`` ("" when the program's own).
      tier: a ``TierName``, or ``"failed"``.
      seconds: the lookup's compile (or load) time.
      recompiled_because: what differed from the program's last compile, when it compiled.
      executable_id: what it found ("" when it failed).
      error: ``{"code", "message"}`` of a refusal.
    """

    at: float
    owner: str | None
    program_id: str
    name: str
    signature: str
    tier: str
    seconds: float
    recompiled_because: tuple[str, ...] | None = None
    executable_id: str = ""
    error: dict[str, str] | None = None

    def log(self, where: str = "", **fields: Any) -> None:
        """One ``jitserve.compile`` line for what compiled or loaded (``where``: said
        after it, such as the IFRT session; ``fields``: added to the JSON line's)."""
        compiled = self.tier == TierName.COMPILED
        reasons = list(self.recompiled_because) if self.recompiled_because else None
        because = f" because {'; '.join(reasons)}" if reasons else ""
        _compile_log.info(
            "%s %s %s(%s) tier=%s %.3fs%s%s", "compiled" if compiled else "loaded",
            self.program_id[:12], self.name or "program", self.signature, self.tier,
            self.seconds, because, where,
            extra={"fields": {"program_id": self.program_id, "function": self.name or None,
                              "executable_id": self.executable_id, "signature": self.signature,
                              "tier": self.tier, "seconds": round(self.seconds, 6),
                              "recompiled_because": reasons, **fields}})

    def document(self) -> dict[str, Any]:
        return {"at": self.at, "key": key_label(self.owner), "program_id": self.program_id,
                "name": self.name, "signature": self.signature, "tier": self.tier,
                "seconds": round(self.seconds, 6), "executable_id": self.executable_id,
                "recompiled_because": (None if self.recompiled_because is None
                                       else list(self.recompiled_because)),
                "error": self.error}


@dataclasses.dataclass(frozen=True)
class RuntimeExit:
    """A runtime process that ended: when, which, why (``why``: the pool's words, such
    as "was stopped: an execution on it passed its deadline"), and the code its lost
    work failed with (``runtime_crashed``, ``runtime_stopped``)."""

    at: float
    runtime: int
    generation: int
    why: str
    code: str

    def document(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _Tally:
    """One owner's counts in one second."""

    __slots__ = ("calls", "errors", "latency", "quotas", "tiers")

    def __init__(self) -> None:
        self.calls = 0
        self.latency = [0] * _BINS
        self.tiers: dict[str, int] = {}
        self.errors: dict[str, int] = {}
        self.quotas: dict[str, int] = {}


def _bin(seconds: float) -> int:
    if seconds <= _FLOOR_S:
        return 0
    return min(int((math.log10(seconds) + 4) * 10) + 1, _BINS - 1)


def _bound(index: int) -> float:
    """The upper bound of latency bin ``index``, in seconds."""
    return _FLOOR_S * 10 ** (index / 10)


def _percentiles(histogram: Sequence[int], qs: Iterable[float] = (0.5, 0.9, 0.99)
                 ) -> dict[str, float | None]:
    """``p50_s``...: the upper bound of the bin each quantile falls in (``None``: no calls)."""
    total = sum(histogram)
    out: dict[str, float | None] = {}
    for q in qs:
        name = f"p{round(q * 100)}_s"
        if not total:
            out[name] = None
            continue
        want, seen = q * total, 0
        for index, n in enumerate(histogram):
            seen += n
            if seen >= want:
                out[name] = round(_bound(index), 6)
                break
    return out


class Console:
    """This process's recent history, for the console's panels.

    Args:
      window_s: seconds of per-second history kept.
      clock: wall-clock seconds (the clock futures are stamped with; injectable).
    """

    def __init__(self, *, window_s: int = WINDOW_S,
                 clock: Callable[[], float] = time.time) -> None:
        self.window_s = window_s
        self._clock = clock
        self._stamps = [-1] * window_s
        self._slots: list[dict[str | None, _Tally]] = [{} for _ in range(window_s)]
        self._compiles: collections.deque[CompileRecord] = collections.deque(maxlen=COMPILES_KEPT)
        self._exits: collections.deque[RuntimeExit] = collections.deque(maxlen=EXITS_KEPT)
        self._sessions: Callable[[], list[dict[str, Any]]] | None = None

    # -- recording --------------------------------------------------------------------

    def _tally(self, owner: str | None, second: int) -> _Tally:
        i = second % self.window_s
        slot = self._slots[i]
        if self._stamps[i] != second:
            slot = self._slots[i] = {}
            self._stamps[i] = second
        tally = slot.get(owner)
        if tally is None:
            if len(slot) >= _OWNERS_PER_SECOND:
                owner = _OTHERS
                tally = slot.get(owner)
            if tally is None:
                tally = slot[owner] = _Tally()
        return tally

    def call_finished(self, fut: Finished) -> None:
        """A call's future ended (done, failed or cancelled): count it, its latency from
        accepted to ended, its executable's tier, and its error. Puts are no calls."""
        tier = fut.tier
        if tier == "put":
            return
        now = self._clock()
        tally = self._tally(fut.owner, int(now))
        tally.calls += 1
        tally.latency[_bin(now - fut.created)] += 1
        tiers = tally.tiers
        tiers[tier] = tiers.get(tier, 0) + 1
        error = fut.error
        if error is not None and fut.status is FutureStatus.FAILED:
            self._error(tally, str(error.get("code")), error.get("quota"))

    def refused(self, owner: str | None, code: str, quota: str | None = None) -> None:
        """A request answered with error ``code`` (``quota``: the one it ran into)."""
        self._error(self._tally(owner, int(self._clock())), code, quota)

    @staticmethod
    def _error(tally: _Tally, code: str, quota: Any) -> None:
        tally.errors[code] = tally.errors.get(code, 0) + 1
        if quota is not None:
            tally.quotas[str(quota)] = tally.quotas.get(str(quota), 0) + 1

    def compiled(self, record: CompileRecord) -> None:
        """A lookup the index could not answer ended (compiled, loaded, or refused)."""
        error = record.error
        if error is not None and len(error.get("message", "")) > _MESSAGE_CHARS:
            record = dataclasses.replace(record, error={
                **error, "message": error["message"][:_MESSAGE_CHARS] + "..."})
        self._compiles.append(record)

    def runtime_exited(self, runtime: int, generation: int, why: str, code: str) -> None:
        """A runtime's process ended (any thread: a supervisor's calls this)."""
        self._exits.append(RuntimeExit(self._clock(), runtime, generation, why, code))

    def sessions_from(self, source: Callable[[], list[dict[str, Any]]] | None) -> None:
        """Where the open IFRT sessions are read (``service.ifrt``'s ``describe``); each
        a document with its ``owner``; ``None`` when that server stops."""
        self._sessions = source

    # -- reading ----------------------------------------------------------------------

    def _seconds(self, viewer: Viewer, seconds: int) -> list[tuple[int, list[_Tally]]]:
        """The tallies ``viewer`` sees in each of the last ``seconds`` (oldest first)."""
        now = int(self._clock())
        out: list[tuple[int, list[_Tally]]] = []
        for second in range(now - min(seconds, self.window_s) + 1, now + 1):
            i = second % self.window_s
            if self._stamps[i] != second:
                out.append((second, []))
                continue
            out.append((second, [t for owner, t in self._slots[i].items()
                                 if _shown(viewer, owner)]))
        return out

    def work(self, viewer: Viewer, seconds: int = 300) -> dict[str, Any]:
        """Calls per second, latency percentiles, errors by code and quota refusals by
        key, over the last ``seconds`` in points of ``step_s`` seconds, and in all."""
        seconds = max(1, min(seconds, self.window_s))
        step = max(1, math.ceil(seconds / 120))
        points: list[dict[str, Any]] = []
        total_latency = [0] * _BINS
        errors: collections.Counter[str] = collections.Counter()
        calls = 0
        for start, group in _steps(self._seconds(viewer, seconds), step):
            latency = [0] * _BINS
            point_errors: collections.Counter[str] = collections.Counter()
            n = 0
            for tally in group:
                n += tally.calls
                point_errors.update(tally.errors)
                for i, count in enumerate(tally.latency):
                    if count:
                        latency[i] += count
                        total_latency[i] += count
            calls += n
            errors.update(point_errors)
            points.append({"t": start, "calls": n, "per_s": round(n / step, 3),
                           "errors": dict(point_errors), **_percentiles(latency)})
        return {"window_s": seconds, "step_s": step, "now": self._clock(), "points": points,
                "totals": {"calls": calls, "per_s": round(calls / seconds, 3),
                           **_percentiles(total_latency), "errors": dict(errors),
                           "quota_refusals": self._quota_refusals(viewer, seconds)}}

    def _quota_refusals(self, viewer: Viewer, seconds: int) -> list[dict[str, Any]]:
        now = int(self._clock())
        by: collections.Counter[tuple[str, str]] = collections.Counter()
        for second in range(now - seconds + 1, now + 1):
            i = second % self.window_s
            if self._stamps[i] != second:
                continue
            for owner, tally in self._slots[i].items():
                if tally.quotas and _shown(viewer, owner):
                    label = owner if owner == _OTHERS else key_label(owner)
                    for quota, n in tally.quotas.items():
                        by[(label, quota)] += n
        return [{"key": key, "quota": quota, "count": n}
                for (key, quota), n in sorted(by.items(), key=lambda kv: (-kv[1], kv[0]))]

    def tiers(self, viewer: Viewer, seconds: int = 300) -> dict[str, Any]:
        """Where calls' executables came from (memory, disk, redis, compiled) over the
        last ``seconds``, in points of ``step_s``: counts and the cache hit rate."""
        seconds = max(1, min(seconds, self.window_s))
        step = max(5, math.ceil(seconds / 60))
        points = []
        totals: collections.Counter[str] = collections.Counter()
        for start, group in _steps(self._seconds(viewer, seconds), step):
            counts: collections.Counter[str] = collections.Counter()
            for tally in group:
                counts.update({t: n for t, n in tally.tiers.items() if t in _LOOKUP_TIERS})
            totals.update(counts)
            points.append({"t": start, "tiers": dict(counts), "hit_rate": _hit_rate(counts)})
        return {"window_s": seconds, "step_s": step, "points": points,
                "totals": {"tiers": dict(totals), "hit_rate": _hit_rate(totals)}}

    def compiles(self, viewer: Viewer, seconds: int = 300, limit: int = 100) -> dict[str, Any]:
        """The recent lookups ``viewer`` may see (newest first), the slowest and the most
        recompiled programs among those kept, and the tiers' hit rates."""
        mine = [r for r in self._compiles if viewer.sees(r.owner)]
        compiled = [r for r in mine if r.tier == TierName.COMPILED]
        slowest = heapq.nlargest(5, compiled, key=lambda r: r.seconds)
        by_program: dict[tuple[str | None, str], list[CompileRecord]] = {}
        for r in compiled:
            by_program.setdefault((r.owner, r.program_id), []).append(r)
        most = sorted(by_program.values(), key=lambda rs: (-len(rs), -rs[-1].at))[:5]
        return {"recent": [r.document() for r in reversed(mine[-limit:])],
                "kept": len(mine),
                "failed": sum(r.error is not None for r in mine),
                "slowest": [r.document() for r in slowest],
                "most_recompiled": [_program_summary(rs) for rs in most],
                "hit_rate": self.tiers(viewer, seconds)}

    def exits(self) -> list[dict[str, Any]]:
        """The runtimes' recent exits, newest first."""
        return [e.document() for e in reversed(self._exits)]

    def last_exits(self) -> dict[int, dict[str, Any]]:
        """Each runtime's last exit, by its index."""
        out: dict[int, dict[str, Any]] = {}
        for e in self._exits:
            out[e.runtime] = e.document()
        return out

    def sessions(self, viewer: Viewer) -> list[dict[str, Any]] | None:
        """The open IFRT sessions ``viewer`` may see (``None``: no IFRT server)."""
        source = self._sessions
        if source is None:
            return None
        out = []
        for doc in source():
            owner = doc.get("owner") or None
            if viewer.sees(owner):
                out.append({**{k: v for k, v in doc.items() if k != "owner"},
                            "key": key_label(owner)})
        return out


def _shown(viewer: Viewer, owner: str | None) -> bool:
    """Whether ``viewer`` sees a tally of ``owner`` (the pooled one: admins only)."""
    return viewer.admin if owner == _OTHERS else viewer.sees(owner)


def _steps(seconds: list[tuple[int, list[_Tally]]], step: int
           ) -> Iterable[tuple[int, list[_Tally]]]:
    """The per-second tallies grouped ``step`` seconds at a time."""
    for i in range(0, len(seconds), step):
        chunk = seconds[i:i + step]
        yield chunk[0][0], [t for _, tallies in chunk for t in tallies]


def _hit_rate(counts: Mapping[str, int]) -> float | None:
    total = sum(counts.get(t, 0) for t in _LOOKUP_TIERS)
    if not total:
        return None
    return round(sum(counts.get(t, 0) for t in _CACHE_TIERS) / total, 4)


def _program_summary(records: list[CompileRecord]) -> dict[str, Any]:
    last = records[-1]
    reasons = next((r.recompiled_because for r in reversed(records) if r.recompiled_because),
                   None)
    return {"key": key_label(last.owner), "program_id": last.program_id, "name": last.name,
            "compiles": len(records), "seconds": round(sum(r.seconds for r in records), 6),
            "signatures": sorted({r.signature for r in records}),
            "recompiled_because": None if reasons is None else list(reasons)}
