"""Runtime processes, supervised from the API process.

``RuntimePool`` starts ``count`` runtimes (``service.runtimes.child``), places
callers on them, and sends them requests; ``Runtime`` is one of them. Each
runtime has a supervisor thread that spawns it, reads its replies, and, when it
exits for any reason, fails every request it had in flight with a code that says
why, tells the pool's listeners which outputs were lost with it, and starts it
again. A runtime that dies before it is ready backs off (0.5 s, doubling, at
most 30 s) and its state says so (``/readyz``).

Deadlines: a run's deadline starts when the runtime reports it ``started``; a
watchdog thread kills a runtime with a run past its deadline. That run fails
with ``execution_timeout``; other runs that had started there fail with
``runtime_stopped`` (``runtime_crashed`` is for a process that died by itself),
saying why the runtime was restarted. Runs that were only queued there had not
begun: they fail with ``NotStarted``, which their sender may send again
(``calls.executor``). Requests other than runs (decode, lookup) have a deadline
from when they are sent.

Cancel (``stop_call``): a running execution is stopped by killing its runtime,
once every run that has started there has been cancelled.

Replies are read on the event loop that serves the pool's callers when the pool
is started with one (``start(loop)``: an app's own pool), and otherwise by each
runtime's supervisor thread. Either way a reply is handed to the loop its request
came from, so one pool can serve several apps (the tests share one). On the loop,
a reply costs one wake-up of it; from a thread it also cost the thread's wake-up,
its hand-off to the loop and two passes of the GIL (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import fcntl
import functools
import itertools
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from . import frames
from .devices import Group
from .pipes import LoopReader, PipeWriter
from .protocol import EXIT_OUT_OF_MEMORY, Config, DecodeAnswer, FetchRequest, Kind, Op, Root

__all__ = ["Buffer", "NotStarted", "RemoteError", "Runtime", "RuntimeLost", "RuntimePool"]

log = logging.getLogger("jitserve.runtimes")

_READY_TIMEOUT_S = 120.0
_WATCH_INTERVAL_S = 0.05
_KILL_GRACE_S = 0.5  # after the first late run, before the kill (check_deadlines)
_MAX_BACKOFF_S = 30.0
_EXIT_GRACE_S = 2.0  # for a process whose pipe closed while it started, to exit itself
# Frees of small buffers wait this long for a request to the runtime to ride on
# (send_free); bigger ones, or this many handles, go at once.
_FREE_AFTER_S = 0.02
_FREE_NOW_BYTES = 1 << 20
_FREE_MAX_HELD = 1024
# Bound once: looking a member up on its enum costs 0.1 us in Python 3.11, and every
# request and reply compares one.
_RUN, _STARTED, _OK = Op.RUN, Kind.STARTED, Kind.OK



def _widen(fd: int) -> None:
    """Let pipe ``fd`` hold ``frames.INLINE_MAX_BYTES`` (where the system allows), so a
    message with inline arrays (those under it: a training batch) goes in one write,
    not through ``PipeWriter``'s thread. Linux's default holds 64 KiB."""
    with contextlib.suppress(OSError, AttributeError):  # over pipe-max-size; not Linux
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, frames.INLINE_MAX_BYTES)


class RemoteError(Exception):
    """A runtime refused or failed a request; ``code`` is the error code it gave, and
    ``root`` the failure that began a chain of runs (``protocol.Failure``)."""

    def __init__(self, code: str, message: str, root: Root | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.root = root


class RuntimeLost(RemoteError):
    """The runtime exited (or was stopped) before it answered."""


class NotStarted(RuntimeLost):
    """The runtime was lost while a run waited there, before it began: nothing of it
    ran, and it may be sent again (``code``: what it fails with if it is not)."""


# Why the supervisor killed a runtime, when it did so on purpose: the requests in
# flight there were stopped with it (``runtime_stopped``), not crashed.
_DELIBERATE = frozenset({"timeout", "request_timeout", "cancel"})
# How many of a runtime's process exits ``Runtime.lost`` remembers.
_EXITS_KEPT = 16
# Counters of a runtime's ``stats`` that ``report`` sums over every process there has
# been, so that they stay monotonic across restarts.
_SUMMED = ("relaid", "runs_waited")


@dataclasses.dataclass(eq=False)
class Buffer:
    """An output that lives on a runtime, under ``handle``, until it is freed."""

    runtime: Runtime
    generation: int
    handle: int
    nbytes: int
    refs: int = 1  # the future that holds it, and the runs about to read it
    # Given up to a run that consumes it (a donation nobody else held): its runtime
    # drops it with that run, whatever the run's end, so no free is sent for it.
    given: bool = False

    @property
    def alive(self) -> bool:
        """Whether the runtime that holds it is still the process that made it."""
        return self.runtime.live_generation == self.generation

    def lost(self) -> RuntimeLost:
        """Why it is gone, once not ``alive``: how the process that held it ended."""
        return self.runtime.lost(self.generation)


@dataclasses.dataclass(eq=False)
class _Call:
    op: Op
    loop: asyncio.AbstractEventLoop
    settle: Callable[[dict[str, Any] | None, BaseException | None], None]  # on ``loop``
    timeout_s: float | None
    on_started: Callable[[], None] | None
    tag: object = None
    deadline: float | None = None
    stop: str | None = None  # "timeout" | "cancel": why this call's runtime was killed
    started: bool = False  # a run the runtime said ``started`` for


def _start_failure(process: subprocess.Popen[bytes], e: BaseException) -> str:
    """Why a process whose pipe failed (``e``) before it was ready did not start: how
    it exited, when it did so itself (its pipe closed as it died: a moment is given
    for that), else what failed of the pipe; it is killed then."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(_EXIT_GRACE_S if isinstance(e, EOFError) else 0)
    code = process.poll()
    if code is not None:
        return f"{_exit_reason(code, None)} while starting"
    process.kill()
    process.wait()
    return f"its pipe failed while starting ({type(e).__name__}: {e}); killed"


def _settle(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


def _post(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any,
          here: asyncio.AbstractEventLoop | None = None) -> None:
    """``fn(*args)`` on ``loop``: at once from ``here``, the loop running this code
    (a ``call_soon`` cost each answer a turn of the loop, 3-6% of a cached call's
    time: docs/performance.md), with an error logged rather than raised into the
    reader; from another thread with ``call_soon_threadsafe``, which also wakes it
    (nothing if that loop has closed)."""
    if loop is here:
        try:
            fn(*args)
        except Exception:
            log.exception("settling a runtime's answer failed")
        return
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


class Runtime:
    """One supervised runtime process (restarted whenever it exits).

    Attributes:
      index: its place in the pool.
      state: ``starting``, ``up``, ``restarting``, ``backoff`` or ``stopped``.
      generation: counts its processes; a ``Buffer`` is valid in one generation only.
      pid: the current process's id (``None`` while none runs).
      info: the current process's ready message (``protocol.Ready``: backend, device).
    """

    def __init__(self, index: int, pool: RuntimePool, group: Group | None = None) -> None:
        self.index = index
        self.group = group or Group(0, (0,))  # the devices it runs programs on
        self.state = "starting"
        self.generation = 0
        self.pid: int | None = None
        self.info: dict[str, Any] = {}
        self.restarts = 0
        self.start_failures = 0
        self.last_exit: str | None = None
        self.last_exit_code = "runtime_crashed"  # or "runtime_stopped": killed on purpose
        # How the last few processes ended, by generation: (why, code), for ``lost``.
        self._exits: collections.OrderedDict[int, tuple[str, str]] = collections.OrderedDict()
        self.runs = 0  # runs in flight here (queued or running): placement's load
        self.backoff_until = 0.0
        self._pool = pool
        self._lock = threading.Lock()
        self._pending: dict[int, _Call] = {}
        self._frees: list[int] = []  # handles of this generation to free (send_free)
        self._frees_loop: asyncio.AbstractEventLoop | None = None  # where _send_frees is due
        self._ids = itertools.count(1)
        self._promises = itertools.count(-1, -1)  # output handles named here (``promise``)
        self._up = threading.Event()
        self._process: subprocess.Popen[bytes] | None = None
        self._pipe: frames.Pipe | None = None
        self._writer: PipeWriter | None = None  # the current pipe's requests
        self._kill_reason: str | None = None
        self._kill_at: float | None = None
        self._late_op = Op.RUN
        self._thread = threading.Thread(target=self._supervise, daemon=True,
                                        name=f"jitserve-runtime-{index}")

    @property
    def live_generation(self) -> int | None:
        """The generation whose buffers are ``alive`` now (``None`` while not up)."""
        return self.generation if self.state == "up" else None

    # -- requests ----------------------------------------------------------------

    async def request(self, op: Op, message: Mapping[str, Any], *,
                      timeout_s: float | None = None, tag: object = None,
                      on_started: Callable[[], None] | None = None,
                      retry: bool = False, generation: int | None = None) -> dict[str, Any]:
        """Send one request and wait for its answer.

        Raises ``RemoteError`` with the runtime's code when it refuses or fails it,
        and ``RuntimeLost`` when the runtime exits first (or is not up in time).
        ``timeout_s`` bounds a run from its start, any other request from now.
        ``retry``: the request may be sent twice (it changes nothing a second send
        would not); sent again once to the next process when the runtime is lost
        under it for another reason than its own deadline, since the crash may
        have been another request's doing. A request that loses its runtime twice
        is most likely the cause, and gets the ``RuntimeLost``. ``generation``: the
        process whose handles the message names; if another is up by the time it
        would be sent, the ``RuntimeLost`` of that one instead (the handles went
        with it, and the next process may have its own under the same numbers).
        """
        if not retry:
            return await self._request(op, message, timeout_s, tag, on_started, generation)
        try:
            return await self._request(op, message, timeout_s, tag, on_started, generation)
        except RuntimeLost as e:
            if e.code == "execution_timeout" or self._pool.closing:
                raise
        return await self._request(op, message, timeout_s, tag, on_started, generation)

    async def _request(self, op: Op, message: Mapping[str, Any],
                       timeout_s: float | None, tag: object,
                       on_started: Callable[[], None] | None,
                       generation: int | None = None) -> dict[str, Any]:
        await self.wait_up()
        if generation is not None and self.live_generation != generation:
            raise self.lost(generation)
        return await self.send(op, message, timeout_s=timeout_s, tag=tag, on_started=on_started)

    async def decode(self, data: bytes | bytearray, format: str | None, *,
                     timeout_s: float | None = None) -> DecodeAnswer:
        """Have this runtime decode, validate and store the program ``data`` (``Op.DECODE``).

        A big program crosses in a segment of the pool's, as arrays do (``frames``):
        through the pipe it cost three copies here (the message, its frame, the
        writer's queue) and two in the runtime, each as big as the program, and what
        the allocators kept of them stayed in both processes (docs/runtimes.md).
        """
        array = np.frombuffer(data, np.uint8)
        (desc,), segment = frames.pack_arrays([array], self._pool.segments)
        asked = asyncio.ensure_future(self.request(
            Op.DECODE, {"program": desc, "format": format}, timeout_s=timeout_s, retry=True))
        if segment is not None:  # the runtime reads it until it answers
            asked.add_done_callback(lambda _: self._pool.segments.give_back(segment))
        reply: Any = await asyncio.shield(asked)
        return reply

    def promise(self, n: int) -> list[int]:
        """``n`` handles for the outputs of a run about to be sent (its ``out``), which
        runs sent after it may name before it has run (``protocol``: runs sent
        ahead). Negative: the runtime's own handles are positive."""
        return [next(self._promises) for _ in range(n)]

    def send(self, op: Op, message: Mapping[str, Any], *, timeout_s: float | None = None,
             tag: object = None, on_started: Callable[[], None] | None = None
             ) -> asyncio.Future[dict[str, Any]]:
        """Send one request now, from the event loop; its answer is the future's result
        (or its ``RemoteError``). ``RuntimeLost`` at once if the runtime is not up:
        ``request`` is the call that waits for it. Never retried."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.send_then(op, message, functools.partial(_settle, future), timeout_s=timeout_s,
                       tag=tag, on_started=on_started)
        return future

    def send_then(self, op: Op, message: Mapping[str, Any],
                  on_answer: Callable[[dict[str, Any] | None, BaseException | None], None], *,
                  timeout_s: float | None = None, tag: object = None,
                  on_started: Callable[[], None] | None = None) -> None:
        """``send``, where the answer is ``on_answer(reply, None)`` (or ``(None,
        error)``), called on this event loop as it is read: a future's done callback
        would run a turn of the loop later."""
        self._send(_Call(op, asyncio.get_running_loop(), on_answer, timeout_s, on_started,
                         tag), message)

    def _send(self, call: _Call, message: Mapping[str, Any]) -> None:
        op, timeout_s = call.op, call.timeout_s
        if timeout_s is not None and op != _RUN:
            call.deadline = time.monotonic() + timeout_s
        with self._lock:
            if self.state != "up" or self._pipe is None:
                raise NotStarted("runtime_crashed", f"runtime {self.index} is restarting; retry")
            generation = self.generation
            rid = next(self._ids)
            self._pending[rid] = call
            if op == _RUN:
                self.runs += 1
            writer = self._writer
            frees, self._frees = self._frees, []
            self._frees_loop = None  # if it fires, it finds none
        if frees:
            message = {**message, "free": frees}
        try:
            assert writer is not None
            writer.write(frames.pack({"id": rid, "op": op, **message}))
        except (OSError, ValueError):
            # The process is gone (its pipe closed) and its supervisor has not seen it
            # yet: nothing of the request reached it, so it may go again, once the
            # next process is up, which ``wait_up`` now waits for.
            with self._lock:
                if self._pending.pop(rid, None) is not None and op == _RUN:
                    self.runs -= 1
                if self.generation == generation and self._writer is writer:
                    self._up.clear()
            raise NotStarted("runtime_crashed",
                             f"runtime {self.index} exited before it took the request") from None

    def send_free(self, handles: Sequence[int], generation: int, nbytes: int = 0) -> None:
        """Let go of buffers (``nbytes`` in all); no answer. Ignored if the runtime has
        restarted since.

        Small ones are freed with the next request to the runtime, or after
        ``_FREE_AFTER_S`` if none comes: a message of their own cost a write and a
        wake-up of the runtime per call (``keep=false``, or a DELETE). Big ones, and
        frees from outside an event loop, are sent at once.
        """
        if not handles:
            return
        try:
            loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            if self.generation != generation or self.state != "up":
                return
            self._frees.extend(handles)
            if loop is not None and nbytes < _FREE_NOW_BYTES and len(self._frees) < _FREE_MAX_HELD:
                if self._frees_loop is None or self._frees_loop.is_closed():  # no timer set
                    loop.call_later(_FREE_AFTER_S, self._send_frees)
                    self._frees_loop = loop
                return
        self._send_frees()

    def _send_frees(self) -> None:
        """Send the frees no request took along. (A timer that finds none is harmless.)"""
        with self._lock:
            self._frees_loop = None
            handles, self._frees = self._frees, []
            writer = self._writer if self.state == "up" else None
        if writer is None or not handles:
            return
        with contextlib.suppress(OSError, ValueError):
            writer.write(frames.pack({"op": Op.FREE, "handles": handles}))

    async def wait_up(self, timeout_s: float = _READY_TIMEOUT_S) -> None:
        """Wait until the runtime is up; ``RuntimeLost`` (503-worthy) when it is not in time."""
        if self._up.is_set():
            return
        deadline = time.monotonic() + timeout_s
        while not self._up.is_set():
            if self.state == "stopped" or time.monotonic() > deadline:
                raise RuntimeLost("unavailable", f"runtime {self.index} is not running "
                                  f"({self.state}; last exit: {self.last_exit or 'none'})")
            await asyncio.sleep(0.02)

    def in_flight(self) -> list[_Call]:
        with self._lock:
            return list(self._pending.values())

    def stop_call(self, tag: object) -> bool:
        """Cancel the run sent with ``tag``; whether it is stopped now.

        A running program cannot be interrupted: the runtime is killed (and
        restarted), once every run that has started there has been cancelled.
        Until then the run is marked, and the last cancel of them stops them all.
        Runs only queued there are sent again (``NotStarted``); other requests fail
        with ``runtime_stopped``.
        """
        with self._lock:
            call = next((c for c in self._pending.values() if c.tag is tag), None)
            if call is None or not call.started:  # ended, or not begun (nothing to stop)
                return False
            call.stop = call.stop or "cancel"
            running = [c for c in self._pending.values() if c.op == _RUN and c.started]
            if any(c.stop != "cancel" for c in running):
                return False
        self.kill("cancel")
        return True

    def unqueue(self, tag: object) -> bool:
        """Ask the runtime to take the run sent with ``tag`` out of its queue, if it has
        not begun (a cancel); whether it was asked. If the run was still queued, its
        answer is ``future_cancelled``; if it began meanwhile, it runs."""
        with self._lock:
            rid = next((r for r, c in self._pending.items()
                        if c.tag is tag and c.op == _RUN and not c.started), None)
            writer = self._writer if self.state == "up" else None
        if rid is None or writer is None:
            return False
        try:
            writer.write(frames.pack({"op": Op.CANCEL, "run": rid}))
        except (OSError, ValueError):
            return False
        return True

    def running_besides(self, tag: object) -> int:
        """How many runs that have started here, other than ``tag``'s, are not cancelled."""
        with self._lock:
            return sum(c.op == _RUN and c.started and c.tag is not tag and c.stop != "cancel"
                       for c in self._pending.values())

    def lost(self, generation: int) -> RuntimeLost:
        """Why outputs that this runtime's process ``generation`` held are gone: how it
        ended, or how it is ending (killed, its exit not seen yet). Said in the moment
        between the two as well, when ``last_exit`` still names an earlier exit, or none."""
        with self._lock:
            ended = self._exits.get(generation)
            if ended is None and generation == self.generation and self._kill_reason is not None:
                ended = (_exit_reason(None, self._kill_reason, self._late_op),
                         _lost_code(self._kill_reason))
        why, code = ended or ("exited", "runtime_crashed")
        return RuntimeLost(code, f"runtime {self.index} {why}: the outputs were lost")

    def kill(self, reason: str) -> None:
        """SIGKILL the current process; the supervisor restarts it.

        New requests wait for the next process from now on, rather than reach one
        that is about to die.
        """
        process = self._process
        if process is None or process.poll() is not None:
            return
        with self._lock:
            self._kill_reason = self._kill_reason or reason
            if self.state == "up":
                self.state = "stopping"
                self._up.clear()
        with contextlib.suppress(ProcessLookupError):
            process.kill()

    # -- supervision -------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    def check_deadlines(self, now: float) -> None:
        """The watchdog's tick: kill the process once a call in flight is past its deadline.

        The kill waits ``_KILL_GRACE_S`` after the first late call, so that runs whose
        deadlines pass within it (started together, say) end as timeouts too rather
        than as collateral of the first.
        """
        with self._lock:
            late = [c for c in self._pending.values() if c.deadline is not None and now > c.deadline]
            for call in late:
                call.stop = "timeout"
            if late and self._kill_at is None:
                self._kill_at = now + _KILL_GRACE_S
                self._late_op = late[0].op
            due = self._kill_at is not None and now >= self._kill_at
        if due:
            self.kill("timeout" if self._late_op == _RUN else "request_timeout")

    def _supervise(self) -> None:
        died_at: float | None = None
        while not self._pool.closing:
            try:
                self._spawn()
            except _StartFailed as e:
                if self._pool.closing:  # the close killed it: no failure to report
                    break
                self._backoff(str(e))
                continue
            self.start_failures = 0
            with self._lock:
                self.generation += 1
                self.state = "up"
            self._up.set()
            if died_at is not None:
                self._pool.restarted(self, time.monotonic() - died_at)
            if self._read(self._pool.loop):  # alive, but what it sent could not be read
                self.kill("garbled")
            died_at = time.monotonic()
            self._up.clear()
            with self._lock:
                self.state = "restarting" if not self._pool.closing else "stopped"
            self._ended()
        with self._lock:
            self.state = "stopped"

    def _spawn(self) -> None:
        """Start a process and wait for its ready message; ``_StartFailed`` if it never comes."""
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        for fd in (to_child_w, from_child_w):
            _widen(fd)
        process = subprocess.Popen(
            [sys.executable, "-m", "jitserve.service.runtimes.child", str(to_child_r),
             str(from_child_w)],
            pass_fds=(to_child_r, from_child_w), stdin=subprocess.DEVNULL,
            env=self._pool.child_env(self))
        os.close(to_child_r)
        os.close(from_child_w)
        pipe = frames.Pipe(from_child_r, to_child_w)
        self._process, self.pid, self._kill_reason, self._kill_at = process, process.pid, None, None
        if self._pool.closing:  # a close that began as it spawned may have missed it
            self.kill("close")
        self._late_op = Op.RUN
        try:
            pipe.send_bytes(frames.pack(self._pool.child_config(self.index)))
            if not pipe.poll(_READY_TIMEOUT_S):
                raise _StartFailed(f"not ready after {_READY_TIMEOUT_S:g} s")
            ready = frames.unpack(pipe.recv_bytes())
        except (OSError, EOFError, ValueError) as e:
            pipe.close()
            raise _StartFailed(_start_failure(process, e)) from e
        except _StartFailed:
            pipe.close()
            process.kill()
            process.wait()
            raise
        self.info = ready
        self._writer = PipeWriter(pipe.writer_fileno(), f"jitserve-runtime-{self.index}-writer")
        self._pipe = pipe

    def _backoff(self, why: str) -> None:
        self.start_failures += 1
        delay = min(0.5 * 2 ** (self.start_failures - 1), _MAX_BACKOFF_S)
        self.last_exit = why
        with self._lock:
            self.state = "backoff"
            self.backoff_until = time.monotonic() + delay
        self._pool.start_failed(self, why, delay)
        self._pool.wait_closing(delay)

    def _read(self, loop: asyncio.AbstractEventLoop | None) -> bool:
        """Read the answers until the pipe ends: on ``loop`` if there is one (this
        thread only waits), else here. If the loop closes first, read the rest here.
        Whether the reading stopped at a frame that was no message."""
        assert self._pipe is not None
        reader = LoopReader(self._pipe.fileno(), self._dispatch)
        if loop is not None:
            try:
                loop.call_soon_threadsafe(reader.attach, loop)
            except RuntimeError:  # closed
                pass
            else:
                while not reader.ended.wait(1.0) and not loop.is_closed():
                    pass
        if not reader.ended.is_set():
            reader.read_rest()
        return reader.garbled

    def _dispatch(self, message: dict[str, Any],
                  here: asyncio.AbstractEventLoop | None = None) -> None:
        """Settle the request reply ``message`` answers (or start its deadline, for a
        ``started``); a reply to no request in flight is dropped."""
        rid, kind = message.get("id", 0), message.get("kind")
        with self._lock:
            try:
                call = (self._pending.get(rid) if kind == _STARTED
                        else self._pending.pop(rid, None))
            except TypeError:  # an id no request has, not even hashable: dropped like any
                return
            message["generation"] = self.generation
            if call is not None:
                if kind == _STARTED:
                    call.started = True
                    if call.timeout_s is not None:
                        call.deadline = time.monotonic() + call.timeout_s
                elif call.op == _RUN:
                    self.runs -= 1
        if call is None:
            return
        if kind == _STARTED:
            if call.on_started is not None:
                _post(call.loop, call.on_started, here=here)
        elif kind == _OK:
            _post(call.loop, call.settle, message, None, here=here)
        else:
            root = message.get("root")
            error = RemoteError(str(message.get("code", "internal")),
                                str(message.get("message", "failed")),
                                {"code": str(root.get("code")), "message": str(root.get("message"))}
                                if isinstance(root, dict) else None)
            _post(call.loop, call.settle, None, error, here=here)

    def _ended(self) -> None:
        """The process exited: say why, fail what was in flight, drop what it held."""
        assert self._process is not None and self._pipe is not None
        code = self._process.wait()
        assert self._writer is not None
        self._writer.close()
        self._pipe.close()
        with self._lock:
            self._pipe = None
            self._writer = None
            self._frees.clear()  # that process's handles: the next one starts empty
            pid, self.pid = self.pid, None
            calls = list(self._pending.values())
            self._pending.clear()
            self.runs = 0
        why = _exit_reason(code, self._kill_reason, self._late_op)
        lost = _lost_code(self._kill_reason)
        self.last_exit, self.last_exit_code = why, lost
        with self._lock:
            self._exits[self.generation] = (why, lost)
            while len(self._exits) > _EXITS_KEPT:
                self._exits.popitem(last=False)
        self.restarts += 1
        self._pool.ended(self, pid, self._kill_reason or _reason_label(code), why)
        for call in calls:
            error: RuntimeLost
            if call.stop == "timeout":
                error = RuntimeLost("execution_timeout", _timeout_message(call))
            elif call.stop == "cancel":
                error = RuntimeLost("future_cancelled", "deleted while it ran: its runtime "
                                    f"{self.index} was stopped and restarted")
            elif call.op == _RUN and not call.started:
                error = NotStarted(lost, f"runtime {self.index} {why}, before this run "
                                         "began there")
            else:  # ``why`` says what killed it (a late run, a request's timeout) or how it ended
                error = RuntimeLost(lost, f"runtime {self.index} {why}")
            _post(call.loop, call.settle, None, error)
        self._pool.lost(self, self.generation, why)


class _StartFailed(Exception):
    pass


def _timeout_message(call: _Call) -> str:
    what = "execution" if call.op == _RUN else f"{call.op} request"
    return (f"{what} passed its deadline of {call.timeout_s:g} s and was stopped "
            "(its runtime was restarted)")


def _lost_code(killed_for: str | None) -> str:
    """What the requests and outputs of a process that ended are lost as: stopped on
    purpose, or crashed."""
    return "runtime_stopped" if killed_for in _DELIBERATE else "runtime_crashed"


def _reason_label(code: int) -> str:
    return "signal" if code < 0 else "exit"


def _exit_reason(code: int | None, killed_for: str | None, late_op: Op = Op.RUN) -> str:
    if killed_for == "timeout":
        return "was stopped: an execution on it passed its deadline"
    if killed_for == "request_timeout":
        return f"was stopped: a {late_op} request on it passed its time limit"
    if killed_for == "cancel":
        return "was stopped to cancel an execution"
    if killed_for == "close":
        return "was stopped: the server is shutting down"
    if killed_for == "garbled":
        return "was stopped: it sent a message that could not be read"
    if code is None:
        return "did not exit"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = {"SIGKILL": " (the kernel's OOM killer sends it: out of memory?)",
                "SIGABRT": " (XLA or a kernel failed a check, or it ran out of memory)",
                "SIGSEGV": " (a kernel read memory it must not)"}.get(name, "")
        return f"crashed with {name}{hint}"
    if code == EXIT_OUT_OF_MEMORY:
        return ("ran out of memory outside any request: its address-space cap "
                "(JITSERVE_RUNTIME_MAX_MEMORY_BYTES) is too small for jax and XLA")
    return f"exited with status {code}"


class RuntimePool:
    """The runtimes of one server, and where callers go.

    Args:
      count: how many runtime processes serve each device group.
      config: the first message each gets (``child_config``): the server's
        settings and this runtime's limits.
      env: environment of the processes (``JAX_PLATFORMS`` and friends).
      groups: the device groups (``devices.Group``), each adding to ``env`` the
        devices its runtimes see; omitted, one group of one device.
      segment_cache_bytes: shared-memory segments kept for reuse (``frames.SegmentCache``).

    Placement: a program sharded across N devices goes to the runtimes of the
    smallest groups of at least N devices, any other program to any runtime.
    Among those, an API key is pinned to one runtime, the least used when it first
    calls, so a key's runaway program can only take its own futures and those of
    keys that share its runtime. Without API keys, calls go by executable (a
    call on futures goes where the first of them lives), so different programs
    use every runtime and an executable's runs find it loaded; but a call whose
    runtime has no free run slot (``executor_threads`` runs in flight: a long
    loop, say) goes to the least busy runtime instead, rather than wait behind
    them.
    """

    def __init__(self, count: int, config: Config, env: dict[str, str], *,
                 groups: Sequence[Group] = (), segment_cache_bytes: int = 1 << 30) -> None:
        self.prefix = frames.new_prefix()
        self.segments = frames.SegmentCache(self.prefix, segment_cache_bytes)
        self.closing = False
        self.loop: asyncio.AbstractEventLoop | None = None
        self._config = config
        self._env = env
        self._run_slots = int(config.get("settings", {}).get("executor_threads", 1))
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self.groups = tuple(groups) or (Group(0, (0,)),)
        self.runtimes = [Runtime(i, self, group) for i, group in enumerate(
            g for g in self.groups for _ in range(count))]
        self._owners: dict[tuple[str, int], int] = {}  # (owner, group size) -> runtime
        self._assigned = collections.Counter[int]()
        self._lost_listeners: list[Callable[[Runtime, int, str], None]] = []
        self.counters: collections.Counter[str] = collections.Counter()
        self.last_restart_s: float | None = None
        self._latest: dict[int, tuple[int, dict[str, Any]]] = {}
        self._retired: dict[str, int] = {}
        self._retired_counts: collections.Counter[str] = collections.Counter()
        self._retired_device_runs = collections.Counter[int]()
        self._watchdog = threading.Thread(target=self._watch, daemon=True,
                                          name="jitserve-runtime-watchdog")

    # -- life --------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the runtimes; ``loop`` reads their answers, if given (the loop that
        serves every caller of the pool: an app's own), else their threads do."""
        self.loop = loop
        for runtime in self.runtimes:
            runtime.start()
        self._watchdog.start()

    async def wait_ready(self, timeout_s: float = _READY_TIMEOUT_S) -> None:
        """Wait until every runtime is up; ``RuntimeLost`` when one is not in time."""
        await asyncio.gather(*(r.wait_up(timeout_s) for r in self.runtimes))

    def close(self) -> None:
        """Stop every runtime (their in-flight requests fail) and clean up segments."""
        self.closing = True
        self._closed.set()
        for runtime in self.runtimes:
            runtime.kill("close")
        for runtime in self.runtimes:
            runtime.join(10)
        self.segments.close()
        frames.remove_all(self.prefix)

    def wait_closing(self, seconds: float) -> None:
        self._closed.wait(seconds)

    def child_config(self, index: int) -> Config:
        return {**self._config, "index": index}

    def child_env(self, runtime: Runtime) -> dict[str, str]:
        return {**os.environ, **self._env, **runtime.group.env}

    @property
    def memory_cap(self) -> int | None:
        """Each runtime's address-space cap (CPU), or ``None``."""
        return self._config.get("max_memory_bytes")

    @property
    def max_devices(self) -> int:
        """The most devices a program may need: the largest group's."""
        return max(g.size for g in self.groups)

    # -- placement ---------------------------------------------------------------

    def fitting(self, devices: int = 1) -> list[Runtime]:
        """The runtimes a program of ``devices`` devices goes to: any for one device,
        else those of the smallest groups of at least that many (all of the largest,
        if none is big enough: uploads are refused before that)."""
        if devices <= 1 or len(self.groups) == 1:
            return self.runtimes
        size = min((g.size for g in self.groups if g.size >= devices), default=self.max_devices)
        return [r for r in self.runtimes if r.group.size == size]

    def place(self, owner: str | None, hint: str = "", devices: int = 1) -> Runtime:
        """The runtime for ``owner``'s call (``hint``: an executable or program id) of a
        program that takes ``devices`` devices."""
        if len(self.runtimes) == 1:
            return self.runtimes[0]
        among = self.fitting(devices)
        if owner is None:
            try:
                spread = int(hint[:8] or "0", 16)
            except ValueError:  # not an id of ours: still a place, never a failure
                spread = zlib.crc32(hint.encode("utf-8", "replace"))
            return self.least_busy(among[spread % len(among)], among)
        size = among[0].group.size if devices > 1 else 0  # one pin per size of group
        with self._lock:
            index = self._owners.get((owner, size))
            if index is None:
                index = min((r.index for r in among), key=lambda i: (self._assigned[i], i))
                self._owners[(owner, size)] = index
                self._assigned[index] += 1
        return self.runtimes[index]

    def replace(self, owner: str | None, lost: Runtime, hint: str = "") -> Runtime:
        """Where a run goes again after ``lost`` lost it before it began: an API key's
        own runtime (``lost`` itself, restarted), else the least busy one up of those
        with as many devices."""
        if owner is not None:
            return lost
        return self.least_busy(lost, [r for r in self.runtimes if r.group.size >= lost.group.size])

    def least_busy(self, preferred: Runtime, among: Sequence[Runtime] | None = None) -> Runtime:
        """``preferred`` if it is up with a run slot free, else the runtime (of ``among``,
        default all) with the fewest runs in flight (those up first; ties go to
        ``preferred``, then the next after it)."""
        if preferred.state == "up" and preferred.runs < self._run_slots:
            return preferred
        n = len(self.runtimes)
        return min(among or self.runtimes, key=lambda r: (r.state != "up", r.runs,
                                                          (r.index - preferred.index) % n))

    # -- buffers -----------------------------------------------------------------

    async def fetch(self, buffers: Sequence[Buffer]) -> list[np.ndarray]:
        """The host copies of ``buffers`` (one request per runtime that holds some).

        Big ones arrive in a segment of ``segments``, which goes back to the cache
        once the last array read from it is gone.
        """
        out: list[np.ndarray | None] = [None] * len(buffers)
        by_runtime: dict[Runtime, list[int]] = {}
        for i, buf in enumerate(buffers):
            if not buf.alive:
                raise buf.lost()
            by_runtime.setdefault(buf.runtime, []).append(i)
        for runtime, positions in by_runtime.items():
            arrays = await self._fetch_from(runtime, [buffers[i] for i in positions])
            for i, array in zip(positions, arrays):
                out[i] = array
        return [a for a in out if a is not None]

    async def _fetch_from(self, runtime: Runtime, buffers: Sequence[Buffer]) -> list[np.ndarray]:
        offsets, size = frames.layout([b.nbytes for b in buffers])
        message: FetchRequest = {"handles": [b.handle for b in buffers]}
        segment = self.segments.take(size) if size else None
        if segment is not None:
            message["into"] = {"shm": segment.name, "offsets": offsets}
        asked = asyncio.ensure_future(runtime.request(Op.FETCH, message,
                                                      generation=buffers[0].generation))
        try:
            reply = await asyncio.shield(asked)
        except asyncio.CancelledError:
            if segment is not None:  # the runtime may still write into it: not before it answers
                asked.add_done_callback(lambda _: self.segments.give_back(segment))
            raise
        except BaseException:
            if segment is not None:
                self.segments.give_back(segment)
            raise
        if segment is None:
            return frames.unpack_arrays(reply["arrays"], {})
        if any(d.get("shm", segment.name) != segment.name for d in reply["arrays"]):
            self.segments.give_back(segment)
            raise RemoteError("internal", "a runtime answered a fetch with another segment")
        return frames.unpack_arrays(reply["arrays"], {segment.name: self.segments.lease(segment)})

    @staticmethod
    def retain(buffers: Sequence[Buffer]) -> None:
        """One more holder of each of ``buffers`` (a run about to read them). On the loop."""
        for buf in buffers:
            buf.refs += 1

    def release(self, buffers: Sequence[Buffer]) -> None:
        """One holder fewer of each; those nobody holds are freed on their runtimes."""
        done = []
        for buf in buffers:
            buf.refs -= 1
            if buf.refs == 0:
                done.append(buf)
        self.free(done)

    def free(self, buffers: Sequence[Buffer]) -> None:
        """Let go of ``buffers`` on their runtimes (no answer awaited)."""
        by_runtime: dict[tuple[Runtime, int], list[Buffer]] = {}
        for buf in buffers:
            if buf.given:
                continue
            by_runtime.setdefault((buf.runtime, buf.generation), []).append(buf)
        for (runtime, generation), bufs in by_runtime.items():
            runtime.send_free([b.handle for b in bufs], generation, sum(b.nbytes for b in bufs))

    def moved(self, nbytes: int) -> None:
        """Count one output that crossed from one runtime to another."""
        with self._lock:
            self.counters["moves"] += 1
            self.counters["move_bytes"] += nbytes

    # -- events from the runtimes' threads ----------------------------------------

    def add_lost_listener(self, listener: Callable[[Runtime, int, str], None]) -> None:
        self._lost_listeners.append(listener)

    def remove_lost_listener(self, listener: Callable[[Runtime, int, str], None]) -> None:
        with contextlib.suppress(ValueError):
            self._lost_listeners.remove(listener)

    def ended(self, runtime: Runtime, pid: int | None, reason: str, why: str) -> None:
        if self.closing:
            return
        with self._lock:
            self.counters[f"restarts:{reason}"] += 1
        log.warning("runtime %d (pid %s) %s; restarting", runtime.index, pid, why,
                    extra={"fields": {"runtime": runtime.index, "reason": reason, "why": why}})

    def lost(self, runtime: Runtime, generation: int, why: str) -> None:
        for listener in list(self._lost_listeners):
            try:
                listener(runtime, generation, why)
            except Exception:  # noqa: BLE001 - one app's bug must not stop the others'
                log.exception("a runtime-lost listener failed")

    def restarted(self, runtime: Runtime, seconds: float) -> None:
        self.last_restart_s = seconds
        log.info("runtime %d is back (pid %s) after %.2f s", runtime.index, runtime.pid, seconds,
                 extra={"fields": {"runtime": runtime.index, "seconds": round(seconds, 3)}})

    def start_failed(self, runtime: Runtime, why: str, delay: float) -> None:
        with self._lock:
            self.counters["start_failures"] += 1
        log.error("runtime %d failed to start: %s; retrying in %.1f s", runtime.index, why,
                  delay)

    def _watch(self) -> None:
        while not self._closed.wait(_WATCH_INTERVAL_S):
            now = time.monotonic()
            for runtime in self.runtimes:
                runtime.check_deadlines(now)

    # -- what the runtimes report -------------------------------------------------

    async def report(self, memory: bool = False) -> dict[str, Any]:
        """Ask every runtime that is up for its stats; the pool's view of them.

        ``cache``: the worst shared-cache state a runtime reports (``degraded`` over
        ``ok`` over ``local``). ``redis``: the runtimes' Redis counters summed over
        every process there has been, so they stay monotonic across restarts
        (``None`` without Redis). ``relaid``: kept outputs moved to the layout a
        run wanted, over every process there has been. ``device_runs``: runs on
        each of the host's devices, by its id, likewise. ``memory``: also
        ``device_memory``, each host device's memory (``StatsAnswer``), summed over the
        runtimes of its group (each process has its own allocator and share).
        """
        async def one(runtime: Runtime) -> None:
            if runtime.state != "up":
                return
            try:
                reply = await runtime.request(Op.STATS, {"memory": memory}, timeout_s=5)
            except RemoteError:
                return
            self._fold(runtime.index, reply["generation"], reply)

        await asyncio.gather(*(one(r) for r in self.runtimes))
        with self._lock:
            latest = list(self._latest.values())
            retired = dict(self._retired)
            counts = {k: self._retired_counts[k] + sum(int(doc.get(k, 0)) for _, doc in latest)
                      for k in _SUMMED}
            device_runs = collections.Counter(self._retired_device_runs)
            for index, (_, doc) in self._latest.items():
                device_runs.update(self._device_runs_of(index, doc))
        states = [doc.get("cache") for _, doc in latest if doc.get("cache")]
        cache = next((s for s in ("degraded", "ok", "local") if s in states), "local")
        redis: dict[str, int] | None = None
        for _, doc in latest:
            if doc.get("redis"):
                redis = redis or dict(retired)
                for k, v in doc["redis"].items():
                    if isinstance(v, int):
                        redis[k] = redis.get(k, 0) + v
        out: dict[str, Any] = {"cache": cache, "redis": redis, **counts,
                               "device_runs": dict(device_runs)}
        if memory:
            used: dict[int, collections.Counter[str]] = {}
            for index, (_, doc) in self._latest.items():
                ids = self.runtimes[index].group.devices
                for i, stats in enumerate(doc.get("device_memory") or ()):
                    if i < len(ids):
                        used.setdefault(ids[i], collections.Counter()).update(stats)
            out["device_memory"] = {device: dict(stats) for device, stats in sorted(used.items())}
        return out

    def _device_runs_of(self, index: int, doc: dict[str, Any]) -> dict[int, int]:
        """A STATS answer's runs per device of runtime ``index``, by the host's device ids."""
        ids = self.runtimes[index].group.devices
        return {ids[i] if i < len(ids) else i: int(n)
                for i, n in enumerate(doc.get("device_runs") or ())}

    async def broadcast(self, op: Op, message: Mapping[str, Any], *,
                        timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """Send ``op`` to every runtime that is up; their answers. A runtime that is
        down (it starts empty) or fails the request is left out."""
        async def one(runtime: Runtime) -> dict[str, Any] | None:
            if runtime.state != "up":
                return None
            try:
                return await runtime.request(op, message, timeout_s=timeout_s)
            except RemoteError as e:
                log.warning("runtime %d failed %s: %s", runtime.index, op, e)
                return None

        replies = await asyncio.gather(*(one(r) for r in self.runtimes))
        return [r for r in replies if r is not None]

    def _fold(self, index: int, generation: int, doc: dict[str, Any]) -> None:
        with self._lock:
            old = self._latest.get(index)
            if old is not None and old[0] != generation:  # that process is gone: keep its counts
                for k, v in (old[1].get("redis") or {}).items():
                    if isinstance(v, int):
                        self._retired[k] = self._retired.get(k, 0) + v
                self._retired_counts.update({k: int(old[1].get(k, 0)) for k in _SUMMED})
                self._retired_device_runs.update(self._device_runs_of(index, old[1]))
            self._latest[index] = (generation, doc)

    # -- state -------------------------------------------------------------------

    def describe(self) -> list[dict[str, Any]]:
        """Each runtime's state, for ``/readyz`` and operators."""
        now = time.monotonic()
        out = []
        for r in self.runtimes:
            item: dict[str, Any] = {"index": r.index, "state": r.state, "pid": r.pid,
                                    "restarts": r.restarts, "in_flight": len(r.in_flight()),
                                    "group": r.group.index}
            if r.last_exit:
                item["last_exit"] = r.last_exit
            if r.state == "backoff":
                item["retry_in_s"] = round(max(r.backoff_until - now, 0.0), 1)
            out.append(item)
        return out

    def devices_document(self) -> dict[str, Any]:
        """``GET /v1/devices``: the devices as the runtimes of each group report them,
        numbered as the host numbers them, and the groups."""
        devices, groups = [], []
        for group in self.groups:
            serving = [r for r in self.runtimes if r.group is group]
            info = next((r.info for r in serving if r.info), {})
            seen = info.get("devices") or [info.get("device") or {}]
            for i, host_id in enumerate(group.devices):
                doc = seen[i] if i < len(seen) else {}
                devices.append({**doc, "id": host_id, "group": group.index, "default": i == 0})
            groups.append({"index": group.index, "devices": list(group.devices),
                           "size": group.size, "runtimes": [r.index for r in serving]})
        return {"backend": self.backend.get("backend", {}), "devices": devices,
                "groups": groups, "max_program_devices": self.max_devices,
                "runtimes": self.describe()}

    def stats(self) -> dict[str, Any]:
        with self._lock:
            counters = dict(self.counters)
        return {"up": sum(r.state == "up" for r in self.runtimes), "count": len(self.runtimes),
                "counters": counters, "last_restart_s": self.last_restart_s}

    @property
    def backend(self) -> dict[str, Any]:
        """The backend the runtimes report (the first that is up)."""
        for r in self.runtimes:
            if r.info:
                return r.info
        return {}
