"""Sends executions to their runtimes and settles their futures.

``Executor.submit`` takes the runtime a call was placed on, the executable's
signature and the arguments: host arrays (numpy, decoded from the request),
buffers other futures left on a runtime (retained for the call), or references
to futures still running (pinned for it, ``service.calls``). The job owns those
holds and lets go of each when the run has read it, or when it ends however it
ends. ``submit`` returns at once; a task then waits for the referenced futures (on
the loop, no polling), marshals the arguments (big host arrays into one
shared-memory segment, buffers on the same runtime by handle, buffers on
another runtime fetched and sent on: a move, counted in metrics) and sends the
run. A run with nothing to wait for (no running input, no move, small host
arrays, room for its intermediates) is sent from ``submit`` itself and settled
by a callback on its answer, without a task: that is every cached call on small
arrays, for which the task and its awaits were a tenth of the API process's time.
The runtime reports ``started`` (the future turns ``running`` and its deadline
starts), then the output handles; the outputs stay on that runtime.

Cancel: a run not yet sent is dropped; one that is running is stopped (its
runtime killed and restarted) once every run that has started there has been
cancelled (``Runtime.stop_call``).

A run still queued on a runtime that is lost (killed for another run's deadline
or cancel, or crashed) never began: it is sent again (``_RESENDS`` times at most,
once after a crash, which it may have caused), to the runtime placement gives it
now, when its arguments do not name buffers of the lost process. Only runs that
were running there fail, each with the code that says why.

Device memory: a future reserves its declared outputs in the ``FutureStore``, but
a run also allocates intermediates (XLA's temp buffers: a loop's carry, say) that
no output shows. Their size is known before the run (``RemoteExecutable.memory``,
XLA's memory analysis). ``Executor.admit`` refuses, before any future exists, a
call whose intermediates and outputs exceed ``max_run_bytes``
(``JITSERVE_MAX_EXECUTION_BYTES``: 422 ``limit_exceeded``). While it runs, an
execution holds its temp bytes against the same device-bytes budget as the
futures' outputs (``TempBudget``); one that does not fit waits for running ones
to finish (one runs whenever none is running, so nothing waits for good).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool

from jitserve.compiler.errors import LimitExceeded
from jitserve.compiler.records import Program
from jitserve.wire import INLINE_OUTPUTS_BYTES, FutureStatus

from ..memory import SharedMemoryFull
from ..metrics import Metrics
from ..runtimes import (
    Buffer,
    NotStarted,
    Op,
    RemoteError,
    Runtime,
    RuntimeLost,
    RuntimePool,
    frames,
)
from ..runtimes.protocol import PutRequest, RunRequest
from .executables import CallOptions, RemoteExecutable
from .futures import Future, FutureStore

__all__ = ["ExecutionJob", "Executor", "FutureRef"]

log = logging.getLogger("jitserve.executor")


@dataclasses.dataclass(frozen=True)
class FutureRef:
    """Argument: output ``index`` of another ``future``, resolved when it is done."""

    future: Future
    index: int


Arg = np.ndarray | Buffer | FutureRef

# Codes a runtime's failure of a run keeps; anything else is "future_failed".
_RUN_CODES = frozenset({"execution_timeout", "runtime_crashed", "runtime_stopped",
                        "out_of_memory", "future_cancelled", "future_expired", "unavailable"})
# A run sent ahead whose input's run failed (``runtimes.protocol``): its future fails
# as one whose input future failed does, with the runtime's words, which name both.
_DEPENDENCY_FAILED = "dependency_failed"
# How often a run that never began is sent again when its runtime is stopped under it
# (by another's deadline or cancel); after a crash, once: a second loss says the run
# itself is the likely cause (its inputs' transfer, its load).
_RESENDS = 3


def run_error(e: RemoteError) -> tuple[str, str]:
    """The code and message a future fails with when its runtime failed its run."""
    if e.code == _DEPENDENCY_FAILED:
        return "future_failed", str(e)
    code = e.code if e.code in _RUN_CODES else "future_failed"
    return code, (str(e) if code != "future_failed" else f"execution failed: {e}")


class _Cancelled(Exception):
    """The job was cancelled before it was sent."""


class _DependencyFailed(Exception):
    def __init__(self, code: str, message: str, root: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.root = root


@dataclasses.dataclass(frozen=True)
class SplitPiece:
    """One call's share of a batched run: its output buffers, and their values when small."""

    buffers: list[Buffer]
    values: list[np.ndarray] | None


class ExecutionJob:
    """One execution: the handshake between cancel and send is under a lock."""

    def __init__(self, future: Future, runtime: Runtime, args: Sequence[Arg],
                 donate: Sequence[int] = ()) -> None:
        self.future = future
        self.runtime = runtime
        self.donate = frozenset(donate)
        self.args: list[Any] | None = list(args)
        # What the job holds until it ends: retained buffers, pinned references.
        self.held = [a for a in args if isinstance(a, Buffer)]
        self.waiting = [a for a in args if isinstance(a, FutureRef)]
        # The buffers its outputs will be, named when the run was sent (``_promise``).
        self.promised: list[Buffer] | None = None
        # Arguments that are buffers another run sent to the same runtime promised,
        # by position: the references they stand for (``Executor._send_ahead``).
        self.sources: dict[int, FutureRef] = {}
        # The buffers the run message being made gives up to the run (``_by_handle``);
        # marked ``given`` once it is sent (``Executor._sent``).
        self.giving: list[Buffer] = []
        # The buffers the run message names by handle (``_marshal``): handles of the
        # process that made them, which only that process may be sent.
        self.named: list[Buffer] = []
        self.task: asyncio.Task[None] | None = None
        self._lock = threading.Lock()
        self._started = False
        self._cancelled = False

    def cancel(self) -> bool:
        """Cancel if not sent yet; whether it was cancelled. Call on the event loop."""
        with self._lock:
            if self._started:
                return False
            self._cancelled = True
        self.args = None  # let go of the host arrays now
        if self.task is not None:
            self.task.cancel()
        return True

    def stop(self) -> str | None:
        """Stop a running execution; ``None`` if it was stopped, else why it cannot be."""
        if self.runtime.stop_call(self):
            return None
        others = self.runtime.running_besides(self)
        return (f"it keeps running: its runtime {self.runtime.index} has {others} other "
                "running execution(s) not cancelled, which stopping it would take down; "
                "it stops when they are cancelled too, or ends by itself or at its "
                "deadline, and its outputs are dropped")

    def unqueue(self) -> bool:
        """Take a run that was sent but waits in its runtime's queue out of it; whether
        the runtime was asked (it answers the run ``future_cancelled`` if it had not
        begun)."""
        return self._started and self.runtime.unqueue(self)

    @property
    def sent(self) -> bool:
        """Whether the run has been (or is being) sent to its runtime."""
        return self._started

    def unsent(self) -> None:
        """Its run was lost before it began, and goes again: until it is sent, a cancel
        drops it, as it would any run not sent yet."""
        with self._lock:
            self._started = False

    def start(self) -> None:
        """Claim the job for sending; ``_Cancelled`` if it was cancelled."""
        with self._lock:
            if self._cancelled:
                raise _Cancelled
            self._started = True


class TempBudget:
    """Device bytes of intermediates held by running executions.

    They share ``futures.max_device_bytes`` with the outputs that live futures hold
    (``futures.device_bytes``). ``hold`` waits until its bytes fit, or until no
    execution holds any (so one always runs). Call on the event loop.
    """

    def __init__(self, futures: FutureStore, metrics: Metrics) -> None:
        self.in_flight = 0
        self._futures = futures
        self._metrics = metrics
        self._changed = asyncio.Condition()
        self._waiting = 0  # holds waiting for room; none: no lock to take

    def _fits(self, nbytes: int) -> bool:
        used = self._futures.device_bytes + self.in_flight
        return self.in_flight == 0 or used + nbytes <= self._futures.max_device_bytes

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        """Count ``nbytes`` as in flight for the duration of the block."""
        if nbytes <= 0:
            yield
            return
        if not self.try_take(nbytes):  # the common case takes it: no lock round trip
            async with self._changed:
                self._waiting += 1
                try:
                    await self._changed.wait_for(lambda: self._fits(nbytes))
                finally:
                    self._waiting -= 1
                self._add(nbytes)
        try:
            yield
        finally:
            self._add(-nbytes)
            if self._waiting:
                await self._notify()

    def try_take(self, nbytes: int) -> bool:
        """Count ``nbytes`` as in flight if they fit now and nobody waits; else ``False``."""
        if nbytes <= 0:
            return True
        if self._waiting or not self._fits(nbytes):
            return False
        self._add(nbytes)
        return True

    def give(self, nbytes: int) -> None:
        """Give back what ``try_take`` counted, waking the holds that wait for room."""
        if nbytes <= 0:
            return
        self._add(-nbytes)
        if self._waiting:
            asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def _add(self, nbytes: int) -> None:
        self.in_flight += nbytes
        self._metrics.execution_temp_bytes.set(self.in_flight)


class Executor:
    """Sends runs to runtimes and settles their futures.

    Args:
      runtimes: the pool (for moves between runtimes, and segment names).
      futures: the store whose futures this settles.
      metrics: where execution counts and timings go.
      timeout_s: the longest a run may take (``JITSERVE_EXECUTION_TIMEOUT_S``).
      max_run_bytes: the most device bytes (intermediates and outputs) one run may
        allocate; ``None``: the futures' ``max_device_bytes``.
    """

    def __init__(self, runtimes: RuntimePool, futures: FutureStore, metrics: Metrics, *,
                 timeout_s: float, max_run_bytes: int | None = None) -> None:
        self.timeout_s = timeout_s
        self.max_run_bytes = max_run_bytes or futures.max_device_bytes
        self._runtimes = runtimes
        self._futures = futures
        self._metrics = metrics
        self._budget = TempBudget(futures, metrics)
        self._tasks: set[asyncio.Task[None]] = set()

    def admit(self, executable: RemoteExecutable) -> None:
        """Refuse a run that may never fit; call it before the run's future is created.

        ``LimitExceeded`` (422) when the intermediates and outputs of one run exceed
        ``max_run_bytes``: retrying cannot help. A run that fits the limit but not
        beside what others hold now waits for its turn (``TempBudget``).
        """
        mem = executable.memory  # None without a memory analysis: only outputs are counted
        why = mem.over(self.max_run_bytes) if mem is not None else None
        if why is not None:
            raise LimitExceeded(why)

    def submit(self, future: Future, runtime: Runtime, program: Program,
               executable: RemoteExecutable, options: CallOptions, args: Sequence[Arg],
               timeout_s: float | None = None) -> ExecutionJob:
        """Start running ``executable`` on ``args`` for ``future``; returns at once."""
        job = ExecutionJob(future, runtime, args, options.donate)
        future.job = job
        future.runtime = runtime
        timeout = min(timeout_s or self.timeout_s, self.timeout_s)
        try:
            self._send_ahead(job)
            if self._send_now(job, program, executable, options, timeout):
                return job
        except Exception as e:  # a bug here: the future still ends, and says so
            self._broken(future, e)
            self._let_go(job)
            return job
        self._spawn(job, self._run(job, program, executable, options, timeout))
        return job

    def _spawn(self, job: ExecutionJob, run: Coroutine[Any, Any, None]) -> None:
        """``job``'s run (``_run``) in a task of its own."""
        job.task = asyncio.get_running_loop().create_task(run)
        self._tasks.add(job.task)
        job.task.add_done_callback(self._tasks.discard)
        # A task cancelled before it starts never runs its ``finally``.
        job.task.add_done_callback(lambda _: self._let_go(job))

    def _send_ahead(self, job: ExecutionJob) -> None:
        """Take the outputs ``job`` reads of calls whose runs were already sent to its
        runtime as the buffers those runs promised: its run then goes at once, and
        the runtime runs it when they are made, with no round trip through this
        process between the two (``runtimes.protocol``: runs sent ahead)."""
        args, runtime = job.args, job.runtime
        assert args is not None
        if not job.waiting:
            return
        generation = runtime.live_generation
        taken: list[Buffer] = []
        refs: dict[int, tuple[Future, list[int]]] = {}
        for i, arg in enumerate(args):
            if type(arg) is FutureRef:
                outputs = arg.future.outputs
                buf = outputs[arg.index] if outputs is not None else None
                if buf is not None and buf.runtime is runtime and buf.generation == generation:
                    taken.append(buf)
                    args[i] = buf
                    job.sources[i] = arg
                    refs.setdefault(id(arg.future), (arg.future, []))[1].append(arg.index)
        if taken:
            self._runtimes.retain(taken)
            job.held.extend(taken)
            gone = {id(ref) for ref in job.sources.values()}
            job.waiting = [a for a in job.waiting if id(a) not in gone]
            for fut, indices in refs.values():
                self._futures.unpin(fut, indices)

    def _unsend(self, job: ExecutionJob) -> bool:
        """A run sent ahead that its runtime lost before it began: its promised inputs
        become the references they stood for again, so that it goes once the runs
        that make them have ended (sent again themselves, where they can be).
        Whether it can: no other input of it lived in the lost process, and each
        promised one is still to be had. One whose run had ended there, and that its
        caller let go of since (the run held it instead: ``_send_ahead``), went
        with the process."""
        args = job.args
        if not job.sources or args is None or any(
                isinstance(a, Buffer) and i not in job.sources and not a.alive
                for i, a in enumerate(args)) or any(
                ref.future.status is FutureStatus.DONE and (
                    ref.future.outputs is None or ref.future.outputs[ref.index] is None)
                for ref in job.sources.values()):
            return False
        refs = list(job.sources.values())
        for fut, indices in _by_future(refs).values():
            self._futures.pin(fut, indices)
        gone = [args[i] for i in job.sources]
        ids = {id(g) for g in gone}
        job.held = [b for b in job.held if id(b) not in ids]
        self._runtimes.release(gone)
        for i, ref in job.sources.items():
            args[i] = ref
        job.waiting.extend(refs)
        job.sources = {}
        job.unsent()
        return True

    def hold(self, args: Sequence[Arg]) -> None:
        """Keep the outputs ``args`` name until the run has read them (``drop`` undoes it)."""
        self._runtimes.retain([a for a in args if isinstance(a, Buffer)])
        for fut, indices in _by_future(args).values():
            self._futures.pin(fut, indices)

    def drop(self, args: Sequence[Arg]) -> None:
        """Let go of the holds a call took on ``args`` (it will not run)."""
        self._runtimes.release([a for a in args if isinstance(a, Buffer)])
        for fut, indices in _by_future(args).values():
            self._futures.unpin(fut, indices)

    def _let_go(self, job: ExecutionJob) -> None:
        held, waiting = job.held, job.waiting
        job.held, job.waiting = [], []
        self.drop([*held, *waiting])

    async def _run(self, job: ExecutionJob, program: Program, executable: RemoteExecutable,
                   options: CallOptions, timeout_s: float) -> None:
        fut, runtime = job.future, job.runtime
        memory = executable.memory
        segment = None
        answered = False  # whether the runtime is done with the segment
        try:
            await self._resolve(job)
            descs, segment = await self._marshal(job)
            message = _run_message(program, executable, options, descs)
            async with self._budget.hold(memory.temp_bytes if memory is not None else 0):
                job.start()
                reply = await self._request_run(job, message, timeout_s)
            runtime = job.runtime
            answered = True
        except (asyncio.CancelledError, _Cancelled):
            return  # the store already marked it cancelled
        except _DependencyFailed as e:
            self._futures.fail(fut, e.code, str(e), **_rooted(e.root))
        except RemoteError as e:
            answered = True
            self._failed(fut, e)
        except Exception as e:  # a bug here: the future still ends, and says so
            self._broken(fut, e)
        else:
            self._done(job, runtime, reply)
        finally:
            self._let_go(job)
            self._segment_done(segment, answered or not job.sent)

    async def _request_run(self, job: ExecutionJob, message: RunRequest,
                           timeout_s: float, resends: int = 0) -> dict[str, Any]:
        """Send ``job``'s run and wait for its answer; sent again, placed anew, while
        its runtime is lost before the run begins there (``NotStarted``)."""
        while True:
            try:
                runtime = job.runtime
                await runtime.wait_up()
                # Its process may have been lost since the message named its inputs'
                # handles: they were that process's, and went with it. The next one
                # never saw them, and may have its own under the same numbers.
                for buf in job.named:
                    if not buf.alive or buf.runtime is not runtime:
                        raise buf.lost()
                promised = self._promise(job, message)
                answer = runtime.send(Op.RUN, message, timeout_s=timeout_s, tag=job,
                                      on_started=self._on_started(job.future))
                self._sent(job, promised)
                return await answer
            except NotStarted as e:
                resends += 1
                if not self._may_resend(job, message, e, resends):
                    raise
                job.runtime = job.future.runtime = self._runtimes.replace(
                    job.future.owner, job.runtime, message["executable_id"])
                self._metrics.run_resent()
                log.info("run of future %s sent again to runtime %d: %s", job.future.future_id,
                         job.runtime.index, e)

    @staticmethod
    def _may_resend(job: ExecutionJob, message: RunRequest, e: NotStarted,
                    resends: int) -> bool:
        """Whether ``job``'s run, lost before it began, goes again: it is ``_wanted``,
        and ``_resendable``."""
        return _wanted(job) and _resendable(message, e, resends)

    def _send_now(self, job: ExecutionJob, program: Program, executable: RemoteExecutable,
                  options: CallOptions, timeout_s: float) -> bool:
        """Send the run from here, without a task, when nothing has to be awaited first:
        no future to wait for, no buffer to move, no segment, room for its
        intermediates, its runtime up. That is a cached call on small arrays, where
        the task, the awaits and the context managers of ``_run`` cost a tenth of
        the API process's time per call. Whether it was sent."""
        runtime = job.runtime
        assert job.args is not None
        if job.waiting:
            return False
        descs: list[dict[str, Any] | None] = []
        host: list[np.ndarray] = []
        job.giving = []
        generation = runtime.live_generation
        for i, arg in enumerate(job.args):
            if type(arg) is Buffer and arg.runtime is runtime and arg.generation == generation:
                descs.append(_by_handle(job, i, arg))
            elif isinstance(arg, np.ndarray):
                host.append(arg)
                descs.append(None)
            else:
                return False
        if sum(a.nbytes for a in host) >= frames.INLINE_MAX_BYTES:
            return False
        memory = executable.memory
        temp = memory.temp_bytes if memory is not None else 0
        if not self._budget.try_take(temp):
            return False
        # Arrays of SHARED_FROM_BYTES and more (a training step's batch) go in a
        # segment, given back once the runtime has answered (_answered, _resend).
        packed, segment = frames.pack_arrays(host, self._runtimes.segments,
                                             frames.SHARED_FROM_BYTES)
        it = iter(packed)
        message = _run_message(program, executable, options,
                               [d if d is not None else next(it) for d in descs])
        promised = self._promise(job, message)
        try:
            again = functools.partial(self._run, job, program, executable, options, timeout_s)
            runtime.send_then(Op.RUN, message,
                              lambda reply, error: self._answered(job, temp, message, timeout_s,
                                                                  reply, error, again, segment),
                              timeout_s=timeout_s, tag=job,
                              on_started=self._on_started(job.future))
        except RuntimeLost:  # restarting: the task waits for it
            self._budget.give(temp)
            self._segment_done(segment, True)
            return False
        except BaseException:
            self._budget.give(temp)
            self._segment_done(segment, False)  # it may have been sent
            raise
        job.start()  # nothing ran since the job was made: it cannot be cancelled yet
        if not job.sources:  # else kept, to go again should its runtime be lost (_unsend)
            job.args = None
        self._sent(job, promised)
        return True

    def _answered(self, job: ExecutionJob, temp: int, message: RunRequest, timeout_s: float,
                  reply: dict[str, Any] | None, error: BaseException | None,
                  again: Callable[[], Coroutine[Any, Any, None]],
                  segment: frames.Segment | None = None) -> None:
        """Settle the future of a run ``_send_now`` sent (or send it again, in a task,
        when its runtime was lost before it began: ``again`` is that task's, for a
        run sent ahead, which waits for its inputs first). ``segment``: the one that
        holds the run's big host inputs. Its runtime is done with it now: it has
        answered, or it has ended (``pool``'s supervisor fails a process's calls
        once it has exited). ``message`` sent again keeps it until that is answered."""
        fut = job.future
        if isinstance(error, NotStarted) and _wanted(job) and self._unsend(job):
            self._segment_done(segment, True)  # it goes again from its arguments, packed anew
            self._budget.give(temp)
            job.runtime = fut.runtime = self._runtimes.replace(fut.owner, job.runtime,
                                                              message["executable_id"])
            job.promised = None
            self._metrics.run_resent()
            self._spawn(job, again())
            return
        if isinstance(error, NotStarted) and self._may_resend(job, message, error, 1):
            self._budget.give(temp)
            job.runtime = fut.runtime = self._runtimes.replace(fut.owner, job.runtime,
                                                              message["executable_id"])
            self._metrics.run_resent()
            task = asyncio.get_running_loop().create_task(
                self._resend(job, temp, message, timeout_s, segment))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            return
        self._segment_done(segment, True)
        try:
            self._budget.give(temp)
            if error is not None:
                assert isinstance(error, RemoteError)
                self._failed(fut, error)
            else:
                assert reply is not None
                self._done(job, job.runtime, reply)
        except Exception as e:  # a bug here: the future still ends, and says so
            self._broken(fut, e)
        finally:
            self._let_go(job)

    async def _resend(self, job: ExecutionJob, temp: int, message: RunRequest,
                      timeout_s: float, segment: frames.Segment | None = None) -> None:
        """The rest of a ``_send_now`` run that its runtime lost before it began;
        ``segment`` holds its big host inputs (``_answered``)."""
        fut = job.future
        answered = False  # whether no runtime reads the segment any more
        try:
            async with self._budget.hold(temp):
                reply = await self._request_run(job, message, timeout_s, resends=1)
            answered = True
        except asyncio.CancelledError:
            if not fut.status.is_final:
                self._futures.fail(fut, "unavailable", "the server is shutting down")
            raise
        except RemoteError as e:
            answered = True
            self._failed(fut, e)
        except Exception as e:  # a bug here: the future still ends, and says so
            self._broken(fut, e)
        else:
            self._done(job, job.runtime, reply)
        finally:
            self._let_go(job)
            self._segment_done(segment, answered)

    def _segment_done(self, segment: frames.Segment | None, read: bool) -> None:
        """Done with ``segment``, which held a run's host inputs: back to the cache for
        the next message once no runtime reads it any more (``read``: it answered, or
        ended, or was never sent it), else unlinked and left to the runtime's mapping."""
        if segment is None:
            return
        if read:
            self._runtimes.segments.give_back(segment)
        else:
            segment.destroy()

    def _on_started(self, fut: Future) -> Callable[[], None]:
        """What a run's ``started`` does: ``fut`` turns running, its queue time kept."""
        return lambda: self._futures.mark_running(fut, max(time.time() - fut.created, 0.0))

    def _failed(self, fut: Future, e: RemoteError) -> None:
        """Fail ``fut`` for its runtime's failure of its run."""
        if not fut.status.is_final:  # a cancel that stopped it already said so
            code, message = run_error(e)
            root = None
            if e.root is not None:  # in the words its own future failed with
                root = dict(zip(("code", "message"),
                                run_error(RemoteError(e.root["code"], e.root["message"]))))
            self._futures.fail(fut, code, message, **_rooted(root))

    def _broken(self, fut: Future, e: Exception) -> None:
        """Fail ``fut`` for an error of the executor's own (logged: it is a bug), or for
        no room in shared memory for its arrays (the server's configuration)."""
        if isinstance(e, SharedMemoryFull):
            log.warning("a run failed: %s", e)
            if not fut.status.is_final:
                self._futures.fail(fut, "unavailable", str(e))
            return
        log.error("the executor failed a run unexpectedly", exc_info=e)
        if not fut.status.is_final:
            self._futures.fail(fut, "future_failed",
                               f"execution failed: internal error ({type(e).__name__})")

    def _promise(self, job: ExecutionJob, message: RunRequest) -> list[Buffer]:
        """Name the handles of the outputs of ``job``'s run in ``message`` (its ``out``):
        the buffers they will be on its runtime (``runtimes.protocol``: runs sent
        ahead). A stale generation (the runtime restarting meanwhile) only makes
        them dead: calls then wait for the run's answer instead."""
        runtime, avals = job.runtime, job.future.out_avals
        handles = runtime.promise(len(avals))
        message["out"] = handles
        return [Buffer(runtime, runtime.generation, h, a.nbytes) for h, a in zip(handles, avals)]

    def _sent(self, job: ExecutionJob, promised: list[Buffer]) -> None:
        """``job``'s run, which names ``promised``, was written to its runtime: calls
        placed there may read them from now on, before it has run."""
        job.promised = promised
        if promised:
            self._futures.promise(job.future, promised)
        for buf in job.giving:  # the runtime drops them with the run: no free to send
            buf.given = True
        job.giving = []

    def _done(self, job: ExecutionJob, runtime: Runtime, reply: dict[str, Any]) -> None:
        """Complete ``job``'s future with the outputs its run's answer names: those it
        promised when it was sent, but the ones freed since."""
        fut, promised = job.future, job.promised
        if (promised and promised[0].generation == reply["generation"]
                and reply["handles"] == [b.handle for b in promised]):
            outputs: list[Any] = (fut.outputs if fut.outputs is not None
                                  else [None] * len(promised))
        else:
            outputs = [Buffer(runtime, reply["generation"], h, a.nbytes)
                       for h, a in zip(reply["handles"], fut.out_avals)]
        # All on one runtime, of one generation: one tells whether they all live.
        dead = next((b for b in outputs if b is not None), None)
        if dead is not None and not dead.alive:  # its runtime died (or is stopping) since
            lost = dead.lost()
            self._futures.fail(fut, lost.code, str(lost))
            return
        run_s = float(reply["run_s"])
        if "values" in reply:  # the small ones (``wire.carried_outputs``), ``None`` elsewhere
            descs = reply["values"]
            values = iter(frames.unpack_arrays([d for d in descs if d is not None]))
            fut.host = [None if d is None else next(values) for d in descs]
        self._metrics.observe(self._metrics.execute_seconds, run_s)
        self._futures.complete(fut, outputs, run_s)

    async def run_split(self, runtime: Runtime, program: Program, executable: RemoteExecutable,
                        options: CallOptions, host: list[np.ndarray], rows: Sequence[int],
                        out_nbytes: Sequence[Sequence[int]], timeout_s: float | None,
                        on_started: Callable[[], None]) -> tuple[float, list[SplitPiece]]:
        """Run ``executable`` once on ``host``, whose leading rows are several calls'
        (``rows`` each, in order, then padding): a batch (``service.batching``).

        Every output is split along its leading axis on the runtime, so each call
        gets buffers of its own (``out_nbytes[i]``: call ``i``'s output sizes), with
        their values when small. Returns the run's seconds and the pieces, in order;
        raises ``RemoteError`` when the runtime fails the run.
        """
        memory = executable.memory
        timeout = min(timeout_s or self.timeout_s, self.timeout_s)
        descs, segment = await self._pack(host, frames.SHARED_FROM_BYTES)
        answered = False
        try:
            message: RunRequest = {**_run_message(program, executable, options, descs),
                                   "split": list(rows)}
            async with self._budget.hold(memory.temp_bytes if memory is not None else 0):
                resends = 0
                while True:
                    try:
                        reply = await runtime.request(Op.RUN, message, timeout_s=timeout,
                                                      on_started=on_started)
                        break
                    except NotStarted as e:  # queued there when it was lost: again, there
                        resends += 1
                        if not _resendable(message, e, resends):
                            answered = True
                            raise
                        self._metrics.run_resent()
                    except RemoteError:
                        answered = True
                        raise
            answered = True
        finally:
            self._segment_done(segment, answered)
        pieces = []
        for handles, values, sizes in zip(reply["handles"], reply["values"], out_nbytes):
            buffers = [Buffer(runtime, reply["generation"], h, n) for h, n in zip(handles, sizes)]
            host_values = None if values is None else frames.unpack_arrays(values)
            pieces.append(SplitPiece(buffers, host_values))
        run_s = float(reply["run_s"])
        self._metrics.observe(self._metrics.execute_seconds, run_s)
        return run_s, pieces

    async def put(self, future: Future, runtime: Runtime, arrays: list[np.ndarray]) -> None:
        """Keep ``arrays`` on ``runtime`` as the outputs of ``future`` (``POST /v1/arrays``);
        a ``RemoteError`` when the runtime cannot. A runtime lost before it answered
        (another's program crashed it, or its deadline stopped it) kept nothing that
        lives on: the put goes again, once, to the process that replaces it, as a run
        that never began does, rather than fail a caller whose arrays had no part in it."""
        future.runtime = runtime
        for again in (False, True):
            descs, segment = await self._pack(arrays)
            try:
                reply = await runtime.request(Op.PUT, PutRequest(args=descs),
                                              timeout_s=self.timeout_s)
                break
            except RuntimeLost:
                if again:
                    raise
            finally:
                self._segment_done(segment, True)  # read, or its reader is gone
        outputs = [Buffer(runtime, reply["generation"], h, a.nbytes)
                   for h, a in zip(reply["handles"], arrays)]
        if sum(a.nbytes for a in arrays) <= INLINE_OUTPUTS_BYTES:
            future.host = arrays  # small: fetches need no round trip
        self._futures.mark_running(future, 0.0)
        self._futures.complete(future, outputs, 0.0)

    async def _pack(self, host: list[np.ndarray], inline_max: int = frames.INLINE_MAX_BYTES
                    ) -> tuple[list[dict[str, Any]], frames.Segment | None]:
        """Descriptions of host arrays for a runtime: those of ``inline_max`` bytes and
        more in one shared segment (a run's from ``frames.SHARED_FROM_BYTES``)."""
        big = sum(a.nbytes for a in host) >= frames.INLINE_MAX_BYTES
        pack = frames.pack_arrays
        segments = self._runtimes.segments
        return (await run_in_threadpool(pack, host, segments, inline_max) if big
                else pack(host, segments, inline_max))

    async def _resolve(self, job: ExecutionJob) -> None:
        """Replace future references by the buffers they name, waiting if needed: for
        each future once, in order, then for all its outputs at once (a model's
        leaves come from one call)."""
        args = job.args
        assert args is not None
        for fut, indices in _by_future(args).values():
            await fut.wait_ended()
            positions = [i for i, a in enumerate(args)
                         if isinstance(a, FutureRef) and a.future is fut]
            bufs = [_output_of(args[i], i) for i in positions]
            self._runtimes.retain(bufs)
            job.held.extend(bufs)
            for i, buf in zip(positions, bufs):
                args[i] = buf
            job.waiting = [a for a in job.waiting if a.future is not fut]
            self._futures.unpin(fut, indices)

    async def _marshal(self, job: ExecutionJob) -> tuple[list[dict[str, Any]],
                                                          frames.Segment | None]:
        """The run's argument descriptions, and the segment that holds its big host arrays."""
        assert job.args is not None
        runtime = job.runtime
        descs: list[dict[str, Any] | None] = []
        host: list[np.ndarray] = []
        job.giving, job.named = [], []
        for i, arg in enumerate(job.args):
            if isinstance(arg, Buffer):
                if arg.runtime is runtime and arg.alive:
                    descs.append(_by_handle(job, i, arg))
                    job.named.append(arg)
                    continue
                try:
                    (arg,) = await self._runtimes.fetch([arg])  # noqa: PLW2901
                except RemoteError as e:
                    raise _DependencyFailed(e.code, f"args[{i}]: {e}") from None
                self._runtimes.moved(arg.nbytes)
            host.append(arg)
            descs.append(None)
        job.args = None
        packed, segment = await self._pack(host, frames.SHARED_FROM_BYTES)
        del host
        it = iter(packed)
        return [d if d is not None else next(it) for d in descs], segment

    async def close(self) -> None:
        """Cancel what is queued or running here, and wait for the tasks to end."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _run_message(program: Program, executable: RemoteExecutable, options: CallOptions,
                 descs: list[dict[str, Any]]) -> RunRequest:
    """The ``run`` request for ``executable`` on the arguments ``descs`` describe."""
    message: RunRequest = {
        "executable_id": executable.executable_id, "program_id": program.program_id,
        "static_key": options.static_key, "donate": list(options.donate),
        "avals": executable.in_avals_json, "args": descs}
    if options.scope:
        message["scope"] = options.scope
    if options.compiler_options:
        message["compiler_options"] = dict(options.compiler_options)
    return message


def _wanted(job: ExecutionJob) -> bool:
    """Whether ``job``'s run still has a caller: its future is not final, and its
    caller holds it, or accepted calls read its outputs even though its caller let go
    of them all: calls waiting for them here (pins), or calls sent ahead with them
    (holders of its promised buffers)."""
    fut = job.future
    if fut.status.is_final:
        return False
    return (fut.removed is None or bool(fut.pins)
            or any(b.refs > 0 for b in job.promised or ()))


def _resendable(message: RunRequest, e: NotStarted, resends: int) -> bool:
    """Whether a run its runtime lost before it began may go again, for the
    ``resends``-th time: its arguments are all in the message (none is a buffer the
    lost process held), and it was not resent too often."""
    if any("handle" in a for a in message["args"]):
        return False
    return resends <= (_RESENDS if e.code == "runtime_stopped" else 1)


def _rooted(root: Mapping[str, str] | None) -> dict[str, Any]:
    """A failed future's ``root`` field (``Future.failed_input``), where it has one."""
    return {} if root is None else {"root": dict(root)}


def _by_handle(job: ExecutionJob, position: int, buf: Buffer) -> dict[str, Any]:
    """Argument ``position`` of ``job`` as a buffer already on its runtime. A donated
    buffer that only this run holds is given up to it (the run consumes it); one
    that others hold is copied there."""
    if position in job.donate and buf.refs == 1:
        job.giving.append(buf)
        return {"handle": buf.handle, "give": True}
    return {"handle": buf.handle}


def _by_future(args: Sequence[Any]) -> dict[int, tuple[Future, list[int]]]:
    """The future references among ``args``, grouped by future in order of first use:
    ``id(future) -> (future, output indices)`` (an index twice if read twice)."""
    out: dict[int, tuple[Future, list[int]]] = {}
    for a in args:
        if isinstance(a, FutureRef):
            out.setdefault(id(a.future), (a.future, []))[1].append(a.index)
    return out


def _output_of(ref: FutureRef, position: int) -> Any:
    """The buffer ``ref`` names, or ``_DependencyFailed`` saying why there is none."""
    dep = ref.future
    where = f"args[{position}] refers to future {dep.future_id}"
    if dep.status is FutureStatus.DONE and dep.outputs is not None:
        buf = dep.outputs[ref.index]
        if buf is not None:
            return buf
    if dep.status is FutureStatus.FAILED:
        raise _DependencyFailed("future_failed", *dep.failed_input(where))
    if dep.status is FutureStatus.CANCELLED:
        raise _DependencyFailed("future_cancelled", f"{where}, which was cancelled")
    raise _DependencyFailed("future_expired", f"{where}, which was {dep.removed or 'removed'}")
