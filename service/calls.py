"""Program calls: compile on demand, then execute into a future.

``Calls.execute`` is the whole of ``POST /v1/programs/{id}/execute`` below the
HTTP layer: it turns the decoded arguments (numpy arrays and future references)
into concrete avals, looks up (or compiles) the executable for them off the
event loop, creates the future and hands the work to the executor.

With tenants kept apart (API keys on), a lookup that no cache can answer waits
for its tenant's turn at the compile pool (``service.scheduler``) and counts
against the tenant's compiles per minute; every executable looked up becomes
the tenant's (``service.tenants``), within its quota of executables.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from starlette.concurrency import run_in_threadpool

from jitserve import wire
from jitserve.compiler.programs import Program
from jitserve.service.errors import BadRequest, FutureCancelled, FutureFailed
from jitserve.service.executor import Arg, Executor, FutureRef
from jitserve.service.futures import Future, FutureStore
from jitserve.service.metrics import Metrics
from jitserve.service.scheduler import FairScheduler
from jitserve.service.tenants import Tenants
from jitserve.wire import Aval, FutureStatus, TierName

if TYPE_CHECKING:
    from jitserve.compiler import Compiler, Lookup

__all__ = ["Call", "Calls"]

compile_log = logging.getLogger("jitserve.compile")


@dataclasses.dataclass(frozen=True)
class Call:
    """A started execution: its future and where its executable came from."""

    future: Future
    tier: str


class Calls:
    """Compiles and runs programs for callers.

    Args:
      compiler: decodes, compiles and caches (``compiler.Compiler``).
      futures: where new futures go.
      executor: runs them.
      metrics: cache, compile and transfer counters.
      tenants: who owns which executable, and the compile quota; omitted, one tenant.
      scheduler: turns at the compile pool for the tenants' lookups; omitted, every
        lookup goes straight to the thread pool (one tenant: nobody to be fair to).
    """

    def __init__(self, compiler: Compiler, futures: FutureStore, executor: Executor,
                 metrics: Metrics, tenants: Tenants | None = None,
                 scheduler: FairScheduler | None = None) -> None:
        self._compiler = compiler
        self._futures = futures
        self._executor = executor
        self._metrics = metrics
        self._tenants = tenants or Tenants()
        self._scheduler = scheduler

    async def compile(self, program: Program, in_avals: Sequence[Aval] | None,
                      static_key: str = "", owner: str | None = None) -> Lookup:
        """The compiler's ``Lookup`` for ``program`` at ``in_avals`` (compiling if needed).

        ``QuotaExceeded`` when ``owner`` would pass its executables or compiles quota.
        """
        # An L1 hit needs no thread: only a miss may block on disk, Redis or XLA.
        lookup = self._compiler.cached(program, in_avals, static_key)
        if lookup is None:
            lookup = await self._lookup(program, in_avals, static_key, owner)
            _log_lookup(program, lookup)
        self._tenants.claim_executable(owner, lookup.executable_id, program.program_id)
        self._metrics.lookup(lookup.tier, lookup.compile_seconds)
        return lookup

    async def _lookup(self, program: Program, in_avals: Sequence[Aval] | None,
                      static_key: str, owner: str | None) -> Lookup:
        """A lookup past L1: straight to a thread, or, for a tenant, in its turn."""
        lookup_args = (program, in_avals, static_key)
        if self._scheduler is None or owner is None or not self._tenants.scoped:
            return await run_in_threadpool(self._compiler.lookup, *lookup_args)
        key = self._compiler.executable_id(*lookup_args)
        self._tenants.check_executable_room(owner, key)  # before paying for a compile
        budget = self._tenants.compiles
        if await run_in_threadpool(self._in_l2, key):
            # A cache answers: no turn to wait for, no compile to count (unless its
            # entry turns out not to load here).
            lookup = await run_in_threadpool(self._compiler.lookup, *lookup_args)
            if lookup.tier == TierName.COMPILED:
                budget.record(owner)
            return lookup
        token = budget.reserve(owner)
        lookup = await self._scheduler.run(owner, self._compiler.lookup, *lookup_args)
        if lookup.tier != TierName.COMPILED:  # another caller compiled it meanwhile
            budget.give_back(owner, token)
        return lookup

    def _in_l2(self, key: str) -> bool:
        """Whether a serialized tier (disk, Redis) holds ``key``; blocks. A failing tier: no."""
        for tier in self._compiler.tiers:
            try:
                if tier.contains(key):
                    return True
            except Exception:  # a tier failure is a miss here as in the lookup itself
                continue
        return False

    async def execute(self, program: Program, args: Sequence[Any], static_key: str,
                      owner: str | None) -> Call:
        """Start running ``program`` on ``args``; returns before it runs.

        ``args`` are decoded wire values: numpy arrays or ``{"future", "output"}``
        references to the caller's own futures.
        """
        resolved = [self._resolve(arg, i, owner) for i, arg in enumerate(args)]
        avals = [aval for _, aval in resolved]
        lookup = await self.compile(program, avals, static_key, owner)
        lookup.executable.check_inputs(avals)
        self._executor.admit(lookup.executable)  # its intermediates count too (executor.py)
        fut = self._futures.create(
            owner=owner, executable_id=lookup.executable_id,
            out_avals=lookup.executable.out_avals, out_tree=lookup.executable.out_tree,
            compile_s=lookup.compile_seconds)
        self._metrics.transferred("in", sum(a.nbytes for a, _ in resolved
                                            if isinstance(a, np.ndarray)))
        self._executor.submit(fut, lookup.executable, [a for a, _ in resolved])
        return Call(fut, lookup.tier)

    def _resolve(self, arg: Any, i: int, owner: str | None) -> tuple[Arg, Aval]:
        """One argument as something the executor takes, with its aval."""
        if isinstance(arg, np.ndarray):
            return arg, Aval.of(arg)
        if wire.is_future_ref(arg):
            return self._resolve_ref(arg, i, owner)
        raise BadRequest(f"args[{i}] must be an array {{dtype, shape, data}} or a future "
                         f"reference {{future, output}}, got {_describe(arg)}")

    def _resolve_ref(self, ref: dict[str, Any], i: int, owner: str | None) -> tuple[Arg, Aval]:
        dep = self._futures.get(ref["future"], owner)
        k = ref["output"]
        if not 0 <= k < len(dep.out_avals):
            raise BadRequest(f"args[{i}] asks for output {k} of future {dep.future_id}, "
                             f"which has {len(dep.out_avals)} outputs")
        aval = dep.out_avals[k]
        if dep.status is FutureStatus.DONE and dep.outputs is not None:
            return dep.outputs[k], aval  # the device array itself: no transfer
        if dep.status is FutureStatus.FAILED:
            msg = (dep.error or {}).get("message", "")
            raise FutureFailed(f"args[{i}] refers to future {dep.future_id}, which failed: {msg}")
        if dep.status is FutureStatus.CANCELLED:
            raise FutureCancelled(f"args[{i}] refers to future {dep.future_id}, which was cancelled")
        return FutureRef(dep, k), aval


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"a map with keys {sorted(map(str, value))[:8]}"
    return type(value).__name__


def _log_lookup(program: Program, lookup: Lookup) -> None:
    """One line per lookup that L1 could not answer: what compiled (or loaded), and how long."""
    exe = lookup.executable
    signature = ", ".join(str(a) for a in exe.in_avals)
    name = program.name or "program"
    compile_log.info(
        "%s %s %s(%s) tier=%s %.3fs", "compiled" if lookup.tier == TierName.COMPILED else "loaded",
        program.program_id[:12], name, signature, lookup.tier, lookup.compile_seconds,
        extra={"fields": {"program_id": program.program_id, "function": program.name or None,
                          "executable_id": lookup.executable_id, "signature": signature,
                          "tier": str(lookup.tier), "seconds": round(lookup.compile_seconds, 6)}})
