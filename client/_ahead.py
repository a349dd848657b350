"""Running ahead, as jax's asynchronous dispatch does (``Client(run_ahead=N)``).

A jitted call returns its ``RemoteArray`` s at once, without waiting for the server:
it is queued here, and a sender thread sends what has queued in order as one
``POST /v1/calls`` while the previous batch is answered, so a loop pays a round trip
per batch, not per call. An input that is an output of a call still queued goes as
``{"call": i, "output": k}`` when that call is in the same batch; an earlier batch
has been answered before the next is built, so its futures are known.

A call the server refuses (or that never reached it: the connection failed) raises
its error on the first use of its outputs: a fetch, a reference in a later call,
``block_until_ready``. A call that takes an output of a refused call is refused
here, naming it. At most ``N`` calls are queued or on their way: a loop faster than
the server waits for room, so it cannot queue unbounded work.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from jitserve import wire
from jitserve.client._base import _array_bytes
from jitserve.client._remote import _FutureState, _RemoteBase
from jitserve.client.errors import (
    APIError,
    FutureFailed,
    JitserveError,
    JitserveTimeout,
    PayloadTooLarge,
    error_class,
)

if TYPE_CHECKING:
    from jitserve.client._sync import Client

__all__ = ["RunAhead"]

log = logging.getLogger("jitserve.client")

_BATCH_MAX = 1024  # the server's most calls per POST /v1/calls
# Array bytes of one batch at first: a batch the server finds too big (413) goes back
# to the queue, and the batches after it carry half as much (a call alone may be as
# big as the server takes one execute).
_BATCH_BYTES = 8 << 20


class _TooBig(Exception):
    """The server refused a batch of several calls as too big: send less at once."""


@dataclasses.dataclass(eq=False)
class _Queued:
    """One call waiting to be sent: its program, arguments and the future it makes."""

    program_id: str
    args: list[Any]
    donate: list[int]
    state: _FutureState


class RunAhead:
    """The calls of one ``Client`` on their way to the server, and the thread that sends them."""

    def __init__(self, client: Client, limit: int) -> None:
        self._client = client
        self.limit = limit
        self._queue: deque[_Queued] = deque()
        self._cv = threading.Condition()
        self._in_flight = 0  # calls in the batch being sent
        self._closed = False
        self._thread: threading.Thread | None = None
        self._batch_bytes = _BATCH_BYTES

    @property
    def pending(self) -> int:
        """Calls queued or on their way."""
        with self._cv:
            return len(self._queue) + self._in_flight

    def submit(self, program_id: str, args: list[Any], donate: list[int], state: _FutureState,
               timeout: float | None) -> None:
        """Queue a call (its future ``state`` waits for the server's answer); waits while
        ``limit`` calls are queued or on their way, at most ``timeout`` seconds."""
        with self._cv:
            if self._closed:
                raise RuntimeError("the client is closed")
            if not self._cv.wait_for(lambda: len(self._queue) + self._in_flight < self.limit
                                     or self._closed, timeout):
                raise JitserveTimeout(f"{self.limit} calls still on their way after {timeout} s "
                                      "(run_ahead)")
            self._queue.append(_Queued(program_id, args, donate, state))
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

    # -- the sender -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._closed)
                if not self._queue:
                    return
                batch: list[_Queued] = []
                nbytes = 0
                while self._queue and len(batch) < _BATCH_MAX:
                    size = _array_bytes(self._queue[0].args)
                    if batch and nbytes + size > self._batch_bytes:
                        break
                    batch.append(self._queue.popleft())
                    nbytes += size
                self._in_flight = len(batch)
            try:
                self._send(batch)
            except _TooBig:
                with self._cv:  # nothing of it started: back to the front, smaller
                    self._queue.extendleft(reversed([q for q in batch if not _settled(q.state)]))
                    self._batch_bytes = max(1, nbytes // 2)
            except BaseException as e:  # noqa: BLE001 - no call may wait forever for its answer
                for queued in batch:
                    if not _settled(queued.state):
                        queued.state.sent(None, e if isinstance(e, Exception) else
                                          RuntimeError(f"the run-ahead sender stopped: {e!r}"))
                if not isinstance(e, Exception):
                    raise
                log.exception("the run-ahead sender failed a batch")
            finally:
                with self._cv:
                    self._in_flight = 0
                    self._cv.notify_all()

    def _send(self, batch: list[_Queued]) -> None:
        calls: list[dict[str, Any] | None] = []
        position: dict[int, int] = {}  # a call of this batch -> its index in what is sent
        for queued in batch:
            try:
                args = [self._arg(a, position) for a in queued.args]
            except JitserveError as e:  # an input's call was refused: so is this one
                queued.state.sent(None, FutureFailed(
                    f"an input of this call of {queued.state.name or 'a program'} comes from "
                    f"a call that was refused: {e}", status_code=422, code="future_failed"))
                calls.append(None)
                continue
            body: dict[str, Any] = {"program_id": queued.program_id, "args": args}
            if queued.donate:
                body["donate"] = queued.donate
            position[id(queued.state)] = len(position)
            calls.append(body)
        sent = [c for c in calls if c is not None]
        if not sent:
            return
        try:
            entries = self._client._drive(self._client._op_calls(sent))
        except JitserveError as e:  # never reached the server, or not understood: each call fails
            if isinstance(e, PayloadTooLarge) and len(sent) > 1:
                raise _TooBig() from e
            for queued, call in zip(batch, calls):
                if call is not None:
                    queued.state.sent(None, _named(e, queued.state.name))
            return
        answers = iter(entries)
        for queued, call in zip(batch, calls):
            if call is None:
                continue
            entry = next(answers)
            if isinstance(entry, dict) and isinstance(entry.get("future_id"), str):
                queued.state.sent(entry["future_id"])
            else:
                queued.state.sent(None, _refusal(entry, queued.state.name))

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


def _settled(state: _FutureState) -> bool:
    return state._sent is not None and state._sent.is_set()


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
        return e
    named.__cause__ = e
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
