"""Array futures: the state of one execution and the store that owns them.

A future goes ``compiling -> pending -> running -> done | failed``, or to
``cancelled`` when deleted before it runs; a compile that fails fails it. Its
outputs stay on their runtime until they are released (one by one, as a client's
arrays are garbage-collected), or the future is deleted or expires. An output
that a queued call still has to read is *pinned*: it is freed when the last such
call has taken hold of it, so releasing or deleting never pulls an input from
under a call that was already accepted. Every state change happens on the event
loop and wakes long-pollers (each waits on a loop future of its own), so nobody
busy-waits.

The store bounds how many futures are alive and how many output bytes they may
hold, in all and per owner (each API key's quota, ``service.quotas``); past a
limit ``create`` raises ``TooManyRequests`` (a 429 with ``Retry-After``; for an
owner's quota, ``QuotaExceeded``, which names it). When futures expire is kept
soonest first, so neither sweeping nor a ``Retry-After`` walks the store. Ids are
``secrets.token_urlsafe(24)`` (192 bits): unguessable, and only their creator (by
API-key digest) can see them.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import heapq
import logging
import secrets
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

from jitserve.compiler.errors import LimitExceeded
from jitserve.wire import Aval, FutureStatus

from ..errors import NotFound, TooManyRequests
from ..owners import same_owner
from .quotas import QuotaExceeded

__all__ = ["Future", "FutureStore", "Job", "Timings"]

log = logging.getLogger("jitserve.futures")


class Job(Protocol):
    """The execution behind a future, as far as the store needs it."""

    def cancel(self) -> bool:
        """Stop the execution if it has not started; whether it was stopped."""
        ...

    def stop(self) -> str | None:
        """Stop the running execution; ``None`` if it was stopped, else why it cannot be."""
        ...

    def unqueue(self) -> bool:
        """Take an execution sent to its runtime, but waiting there, out of its queue;
        whether that was asked."""
        ...


@dataclasses.dataclass
class Timings:
    """Seconds spent: waiting to run, compiling (before the future existed), running."""

    queued_s: float | None = None
    compile_s: float = 0.0
    run_s: float | None = None


@dataclasses.dataclass(eq=False)
class Future:
    """One execution's stored state (the wire view is ``schemas.FutureView``).

    Attributes:
      future_id: the unguessable id.
      owner: the creator's API-key digest, or ``None`` without auth.
      executable_id: what runs.
      out_avals, out_tree: the outputs' avals and pytree structure.
      created, expires_at: wall-clock seconds since the epoch.
      reserved_bytes: device bytes counted against the store's limit (and its
        owner's quota): its outputs', and until it ends its host inputs'.
      input_bytes: of those, the host inputs' (the call's arrays, held by the
        server from when it accepted the call until the run ends).
      status, outputs, error, timings: progress; ``outputs`` only when done (an
        entry is ``None`` once that output is freed).
      host: small outputs' host copies, which came with the run's answer (``None``
        for the others: ``wire.carried_outputs``).
      removed: why the future left the store (``"deleted"``, ``"expired"``,
        ``"released"``), if it did.
      released: the outputs its caller let go of.
      pins: per output, how many accepted calls still have to read it.
    """

    future_id: str
    owner: str | None
    executable_id: str
    out_avals: tuple[Aval, ...]
    out_tree: Any
    created: float
    expires_at: float
    reserved_bytes: int
    input_bytes: int = 0
    out_bytes: tuple[int, ...] = ()  # device bytes of each output, when not its size
    tier: str = ""  # where its executable came from: a TierName, "pending", "batched", "put"
    status: FutureStatus = FutureStatus.PENDING
    outputs: list[Any] | None = None
    host: list[Any] | None = None
    error: dict[str, Any] | None = None
    timings: Timings = dataclasses.field(default_factory=Timings)
    job: Job | None = None
    runtime: Any = None
    removed: str | None = None
    released: set[int] = dataclasses.field(default_factory=set)
    pins: collections.Counter[int] = dataclasses.field(default_factory=collections.Counter)
    # The loop futures of those waiting for the next change: made by the first
    # waiter (most futures end with nobody waiting), dropped by the change.
    _waiters: list[asyncio.Future[None]] | None = dataclasses.field(default=None, repr=False)

    def failed_input(self, where: str) -> tuple[str, dict[str, str]]:
        """The message and ``root`` of a call whose input (``where``: which) is an
        output of this failed future. The root is the failure that began the chain;
        every later link names it in its message too, instead of nesting the link's
        own: a loop that went on after a failure made messages that grew with it."""
        error = self.error or {}
        root = error.get("root")
        if not isinstance(root, dict):  # this future is the first failure
            root = {"future_id": self.future_id, "code": str(error.get("code", "future_failed")),
                    "message": str(error.get("message", ""))}
            return f"{where}, which failed: {root['message']}", root
        first = f"future {root['future_id']}" if "future_id" in root else "a call before it"
        return (f"{where}, which failed: {first} failed first: {root['code']}: "
                f"{root['message']}", root)

    def _notify(self) -> None:
        # Wake everyone waiting; later waiters wait for the change after this one.
        waiters, self._waiters = self._waiters, None
        for waiter in waiters or ():
            if not waiter.done():
                waiter.set_result(None)

    async def _next_change(self) -> None:
        """Return at the next ``_notify``. (A bare loop future per waiter: an
        ``asyncio.Event`` per future cost more than the rest of a cached call's wait.)"""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            waiters = self._waiters
            if waiters is not None and (not waiter.done() or waiter.cancelled()):
                with contextlib.suppress(ValueError):  # a wait given up: only its own
                    waiters.remove(waiter)

    async def wait_change(self, seen: FutureStatus, timeout: float) -> None:
        """Wait up to ``timeout`` seconds while the status is still ``seen``."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                while self.status is seen and self.removed is None:
                    await self._next_change()

    async def wait_ended(self) -> None:
        """Wait until it is done, failed or cancelled, even once it left the store
        (a call that read it was accepted before; its job always ends it)."""
        while not self.status.is_final:
            await self._next_change()

    async def wait_final(self, timeout: float | None = None) -> bool:
        """Wait (up to ``timeout``) until done, failed, cancelled or removed.

        The time limit is a timer that wakes the waiters as a change would (they
        look again, and wait on); ``asyncio.timeout``'s cancel and uncancel of
        the task cost more than the rest of the wait, on every cached call.
        """
        if self.status.is_final or self.removed is not None:
            return self.status.is_final
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            self._notify()

        timer = None if timeout is None else asyncio.get_running_loop().call_later(timeout,
                                                                                  expire)
        try:
            while not (self.status.is_final or self.removed is not None or expired):
                await self._next_change()
        finally:
            if timer is not None:
                timer.cancel()
        return self.status.is_final


class FutureStore:
    """The live futures of this server, with TTL expiry and resource limits.

    Args:
      ttl_s: how long a future lives after it is created or finishes.
      max_live: most futures alive at once.
      max_device_bytes: most output bytes held (or promised) by live futures.
      owner_max_live, owner_max_device_bytes: the same for the futures of one owner
        (an API key); ``None`` for no such limit. A future without an owner (no
        auth) has only the store's limits.
      on_final: called with each future that reaches a final status (metrics).
      on_release: called with a future's outputs when it lets go of them (buffers on
        a runtime: ``RuntimePool.release``).
      on_change: called on every change of a future's state (the replicas' mirror,
        ``service.cluster``).
      id_prefix: starts every new id: the replica that holds the future
        (``service.cluster``), or "".
      clock: wall-clock seconds (injectable for tests).

    Attributes:
      held_elsewhere: ``owner -> (device bytes, arrays)`` that the owner holds through
        another protocol (its IFRT proxy sessions, ``service.ifrt``): they count against
        its quotas here, as its futures count against them there. Set once that
        service starts.
    """

    def __init__(self, *, ttl_s: float, max_live: int, max_device_bytes: int,
                 owner_max_live: int | None = None, owner_max_device_bytes: int | None = None,
                 on_final: Callable[[Future], None] | None = None,
                 on_release: Callable[[list[Any]], None] | None = None,
                 on_change: Callable[[Future], None] | None = None,
                 id_prefix: str = "", clock: Callable[[], float] = time.time) -> None:
        self.ttl_s = ttl_s
        self.max_live = max_live
        self.max_device_bytes = max_device_bytes
        self.owner_max_live = owner_max_live
        self.owner_max_device_bytes = owner_max_device_bytes
        self._clock = clock
        self._futures: dict[str, Future] = {}
        self.device_bytes = 0
        # Per owner: live futures, and the device bytes they hold (which a deleted
        # running future holds until it ends).
        self._live_of: collections.Counter[str | None] = collections.Counter()
        self._bytes_of: collections.Counter[str | None] = collections.Counter()
        self.on_final = on_final
        self.on_release = on_release
        self.on_change = on_change
        self.id_prefix = id_prefix
        # When futures expire, soonest first (``_Expiry``): all of them, and each
        # owner's, so that neither a sweep nor a 429's Retry-After walks the store.
        self._expiry = _Expiry(self._futures, self.__len__)
        self._expiry_of: dict[str, _Expiry] = {}
        # Running futures past their TTL: they expire once they end.
        self._overdue: dict[str, Future] = {}
        self.held_elsewhere: Callable[[str], tuple[int, int]] | None = None

    def create(self, *, owner: str | None, executable_id: str, out_avals: Sequence[Aval],
               out_tree: Any, compile_s: float = 0.0, compiling: bool = False,
               input_bytes: int = 0, out_bytes: Sequence[int] = ()) -> Future:
        """A new pending (or ``compiling``) future; ``TooManyRequests`` when a limit is reached.

        ``input_bytes``: the call's host arrays, which the server holds for it (in its
        memory, then a segment, then on the device) until the run ends: they count
        with its outputs against the device bytes, the server's and the owner's, from
        now on, so that calls queued behind others cannot hold unbounded memory.
        ``out_bytes``: the device bytes of each output where they are not its size (a
        sharded output's replicas each count).
        """
        sizes = tuple(out_bytes) or tuple(a.nbytes for a in out_avals)
        need = sum(sizes) + input_bytes
        if not self._fits(need, owner):
            self.sweep()  # expired futures may make room; sweeping every call would cost O(n)
        self._check_owner_limits(need, owner)
        self._check_limits(need)
        now = self._clock()
        fut = Future(self.id_prefix + secrets.token_urlsafe(24), owner, executable_id, tuple(out_avals),
                     out_tree, now, now + self.ttl_s, need, input_bytes,
                     out_bytes=tuple(out_bytes), timings=Timings(compile_s=compile_s))
        if compiling:
            fut.status = FutureStatus.COMPILING
        self._futures[fut.future_id] = fut
        self.device_bytes += need
        self._live_of[owner] += 1
        self._bytes_of[owner] += need
        self._expires(fut)
        self._changed(fut)
        return fut

    def _expires(self, fut: Future, at: float | None = None) -> None:
        """Note when ``fut`` expires: at ``expires_at``, or from now on at ``at``."""
        if at is not None:
            if at == fut.expires_at:
                return  # noted already
            fut.expires_at = at
        if fut.removed is not None:
            return  # out of the store: nothing expires it
        self._expiry.add(fut)
        owner = fut.owner
        if owner is not None:
            of = self._expiry_of.get(owner)
            if of is None:
                of = self._expiry_of[owner] = _Expiry(self._futures,
                                                      lambda: self._live_of[owner])
            of.add(fut)

    def live_of(self, owner: str | None) -> int:
        """How many live futures ``owner`` has."""
        return self._live_of[owner]

    def device_bytes_of(self, owner: str | None) -> int:
        """How many device bytes ``owner``'s futures hold (or are promised)."""
        return self._bytes_of[owner]

    def holders(self) -> list[tuple[str | None, int, int]]:
        """Who holds what: ``(owner, live futures, device bytes)`` of each owner holding
        either (the console's devices panel)."""
        return [(owner, self._live_of[owner], self._bytes_of[owner])
                for owner in self._live_of.keys() | self._bytes_of.keys()]

    def _elsewhere(self, owner: str) -> tuple[int, int]:
        return (0, 0) if self.held_elsewhere is None else self.held_elsewhere(owner)

    def _fits(self, need: int, owner: str | None) -> bool:
        if owner is not None and (self.owner_max_live is not None
                                  or self.owner_max_device_bytes is not None):
            other_bytes, other_arrays = self._elsewhere(owner)
            if ((self.owner_max_live is not None
                 and self._live_of[owner] + other_arrays >= self.owner_max_live)
                    or (self.owner_max_device_bytes is not None
                        and self._bytes_of[owner] + other_bytes + need
                        > self.owner_max_device_bytes)):
                return False
        return (len(self._futures) < self.max_live
                and self.device_bytes + need <= self.max_device_bytes)

    def _check_owner_limits(self, need: int, owner: str | None) -> None:
        if owner is None:
            return
        other_bytes, other_arrays = self._elsewhere(owner)
        live, held = self._live_of[owner] + other_arrays, self._bytes_of[owner] + other_bytes
        also = (f" (of which its IFRT sessions: {other_arrays:,} arrays, {other_bytes:,} bytes)"
                if other_arrays or other_bytes else "")
        cap = self.owner_max_device_bytes
        if cap is not None and need > cap:
            raise LimitExceeded(f"the call's outputs and inputs need {need:,} bytes of device "
                                f"memory, over this API key's quota of {cap:,} "
                                "(JITSERVE_TENANT_MAX_DEVICE_BYTES)")
        if self.owner_max_live is not None and live >= self.owner_max_live:
            raise QuotaExceeded(
                "live_futures", f"this API key has {live} live futures{also}, its quota "
                "(JITSERVE_TENANT_MAX_LIVE_FUTURES); fetch and DELETE finished ones",
                self._retry_after(owner))
        if cap is not None and held + need > cap:
            raise QuotaExceeded(
                "device_bytes", f"this API key holds {held:,} of its {cap:,} device bytes"
                f"{also} (JITSERVE_TENANT_MAX_DEVICE_BYTES) and this call needs {need:,}; "
                "DELETE futures you no longer need", self._retry_after(owner))

    def _check_limits(self, need: int) -> None:
        if need > self.max_device_bytes:
            raise LimitExceeded(f"the call's outputs and inputs need {need:,} bytes of device "
                                f"memory, over the server's limit of {self.max_device_bytes:,}")
        if len(self._futures) >= self.max_live:
            raise TooManyRequests(f"{len(self._futures)} futures are alive, the server's limit; "
                                  "fetch and DELETE finished ones", self._retry_after())
        if self.device_bytes + need > self.max_device_bytes:
            raise TooManyRequests(
                f"live futures hold {self.device_bytes:,} of {self.max_device_bytes:,} device "
                f"bytes and this call needs {need:,}; DELETE futures you no longer need",
                self._retry_after())

    def _retry_after(self, owner: str | None = None) -> float:
        # When the first future (of the owner, for its quota) expires, space frees up for sure.
        now = self._clock()
        expiry = self._expiry if owner is None else self._expiry_of.get(owner)
        soonest = now if expiry is None else expiry.soonest(default=now)
        if any(owner is None or f.owner == owner for f in self._overdue.values()):
            soonest = now  # one ends any moment, and expires then
        return min(max(soonest - now, 1.0), 60.0)

    def get(self, future_id: str, owner: str | None) -> Future:
        """The live future ``future_id`` of ``owner``; ``NotFound`` otherwise.

        Another owner's future is "not found" too, so ids cannot be probed.
        """
        fut = self._futures.get(future_id)
        if fut is not None and self._expired(fut, self._clock()):
            self._remove(fut, "expired")
            fut = None
        if fut is None or not same_owner(fut.owner, owner):
            raise NotFound(f"no future {future_id!r:.80} (unknown, expired or deleted)")
        return fut

    def compiled(self, fut: Future, executable_id: str, out_tree: Any, compile_s: float,
                 tier: str = "") -> None:
        """The executable is ready (from ``tier``): the future waits for its run."""
        if fut.status is FutureStatus.COMPILING:
            fut.executable_id = executable_id
            fut.tier = tier or fut.tier
            fut.out_tree = out_tree
            fut.timings.compile_s = compile_s
            fut.status = FutureStatus.PENDING
            fut._notify()
            self._changed(fut)

    def mark_running(self, fut: Future, queued_s: float) -> None:
        """The execution started."""
        if fut.status is FutureStatus.PENDING:
            fut.status = FutureStatus.RUNNING
            fut.timings.queued_s = queued_s
            fut._notify()
            self._changed(fut)

    def complete(self, fut: Future, outputs: list[Any], run_s: float) -> None:
        """The execution finished with ``outputs`` (device arrays)."""
        fut.timings.run_s = run_s
        if fut.timings.queued_s is None:  # a quick run says no ``started`` (runtimes/child.py)
            fut.timings.queued_s = max(self._clock() - fut.created - run_s, 0.0)
        fut.outputs = list(outputs)
        if fut.status.is_final:  # failed meanwhile (fail_all): nobody may read them
            self._settle(fut)
            return
        if fut.removed is None:
            self._expires(fut, self._clock() + self.ttl_s)
        self._finish(fut, FutureStatus.DONE)
        self._settle(fut)  # released or deleted meanwhile: nobody can fetch those

    def promise(self, fut: Future, outputs: list[Any]) -> None:
        """``fut``'s run was sent to its runtime: ``outputs`` are the buffers it will
        make there, under handles this process chose, which calls sent after it
        may read before it has run (``runtimes.protocol``: runs sent ahead). The
        future is not done: only such calls see them. Those released meanwhile
        (or all, if the future is gone) are freed at once; the runtime drops them
        as it makes them."""
        fut.outputs = list(outputs)
        self._settle(fut)

    def fail(self, fut: Future, code: str, message: str, **extra: Any) -> None:
        """The execution failed; the future keeps the error (``extra``: its other fields,
        such as the ``quota`` a refused compile ran into)."""
        fut.error = {"code": code, "message": message, **extra}
        self._expires(fut, self._clock() + self.ttl_s)
        self._finish(fut, FutureStatus.FAILED)
        self._settle(fut)

    def delete(self, fut: Future, *, stop: bool = True) -> tuple[FutureStatus, str | None]:
        """Cancel ``fut`` if it has not finished, free its outputs, and forget it.

        Returns its status, and, for a running one that could not be stopped, why.
        ``stop=False`` leaves a running execution alone (it is dropped when it ends).
        """
        detail = None
        if fut.status in _NOT_STARTED and fut.job is not None and fut.job.cancel():
            fut.error = {"code": "future_cancelled", "message": "deleted before it ran"}
            self._finish(fut, FutureStatus.CANCELLED)
        elif fut.status is FutureStatus.PENDING and fut.job is not None and fut.job.unqueue():
            fut.error = {"code": "future_cancelled", "message": "deleted while it waited to run"}
            self._finish(fut, FutureStatus.CANCELLED)
        elif stop and fut.status is FutureStatus.RUNNING and fut.job is not None:
            detail = fut.job.stop()
            if detail is None:
                fut.error = {"code": "future_cancelled", "message": "deleted while it ran"}
                self._finish(fut, FutureStatus.CANCELLED)
        self._remove(fut, "deleted")
        return fut.status, detail

    def fail_lost(self, runtime: Any, generation: int, why: str) -> int:
        """Fail the done futures whose outputs were on ``runtime``'s process ``generation``,
        which exited (``why``); returns how many. Their outputs are gone with it."""
        lost = [f for f in self._futures.values()
                if f.status is FutureStatus.DONE and f.outputs
                and any(getattr(b, "runtime", None) is runtime and b.generation == generation
                        for b in f.outputs)]
        for fut in lost:
            fut.outputs = fut.host = None  # nothing to free: the process that held them is gone
            fut.status = FutureStatus.FAILED
            fut.error = {"code": getattr(runtime, "last_exit_code", "runtime_crashed"),
                         "message": f"its outputs were lost: runtime {runtime.index} {why}"}
            self._settle(fut)
            fut._notify()
            self._changed(fut)
        return len(lost)

    def replica_lost(self, old: str, new: str) -> None:
        """The other replicas declared this one, ``old``, lost while it ran (Redis did not
        hear from it): its futures fail with ``replica_lost`` here as they do there, and
        new ones are named after ``new``, the id it rejoins under."""
        self.fail_all("replica_lost", f"replica {old}, which held this future, was "
                                      "declared lost (Redis did not hear from it)")
        self.id_prefix = f"{new}."

    def fail_all(self, code: str, message: str) -> int:
        """Fail every live future with ``code`` (its outputs freed); returns how many."""
        live = [f for f in self._futures.values() if f.status is not FutureStatus.FAILED]
        for fut in live:
            if fut.job is not None:
                fut.job.cancel()
            fut.error = {"code": code, "message": message}
            self._finish(fut, FutureStatus.FAILED)
            self._settle(fut)
        return len(live)

    def _finish(self, fut: Future, status: FutureStatus) -> None:
        fut.status = status
        fut.job = None
        if fut.input_bytes:  # the run is over: nothing holds its inputs any more
            self._unreserve(fut, fut.input_bytes)
            fut.input_bytes = 0
        fut._notify()
        self._changed(fut)
        if self.on_final is not None:
            self.on_final(fut)

    def _changed(self, fut: Future) -> None:
        if self.on_change is not None:
            self.on_change(fut)

    def release(self, refs: Sequence[tuple[str, int]], owner: str | None) -> tuple[int, int]:
        """Let go of outputs ``(future_id, index)`` of ``owner``'s futures.

        Returns how many were released and how many named nothing of ``owner``'s
        (unknown, expired, or released with their whole future): a client's
        garbage collector races expiry, so those are no error. A future whose
        outputs are all released leaves the store; one still compiling or
        running is not stopped (accepted calls may read it), and drops its
        released outputs when it ends.
        """
        released = unknown = 0
        touched: dict[str, tuple[Future, list[int]]] = {}
        for future_id, index in refs:
            fut = self._futures.get(future_id)
            if (fut is None or not same_owner(fut.owner, owner)
                    or not 0 <= index < len(fut.out_avals)):
                unknown += 1
                continue
            released += 1
            touched.setdefault(future_id, (fut, []))[1].append(index)
        for fut, indices in touched.values():  # each future settled once, for its outputs
            self.let_go(fut, indices)
        return released, unknown

    def let_go(self, fut: Future, indices: Sequence[int]) -> None:
        """``release`` of outputs ``indices`` of ``fut``, which its caller has looked up
        (``get``); nothing if it has left the store since."""
        if fut.removed is not None:
            return
        fut.released.update(indices)
        if len(fut.released) == len(fut.out_avals):
            self._remove(fut, "released")
        else:
            self._settle(fut, indices)

    def pin(self, fut: Future, indices: Iterable[int]) -> None:
        """An accepted call will read outputs ``indices`` of ``fut`` once it is done."""
        pins = fut.pins
        for index in indices:
            pins[index] += 1

    def unpin(self, fut: Future, indices: Iterable[int]) -> None:
        """That call has taken hold of those outputs (or will never need them)."""
        pins, free = fut.pins, []
        for index in indices:
            pins[index] -= 1
            if pins[index] <= 0:
                del pins[index]
                free.append(index)
        if free:
            self._settle(fut, free)

    def _remove(self, fut: Future, why: str) -> None:
        if self._futures.pop(fut.future_id, None) is not None:
            self._uncount(self._live_of, fut.owner, 1)
            if fut.owner is not None and fut.owner not in self._live_of:
                self._expiry_of.pop(fut.owner, None)
        if fut.removed is None:
            fut.removed = why
        self._settle(fut)  # one still to run settles when it ends
        fut._notify()
        self._changed(fut)

    def _settle(self, fut: Future, indices: Iterable[int] | None = None) -> None:
        """Free the outputs nobody may fetch any more (released, or the future left
        the store or failed) unless a queued call still needs them; a finished
        future that holds nothing more gives back the rest of its reservation.
        ``indices``: only those outputs changed (a release, an unpin), so only
        they are looked at: a call reading a model's 25 leaves settles once, not
        25 times over 25 outputs."""
        outputs = fut.outputs
        gone = fut.removed is not None or fut.status in (FutureStatus.FAILED,
                                                          FutureStatus.CANCELLED)
        released = fut.released
        if outputs is not None and (gone or released):  # else nothing to free
            pins, host, freed, nbytes = fut.pins, fut.host, [], 0
            for index in range(len(outputs)) if indices is None else indices:
                buf = outputs[index]
                if buf is not None and (gone or index in released) and not pins.get(index):
                    outputs[index] = None
                    if host is not None:
                        host[index] = None
                    nbytes += (fut.out_bytes[index] if fut.out_bytes
                               else fut.out_avals[index].nbytes)
                    freed.append(buf)
            if freed:
                self._unreserve(fut, nbytes)
                if self.on_release is not None:
                    self.on_release(freed)
        if outputs is not None and (not outputs or (outputs[0] is None
                                                    and all(b is None for b in outputs))):
            fut.outputs = fut.host = None
        if gone and fut.outputs is None and fut.status is not FutureStatus.RUNNING:
            self._unreserve(fut, fut.reserved_bytes)

    def _unreserve(self, fut: Future, nbytes: int) -> None:
        nbytes = min(nbytes, fut.reserved_bytes)
        self.device_bytes -= nbytes
        self._uncount(self._bytes_of, fut.owner, nbytes)
        fut.reserved_bytes -= nbytes

    @staticmethod
    def _uncount(counter: collections.Counter[str | None], owner: str | None, n: int) -> None:
        counter[owner] -= n
        if counter[owner] <= 0:
            del counter[owner]  # owners come and go: keep only those holding something

    def _expired(self, fut: Future, now: float) -> bool:
        # A running execution cannot be stopped; it gets a fresh TTL when it ends.
        return fut.expires_at <= now and fut.status is not FutureStatus.RUNNING

    def sweep(self) -> int:
        """Expire futures past their TTL; returns how many. It costs what it expires,
        not what is alive: a full store sweeps on every call (``create``)."""
        now = self._clock()
        stale: dict[str, Future] = {}
        for fut in self._expiry.due(now):
            if fut.status is FutureStatus.RUNNING:
                self._overdue[fut.future_id] = fut
            else:
                stale[fut.future_id] = fut
        for fid, fut in list(self._overdue.items()):
            if self._futures.get(fid) is not fut or fut.expires_at > now:
                del self._overdue[fid]  # gone, or ended with a fresh TTL (noted anew)
            elif fut.status is not FutureStatus.RUNNING:
                del self._overdue[fid]
                stale[fid] = fut
        for fut in stale.values():
            if fut.status in _NOT_STARTED and fut.job is not None and fut.job.cancel():
                fut.error = {"code": "future_expired", "message": "expired before it ran"}
                self._finish(fut, FutureStatus.CANCELLED)
            self._remove(fut, "expired")
        return len(stale)

    async def sweep_forever(self, interval_s: float) -> None:
        """Run ``sweep`` every ``interval_s`` seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.sweep()
            except Exception:  # a sweep bug must not stop expiry for good
                log.exception("future sweep failed")

    def counts(self) -> dict[str, int]:
        """How many live futures are in each status."""
        out = {s.value: 0 for s in FutureStatus}
        for fut in self._futures.values():
            out[fut.status.value] += 1
        return out

    def __len__(self) -> int:
        return len(self._futures)

    def live(self) -> list[Future]:
        """The live futures."""
        return list(self._futures.values())

    def busy(self) -> int:
        """How many live futures are still compiling, waiting or running."""
        return sum(not f.status.is_final for f in self._futures.values())

    def clear(self) -> None:
        """Cancel what has not started and forget every future (shutdown)."""
        for fut in list(self._futures.values()):
            self.delete(fut, stop=False)


_NOT_STARTED = (FutureStatus.COMPILING, FutureStatus.PENDING)


class _Expiry:
    """Futures by when they expire, soonest first: a heap of ``(expires_at, id)``.

    An entry is current while its future is in ``live`` with that ``expires_at``;
    a future that leaves the store or gets a new TTL leaves a stale entry behind,
    skipped when it comes up, and dropped in bulk when stale entries outnumber the
    rest (so the heap holds at most about twice what is alive).
    """

    def __init__(self, live: dict[str, Future], count: Callable[[], int]) -> None:
        self._live = live
        self._count = count  # how many futures this notes: at most one current entry each
        self._heap: list[tuple[float, str]] = []

    def add(self, fut: Future) -> None:
        heapq.heappush(self._heap, (fut.expires_at, fut.future_id))
        if len(self._heap) > 2 * self._count() + 64:
            self._heap = [e for e in self._heap if self._is_current(e)]
            heapq.heapify(self._heap)

    def soonest(self, default: float) -> float:
        """When the first future still noted here expires (``default`` if none)."""
        heap = self._heap
        while heap and not self._is_current(heap[0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else default

    def due(self, now: float) -> list[Future]:
        """Take out the futures whose ``expires_at`` has passed at ``now``."""
        heap, out = self._heap, []
        while heap and heap[0][0] <= now:
            entry = heapq.heappop(heap)
            if self._is_current(entry):
                out.append(self._live[entry[1]])
        return out

    def _is_current(self, entry: tuple[float, str]) -> bool:
        fut = self._live.get(entry[1])
        return fut is not None and fut.expires_at == entry[0]
