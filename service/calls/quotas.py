"""Per-tenant quotas: what one API key may hold or do, so it cannot starve the others.

With API keys on (``JITSERVE_API_KEYS``) every key is a tenant, and each tenant has

    live_futures         futures alive at once                 JITSERVE_TENANT_MAX_LIVE_FUTURES
    device_bytes         output bytes its live futures hold    JITSERVE_TENANT_MAX_DEVICE_BYTES
    compiles_per_minute  real XLA compiles (not cache hits)    JITSERVE_TENANT_COMPILES_PER_MINUTE
    executables          distinct executables it compiled/ran  JITSERVE_TENANT_MAX_EXECUTABLES
    program_bytes        bytes of the programs it uploaded     JITSERVE_TENANT_MAX_PROGRAM_BYTES
    ifrt_sessions        IFRT proxy sessions open at once      JITSERVE_TENANT_MAX_IFRT_SESSIONS

Past one, the call is a 429 ``too_many_requests`` with ``Retry-After`` and
``error.quota`` naming the quota (``QuotaExceeded``); other tenants are unaffected
(IFRT sessions get ``RESOURCE_EXHAUSTED`` naming it). The server's own limits
(``JITSERVE_MAX_LIVE_FUTURES``, ...) stay its total. Unset, the live-futures,
device-bytes and sessions quotas are a fair share of those totals (the total divided
by the number of keys), so keys that keep to their quotas never reach the total.
Without API keys there is one tenant and no quotas: the totals alone apply.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..errors import TooManyRequests

if TYPE_CHECKING:
    from ..settings import Settings

__all__ = ["CompileBudget", "QuotaExceeded", "Quotas"]

_NO_LIMIT = 1 << 62


@dataclasses.dataclass(frozen=True)
class Quotas:
    """The quotas of every tenant (each key has the same ones).

    Attributes:
      live_futures: most futures one tenant may have alive.
      device_bytes: most output bytes one tenant's live futures may hold.
      compiles_per_minute: most real compiles (``tier == "compiled"``) one tenant may
        start in any 60 seconds.
      executables: most distinct executables one tenant may hold (those it compiled
        or ran, for its own programs).
      program_bytes: most bytes of programs one tenant may hold (sum of their sizes).
      compile_slots: most blocking lookups (compiles) one tenant may run at once.
      ifrt_sessions: most IFRT proxy sessions one tenant may have open at once.
    """

    live_futures: int
    device_bytes: int
    compiles_per_minute: int
    executables: int
    program_bytes: int
    compile_slots: int
    ifrt_sessions: int = _NO_LIMIT

    @classmethod
    def from_settings(cls, settings: Settings, compile_workers: int) -> Quotas:
        """The quotas ``settings`` ask for; a fair share of the server's limits where unset.

        ``compile_workers`` is what the compile pool can really run at once.
        """
        keys = max(1, len(settings.api_keys))
        return cls(
            live_futures=settings.tenant_max_live_futures or max(1, settings.max_live_futures // keys),
            device_bytes=settings.tenant_max_device_bytes or max(1, settings.device_bytes_limit // keys),
            compiles_per_minute=settings.tenant_compiles_per_minute,
            executables=settings.tenant_max_executables or settings.l1_max_entries,
            program_bytes=settings.tenant_max_program_bytes or settings.programs_max_bytes,
            compile_slots=max(1, math.ceil(compile_workers * settings.tenant_compile_share)),
            ifrt_sessions=settings.tenant_max_ifrt_sessions or max(
                1, settings.ifrt_sessions_limit // keys))

    @classmethod
    def unlimited(cls) -> Quotas:
        """No quota at all (the one tenant of a server without API keys)."""
        return cls(live_futures=_NO_LIMIT, device_bytes=_NO_LIMIT,
                   compiles_per_minute=_NO_LIMIT, executables=_NO_LIMIT,
                   program_bytes=_NO_LIMIT, compile_slots=_NO_LIMIT)


class QuotaExceeded(TooManyRequests):
    """A tenant's quota is reached: a 429 whose body names the quota (``error.quota``)."""

    def __init__(self, quota: str, message: str, retry_after_s: float = 60.0) -> None:
        super().__init__(message, retry_after_s, quota=quota)
        self.quota = quota


class CompileBudget:
    """Real compiles per tenant in a sliding minute, reserved before a compile starts.

    A compile is reserved before the lookup (so concurrent calls cannot all slip
    under the quota) and given back when the lookup turns out to be a cache hit.

    Args:
      per_minute: most compiles one tenant may start in any 60 seconds.
      clock: monotonic seconds (injectable for tests).
    """

    WINDOW_S = 60.0

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.per_minute = per_minute
        self._clock = clock
        self._starts: dict[str, collections.deque[float]] = {}
        # The tenant's compiles in the last minute through another protocol (its IFRT
        # sessions, ``service.ifrt``): they count here too. Set once that service starts.
        self.elsewhere: Callable[[str], int] | None = None

    def count(self, tenant: str) -> int:
        """``tenant``'s compiles counted here in the last minute."""
        return len(self._window(tenant))

    def full(self, tenant: str) -> bool:
        """Whether ``tenant`` has no compile left in this minute."""
        return len(self._window(tenant)) + self._other(tenant) >= self.per_minute

    def _other(self, tenant: str) -> int:
        return 0 if self.elsewhere is None else self.elsewhere(tenant)

    def reserve(self, tenant: str) -> float:
        """Count one compile for ``tenant`` now; ``QuotaExceeded`` when none is left.

        Returns a token for ``give_back``.
        """
        starts = self._window(tenant)
        other = self._other(tenant)
        if len(starts) + other >= self.per_minute:
            wait = (starts[0] + self.WINDOW_S - self._clock()) if starts else self.WINDOW_S
            also = f" ({other} of them in IFRT sessions)" if other else ""
            raise QuotaExceeded(
                "compiles_per_minute",
                f"this API key started {len(starts) + other} compiles in the last minute{also}, "
                "its quota (JITSERVE_TENANT_COMPILES_PER_MINUTE); retry later, or call "
                "programs and shapes that are already compiled", wait)
        token = self._clock()
        starts.append(token)
        return token

    def record(self, tenant: str) -> None:
        """Count a compile that was not reserved (a cache entry that failed to load)."""
        self._window(tenant).append(self._clock())

    def give_back(self, tenant: str, token: float) -> None:
        """Undo ``reserve``: the lookup was answered by a cache, not compiled."""
        starts = self._starts.get(tenant)
        if starts is not None and token in starts:
            starts.remove(token)

    def _window(self, tenant: str) -> collections.deque[float]:
        starts = self._starts.setdefault(tenant, collections.deque())
        horizon = self._clock() - self.WINDOW_S
        while starts and starts[0] <= horizon:
            starts.popleft()
        return starts
