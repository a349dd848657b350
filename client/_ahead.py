"""Running ahead, as jax's asynchronous dispatch does (``Client(run_ahead=N)``, on by default).

A jitted call returns its ``RemoteArray`` s at once, without waiting for the server:
it is queued here, and a sender (a thread, ``RunAhead``; a task of the event loop,
``AsyncRunAhead``) sends what has queued in order as one ``POST /v1/calls`` while the
previous batch is answered, so a loop pays a round trip per batch, not per call. An
input that is an output of a call still queued goes as ``{"call": i, "output": k}``
when that call is in the same batch; an earlier batch has been answered before the
next is built, so its futures are known. A signature's first call waits for the
server to take it (``_jit``), so that what the server refuses in a program raises at
the call.

A call whose outputs are small (``wire.INLINE_OUTPUTS_BYTES``) is marked ``inline``:
the batch's answer waits up to ``Timeout.hold`` for it and carries its values, so
``np.asarray(f(x))`` costs one round trip, as without running ahead (the call's
``_Hold`` stops asking for a while when it keeps missing). So is a call whose small
output a reader already waits for when its batch is built (``float(loss)`` right
after a training step: ``_FutureState.awaited``): its answer waits for it as long
as a fetch would, and carries the small outputs that came back with the run beside
the big ones (``wire.carried_outputs``), so reading a step's loss costs no second
request (while several threads or tasks queue calls, it waits only the hold: the
sender sends nothing while a batch waits). A numpy input is copied when the call
is queued, so changing it afterwards does not change the call.

A call the server refuses (or that never reached it: the connection failed) raises
its error on the first use of its outputs: a fetch, a reference in a later call,
``block_until_ready``. A call that takes an output of a refused call is refused
here, naming it. A call refused because the server lost its program (a restart) is
sent again once, after the program is uploaded again. At most ``N`` calls are queued
or on their way: a loop faster than the server waits for room, so it cannot queue
unbounded work.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from jitserve import wire
from jitserve.client._base import _array_bytes
from jitserve.client._release import Ref
from jitserve.client._remote import _FutureState, _RemoteBase
from jitserve.client.errors import (
    APIError,
    FutureFailed,
    JitserveError,
    JitserveTimeout,
    PayloadTooLarge,
    ProtocolError,
    _raised_anew,
    error_class,
)

if TYPE_CHECKING:
    from jitserve.client._async import AsyncClient
    from jitserve.client._base import Op
    from jitserve.client._sync import Client

__all__ = ["AsyncRunAhead", "RunAhead", "Submit"]

log = logging.getLogger("jitserve.client")

_BATCH_MAX = 1024  # the server's most calls per POST /v1/calls
# Array bytes of one batch at first: a batch the server finds too big (413) goes back
# to the queue, and the batches after it carry half as much (a call alone may be as
# big as the server takes one execute).
_BATCH_BYTES = 8 << 20
# Outputs the answer of one batch may carry, in all: the inline calls are the last ones.
_INLINE_BYTES = 4 * wire.INLINE_OUTPUTS_BYTES
# Calls in a row from one thread or task, after another's, before a batch waits for
# a reader's run again (``_Batches._queued_by``).
_SHARED_CALLS = 64


class _TooBig(Exception):
    """The server refused a batch of several calls as too big: send less at once."""


@dataclasses.dataclass(eq=False)
class _Queued:
    """One call waiting to be sent: its program, arguments and the future it makes.

    ``hold``: the call's outputs are small, and its signature asks for them with the
    answer (``_jit._Hold``); ``upload``: uploads the program again, should the server
    have lost it; ``compiler_options``: the function's (``jax.jit``'s).
    """

    program_id: str
    args: list[Any]
    donate: list[int]
    state: _FutureState
    hold: Any = None
    upload: Callable[[], Op[None]] | None = None
    retried: bool = False
    compiler_options: dict[str, Any] | None = None


class Submit:
    """A jitted call to queue (``_jit``): its call, and the pytree of its outputs.

    The tree is handed out once the call is queued; the queue never holds it, so an
    output its user drops is released as any other.
    """

    __slots__ = ("queued", "tree")

    def __init__(self, queued: _Queued, tree: Any) -> None:
        self.queued: _Queued | None = queued
        self.tree = tree

    def to(self, ahead: RunAhead, timeout: float | None) -> Any:
        assert self.queued is not None
        ahead.submit(self.queued, timeout)
        return self._done()

    async def ato(self, ahead: AsyncRunAhead, timeout: float | None) -> Any:
        assert self.queued is not None
        await ahead.submit(self.queued, timeout)
        return self._done()

    def _done(self) -> Any:
        queued, tree = self.queued, self.tree
        assert queued is not None
        for n in queued.donate:
            queued.args[n]._release_here()  # the server releases it when the call starts
        self.queued = self.tree = None
        return tree


def _frozen(args: list[Any]) -> list[Any]:
    """A call's inputs as they are now (a writable numpy input is copied), as jax's
    dispatch takes them: changing one after the call does not change the call."""
    return [a.copy() if isinstance(a, np.ndarray) and a.flags.writeable else a for a in args]


class _Batches:
    """What both senders share: the queue, and a batch's request and answer (an ``Op``)."""

    def __init__(self, client: Client | AsyncClient, limit: int) -> None:
        self._client = client
        self.limit = limit
        self._queue: deque[_Queued] = deque()
        self._in_flight = 0  # calls in the batch being sent
        self._closed = False
        self._batch_bytes = _BATCH_BYTES
        # Who queued the last call (a thread, or a task of the loop), and how many more
        # calls must come from one caller before a batch waits for a reader again.
        self._caller: int | None = None
        self._shared = 0
        # Releases of dropped outputs that ride on the next batch (``_ride``), once
        # the server's answers say it takes them; those of the batch on its way.
        self.takes_release = False
        self._release_lock = threading.Lock()
        self._releases: list[Ref] = []
        self._riding: list[Ref] = []
        ride = weakref.WeakMethod(self._ride)
        client._releases.rider = lambda refs: (r := ride()) is not None and r(refs)

    def _ride(self, refs: list[Ref]) -> bool:
        """Take ``refs`` along with the next batch (from the ``ReleaseQueue``'s thread):
        only while the sender is busy (calls wait to go, or a batch is on its way, after
        whose answer ``_answered`` gives them back if no call waits)."""
        with self._release_lock:
            if not self.takes_release or self._closed or not (self._queue or self._in_flight):
                return False
            self._releases.extend(refs)
            return True

    def _give_back(self, refs: list[Ref] | None = None) -> None:
        """Releases that no batch took to the server go on their own: ``refs``, or
        those of the batch that did not reach it."""
        if refs is None:
            refs, self._riding = self._riding, []
        for future_id, output in refs:
            self._client._releases.put(future_id, output)

    def _queued_by(self, caller: int) -> None:
        """Note who queued a call. While several threads or tasks queue calls, a batch
        never waits long for the run a reader awaits (``_mark_inline``): the calls the
        others queue meanwhile would wait for that run too."""
        if caller != self._caller:
            self._shared = _SHARED_CALLS if self._caller is not None else 0
            self._caller = caller
        elif self._shared:
            self._shared -= 1

    def _full(self) -> bool:
        return len(self._queue) + self._in_flight >= self.limit

    def _too_long(self, timeout: float | None) -> JitserveTimeout:
        return JitserveTimeout(f"{self.limit} calls still on their way after {timeout} s "
                               "(run_ahead)")

    def _take(self) -> tuple[list[_Queued], int]:
        """The next batch, off the queue (at most ``_BATCH_MAX`` calls and, past its
        first call, ``_batch_bytes``), and its array bytes."""
        batch: list[_Queued] = []
        nbytes = 0
        with self._release_lock:  # releases ride only while calls are queued (``_ride``)
            while self._queue and len(batch) < _BATCH_MAX:
                size = _array_bytes(self._queue[0].args)
                if batch and nbytes + size > self._batch_bytes:
                    break
                batch.append(self._queue.popleft())
                nbytes += size
            self._riding, self._releases = self._releases, []
            self._in_flight = len(batch)
        return batch, nbytes

    def _answered(self, batch: list[_Queued], nbytes: int, outcome: BaseException | None,
                  again: set[_Queued]) -> None:
        """After a batch went (``outcome``: what it raised): what goes back to the front
        of the queue, and what fails."""
        if outcome is not None:  # what rode on it may not have reached the server
            self._give_back()
        else:
            self._riding = []
        if isinstance(outcome, _TooBig):  # nothing of it started: back, and smaller
            self._queue.extendleft(reversed([q for q in batch if not q.state.is_known()]))
            self._batch_bytes = max(1, nbytes // 2)
        elif outcome is not None:  # no call may wait forever for its answer
            if isinstance(outcome, Exception):
                log.error("the run-ahead sender failed a batch", exc_info=outcome)
            # Kept without its traceback, which holds this batch (``_raised_anew``).
            error = (_raised_anew(outcome) if isinstance(outcome, Exception) else
                     RuntimeError(f"the run-ahead sender stopped: {outcome!r}"))
            for queued in batch:
                if not queued.state.is_known():
                    queued.state.sent(None, error)
        if again:  # in their order, before anything queued since
            self._queue.extendleft(reversed([q for q in batch if q in again]))
        with self._release_lock:
            self._in_flight = 0
            idle = not self._queue  # no batch to take the releases waiting for one
            left, self._releases = (self._releases, []) if idle else ([], self._releases)
        self._give_back(left)

    def _op_send(self, batch: list[_Queued]) -> Op[set[_Queued]]:
        """Send ``batch`` and settle each call's future; the calls to send again."""
        calls: list[dict[str, Any] | None] = []
        position: dict[int, int] = {}  # a call of this batch -> its index in what is sent
        for queued in batch:
            try:
                args = [self._arg(a, position) for a in queued.args]
            except JitserveError as e:  # an input's call was refused: so is this one
                queued.state.sent(None, _refused_input(e, queued.state.name))
                calls.append(None)
                continue
            body: dict[str, Any] = {"program_id": queued.program_id, "args": args}
            if queued.donate:
                body["donate"] = queued.donate
            if queued.compiler_options:
                body["compiler_options"] = queued.compiler_options
            position[id(queued.state)] = len(position)
            calls.append(body)
        sent = [c for c in calls if c is not None]
        if not sent:
            self._give_back()
            self._drop_donated([q for q, c in zip(batch, calls) if c is None])
            return set()
        wait = self._mark_inline(batch, calls)
        try:
            entries, self.takes_release = yield from self._client._op_calls(
                sent, wait, self._riding)
        except JitserveError as e:  # never reached the server, or not understood: each call fails
            if isinstance(e, PayloadTooLarge) and len(sent) > 1:
                raise _TooBig() from e
            self._give_back()
            for queued, call in zip(batch, calls):
                if call is not None:
                    queued.state.sent(None, _named(e, queued.state.name))
            self._drop_donated(batch)
            return set()
        answered = [(q, c, e) for (q, c), e in zip(
            [(q, c) for q, c in zip(batch, calls) if c is not None], entries)]
        again = yield from self._op_lost([(q, e) for q, _, e in answered])
        refused = [q for q, c in zip(batch, calls) if c is None]
        for queued, call, entry in answered:
            if queued in again:
                continue
            if isinstance(entry, dict) and isinstance(entry.get("future_id"), str):
                # Before ``sent``: a reader waiting for them finds them.
                if "outputs" in entry:
                    queued.state.keep(self._client._outputs(entry), None)
                elif "carried" in entry:
                    queued.state.keep(*self._carried(entry["carried"], queued.state.n_outputs))
                if call.get("inline") and queued.hold is not None:
                    queued.hold.answered("outputs" in entry)
                queued.state.sent(entry["future_id"])
            else:
                queued.state.sent(None, _refusal(entry, queued.state.name))
                refused.append(queued)
        self._drop_donated(refused)
        return again

    def _drop_donated(self, refused: list[_Queued]) -> None:
        """The inputs refused calls donated go back to the server as garbage: the call
        took them when it was queued (``Submit``), as jax's dispatch deletes a donated
        array whatever becomes of its computation, and no run of it will release them
        (they stayed there until their TTL). After the batch's answer, so that an input
        from an accepted call of the same batch has its future by then."""
        for queued in refused:
            for n in queued.donate:
                a = queued.args[n]
                if isinstance(a, _RemoteBase) and a._future._id is not None:
                    self._client._releases.put(a._future._id, a.index)

    def _carried(self, carried: Any, n_outputs: int) -> tuple[list[np.ndarray], list[int]]:
        """The values and indices of an answer's ``carried`` outputs, checked."""
        which = carried.get("outputs") if isinstance(carried, dict) else None
        if not isinstance(which, list) or not all(
                type(k) is int and 0 <= k < n_outputs for k in which):
            raise ProtocolError(f"expected carried outputs below {n_outputs}, got {carried!r:.200}")
        values = self._client._outputs({"outputs": carried.get("values")})
        if len(values) != len(which):
            raise ProtocolError(f"{len(which)} carried outputs with {len(values)} values")
        return values, which

    def _mark_inline(self, batch: list[_Queued], calls: list[dict[str, Any] | None]) -> float | None:
        """Mark the calls whose answer should carry their outputs: those whose small
        output a reader waits for, and, the last ones first, those whose outputs are
        small (``_INLINE_BYTES`` in all); the wait to ask for, ``None`` for none.

        A reader waits for the run anyway, so its call's answer may wait as long as
        a fetch would (``Timeout.poll``), unless other threads or tasks queue calls
        too (``_queued_by``); the others' waits only ``Timeout.hold``."""
        timeout = self._client.timeout
        hold, room = timeout.hold, _INLINE_BYTES
        if not hold:
            return None
        wait: float | None = None
        for queued, call in zip(reversed(batch), reversed(calls)):
            if call is None:
                continue
            state = queued.state
            if state.awaited is not None and (state.nbytes is None or state.awaited in
                                              wire.carried_outputs(state.nbytes)):
                call["inline"] = True
                wait = max(wait or 0.0, hold if self._shared else timeout.poll)
                continue
            if queued.hold is None or room < 0:
                continue
            nbytes = sum(state.nbytes or ())
            if nbytes > room:
                room = -1  # the calls before it stay out: the last ones are read first
                continue
            if queued.hold.ask():
                call["inline"] = True
                wait = max(wait or 0.0, hold)
                room -= nbytes
        return wait

    def _op_lost(self, answered: list[tuple[_Queued, Any]]) -> Op[set[_Queued]]:
        """The calls of an answer to send again: those refused because the server lost
        their program (uploaded again here), and those refused for taking their outputs."""
        lost: set[str] = set()
        checked: set[str] = set()  # one look per program (a not_found may name an input)
        client = self._client
        for queued, entry in answered:
            if (queued.upload is not None and not queued.retried and _code(entry) == "not_found"
                    and queued.program_id not in checked):
                checked.add(queued.program_id)
                if (yield from client._op_get_program(queued.program_id)) is None:
                    client._forget_programs([queued.program_id])
                    yield from queued.upload()
                    lost.add(queued.program_id)
        if not lost:
            return set()
        again: set[_Queued] = set()
        states: set[int] = set()
        for queued, entry in answered:
            if _code(entry) is None:
                continue
            takes = any(isinstance(a, _RemoteBase) and id(a._future) in states for a in queued.args)
            if queued.program_id in lost or takes:
                queued.retried = True
                again.add(queued)
                states.add(id(queued.state))
        return again

    @staticmethod
    def _arg(a: Any, position: dict[int, int]) -> Any:
        """An argument on the wire: an array, a reference to a future, or to a call of
        this batch (``position``: each queued call's index in it)."""
        if not isinstance(a, _RemoteBase):
            return np.asarray(a)
        state = a._future
        if state._id is None:
            index = position.get(id(state))
            if index is not None:
                return {"call": index, "output": a.index}
            if state._sent is not None and not state._sent.is_set():  # never: queue order
                raise JitserveError(f"an input comes from a call of {state.name} not sent yet")
        return {"future": state.future_id, "output": a.index}  # raises a refused call's error


class RunAhead(_Batches):
    """The calls of one ``Client`` on their way to the server, and the thread that sends them."""

    def __init__(self, client: Client, limit: int) -> None:
        super().__init__(client, limit)
        self._sync = client
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> int:
        """Calls queued or on their way."""
        with self._cv:
            return len(self._queue) + self._in_flight

    def submit(self, queued: _Queued, timeout: float | None) -> None:
        """Queue a call (its future waits for the server's answer); waits while ``limit``
        calls are queued or on their way, at most ``timeout`` seconds."""
        queued.args = _frozen(queued.args)
        with self._cv:
            if self._closed:
                raise RuntimeError("the client is closed")
            if not self._cv.wait_for(lambda: not self._full() or self._closed, timeout):
                raise self._too_long(timeout)
            self._queue.append(queued)
            self._queued_by(threading.get_ident())
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="jitserve-run-ahead",
                                                daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued call was sent and answered; whether that happened."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._in_flight, timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Send what is queued, then stop the sender."""
        self.flush(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                batch, nbytes = self._take()
            outcome: BaseException | None = None
            again: set[_Queued] = set()
            try:
                again = self._sync._drive(self._op_send(batch))
            except BaseException as e:  # noqa: BLE001 - settled below, then raised if fatal
                outcome = e
            with self._cv:
                self._answered(batch, nbytes, outcome, again)
                self._cv.notify_all()
            del batch, again  # they hold the calls' inputs; the next wait may be long
            if outcome is not None and not isinstance(outcome, Exception):
                raise outcome


class AsyncRunAhead(_Batches):
    """The calls of one ``AsyncClient`` on their way, and the task of its loop that sends
    them. Their futures are waited for with ``_FutureState.settled()``, never by
    blocking the loop."""

    def __init__(self, client: AsyncClient, limit: int) -> None:
        super().__init__(client, limit)
        self._async = client
        self._cv: asyncio.Condition | None = None  # made in the loop, on first use
        self._task: asyncio.Task[None] | None = None

    @property
    def pending(self) -> int:
        """Calls queued or on their way."""
        return len(self._queue) + self._in_flight

    def _condition(self) -> asyncio.Condition:
        if self._cv is None:
            self._cv = asyncio.Condition()
        return self._cv

    async def submit(self, queued: _Queued, timeout: float | None) -> None:
        """Queue a call; waits while ``limit`` calls are queued or on their way, at most
        ``timeout`` seconds."""
        queued.args = _frozen(queued.args)
        queued.state.waitable()
        cv = self._condition()
        async with cv:
            if self._closed:
                raise RuntimeError("the client is closed")
            try:
                async with asyncio.timeout(timeout):
                    await cv.wait_for(lambda: not self._full() or self._closed)
            except TimeoutError:
                raise self._too_long(timeout) from None
            self._queue.append(queued)
            self._queued_by(id(asyncio.current_task()))
            if self._task is None or self._task.done():
                self._task = asyncio.get_running_loop().create_task(
                    self._run(), name="jitserve-run-ahead")
            cv.notify_all()

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued call was sent and answered; whether that happened."""
        cv = self._condition()
        try:
            async with asyncio.timeout(timeout), cv:
                await cv.wait_for(lambda: not self._queue and not self._in_flight)
        except TimeoutError:
            return False
        return True

    async def close(self, timeout: float | None = 30.0) -> None:
        """Send what is queued, then stop the sender."""
        await self.flush(timeout)
        cv = self._condition()
        async with cv:
            self._closed = True
            cv.notify_all()
        if self._task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), timeout)

    async def _run(self) -> None:
        cv = self._condition()
        while True:
            async with cv:
                await cv.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    return
                batch, nbytes = self._take()
            outcome: BaseException | None = None
            again: set[_Queued] = set()
            try:
                again = await self._async._drive(self._op_send(batch))
            except BaseException as e:  # noqa: BLE001 - settled below, then raised if fatal
                outcome = e
            async with cv:
                self._answered(batch, nbytes, outcome, again)
                cv.notify_all()
            del batch, again  # they hold the calls' inputs; the next wait may be long
            if outcome is not None and not isinstance(outcome, Exception):
                raise outcome


def _code(entry: Any) -> str | None:
    """A refused call's error code; ``None`` for a call that started."""
    error = entry.get("error") if isinstance(entry, dict) else None
    return str(error.get("code")) if isinstance(error, dict) else None



def _refused_input(e: JitserveError, name: str | None) -> FutureFailed:
    """The error of a call an input of which comes from a refused call (``e``, its
    error). It names the refusal that began the chain, as jax names the first error
    in a chain of asynchronous ones: nesting each link's message in the next made a
    loop that went on after a refusal build messages growing with every call."""
    # Kept without its traceback: it would keep the sender's frames, and the batch in them.
    root: JitserveError = getattr(e, "_jitserve_root", None) or e.with_traceback(None)
    error = FutureFailed(f"an input of this call of {name or 'a program'} comes from a call "
                         f"that was refused: {root}", status_code=422, code="future_failed")
    setattr(error, "_jitserve_root", root)  # noqa: B010 - private, on an error the SDK made
    return error


def _named(e: JitserveError, name: str) -> JitserveError:
    """``e`` (a batch's failure) as the error of one call of it, naming the call: the
    same class, so ``except ConnectError`` and the like still catch it."""
    message = f"call of {name or 'a program'}: {e.message}"
    try:
        named: JitserveError = (
            type(e)(message, status_code=e.status_code, code=e.code, details=e.details,
                    request=e.request) if isinstance(e, APIError)
            else type(e)(message, request=e.request))
    except TypeError:  # a class with another constructor: the error as it is
        return e.with_traceback(None)
    # The batch's error without its traceback, which would keep the sender's frames and
    # the batch in them (every call's input) for as long as a call's outputs live.
    named.__cause__ = _raised_anew(e)
    return named


def _refusal(entry: Any, name: str) -> APIError:
    """The error of a refused call's entry (``{"error": {"code", "message"}}``)."""
    error = entry.get("error") if isinstance(entry, dict) else None
    code = str(error.get("code", "internal")) if isinstance(error, dict) else "internal"
    message = str(error.get("message", "")) if isinstance(error, dict) else f"{entry!r:.200}"
    known = code in wire.ErrorCode.__members__.values()
    status = wire.ERROR_STATUS[wire.ErrorCode(code)] if known else 500
    cls = error_class(status, code)
    return cls(f"call of {name or 'a program'}: {message}", status_code=status, code=code,
               details={k: v for k, v in (error or {}).items() if k not in ("code", "message")})
