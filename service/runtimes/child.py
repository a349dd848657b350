"""A runtime process: ``python -m jitserve.service.runtimes.child R W``.

It owns the device and does everything that touches a program's content:
decode and validate uploads, lower, compile (in its own compile workers), load
executables, and run them. Outputs stay here, on the device, under integer
handles the API process holds; they cross back only when fetched.

The first message on the pipe is the configuration (the server's settings and
this runtime's limits). Limits that must hold before jax starts (the address
space on CPU, the device-memory fraction on GPU) are applied before jax is
imported. Then the runtime answers requests until its pipe closes, or until the
API process kills it: that is how deadlines and cancels stop a running program,
so nothing here needs to be interruptible.

What the two processes say to each other is ``protocol``'s: every request (an
``Op``) has its handler in ``HANDLERS``, and a request whose op has none is
answered with a protocol error, not a crash.

Requests are served concurrently, by threads that take turns reading the pipe:
at most ``executor_threads`` runs at once, and four more threads for everything
else, so a long run never delays a fetch of another future's outputs. A run
announces ``started`` before it begins, which is when its deadline starts counting.
A run of an executable whose last run here took under
``JITSERVE_RUNTIME_QUICK_RUN_MS`` is done by the thread that read it without
handing the pipe on first: waking the next reader, and passing the GIL between
the two, cost more than such a run (docs/performance.md).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import errno
import itertools
import logging
import math
import os
import resource
import select
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Final, NoReturn

from jitserve import wire

from .. import memory
from . import frames, landlock
from .protocol import (
    EXIT_OUT_OF_MEMORY,
    ArrayDesc,
    CancelRequest,
    Config,
    DecodeAnswer,
    DecodeRequest,
    DeviceDoc,
    ExecutableDoc,
    Failure,
    FetchAnswer,
    FetchRequest,
    ForgetAnswer,
    ForgetRequest,
    FreeRequest,
    IfrtAnswer,
    IfrtCloseAnswer,
    IfrtCloseRequest,
    IfrtReadAnswer,
    IfrtReadRequest,
    IfrtRequest,
    Kind,
    LookupAnswer,
    LookupRequest,
    Op,
    ProgramAnswer,
    ProgramDoc,
    ProgramRequest,
    PutAnswer,
    PutRequest,
    Ready,
    Reply,
    Root,
    RunAnswer,
    RunRequest,
    SplitAnswer,
    StatsAnswer,
    StatsRequest,
    TextAnswer,
    TextRequest,
)

log = logging.getLogger("jitserve.runtime")

_OTHER_THREADS = 4
_AVALS_KEPT = 1024
_RUN_TIMES_KEPT = 4096
# How often ``_QuickWatch`` looks, and after how many looks without quick runs it sleeps.
_QUICK_WATCH_S = 0.05
_QUICK_WATCH_IDLE_LOOKS = 20
# Bound once: looking a member up on its enum costs 0.1 us in Python 3.11, and the
# reader compares every request's op.
_RUN, _FREE, _OK, _ERROR, _STARTED = Op.RUN, Op.FREE, Kind.OK, Kind.ERROR, Kind.STARTED
_CANCEL = Op.CANCEL


class RemoteFailure(Exception):
    """A request this runtime refuses or fails, with the code the API process reports;
    ``root``: for a run whose input's run failed, the failure that began the chain."""

    def __init__(self, code: str, message: str, root: Root | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.root = root


def _limit_memory(max_bytes: int | None) -> None:
    """Cap this process's address space (CPU only: a GPU runtime maps far more than it uses).

    An allocation past the cap fails inside XLA (``RESOURCE_EXHAUSTED``), which the
    run reports as ``out_of_memory``, instead of the kernel's OOM killer choosing a
    victim on the host. Compile workers inherit the cap. The cap counts reserved
    address space as used, so glibc's malloc arenas, which reserve the most, are held
    to one per core (4 to 8) first (``memory.limit_arenas``; with 2 on two cores, freed
    copies of uploaded programs stayed in the shared arenas: tests/e2e/test_memory_e2e).
    """
    if max_bytes:
        memory.limit_arenas(min(max(4, os.cpu_count() or 4), 8))
        resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes))


class RuntimeServer:
    """Answers the API process's requests; one per runtime process."""

    def __init__(self, pipe: frames.Pipe, config: Config) -> None:
        import jax

        from jitserve.compiler import Compiler

        from ..settings import Settings

        # A run blocks its thread until it is done anyway: running it on that thread
        # spares the hand-off to XLA's dispatch thread and back, three quarters of
        # the CPU a small run costs (docs/performance.md). Set before the backend starts.
        with contextlib.suppress(AttributeError, KeyError):
            jax.config.update("jax_cpu_enable_async_dispatch", False)
        self._jax = jax
        self._pipe = pipe
        self._send_lock = threading.Lock()
        # Answers are written without blocking (``_send``): a thread that holds the
        # pipe lets go of it before it waits for room to write.
        self._write_fd = pipe.writer_fileno()
        os.set_blocking(self._write_fd, False)
        self._reader: int | None = None  # the thread holding the pipe (``_recv_lock``)
        settings = Settings(**config["settings"])
        self.memory_limit = config.get("max_memory_bytes")
        # Uploads may need as many devices as the server's largest group has.
        self.compiler = Compiler(dataclasses.replace(
            settings.compiler_config(), program_devices=config.get("max_devices")))
        self.device = self.compiler.device
        self.buffers: dict[int, Any] = {}
        self._handles = itertools.count(1)
        self._ifrt: Any = None  # the IFRT proxy's sessions (runtimes.ifrt), made on first use
        # A lock per session: its batches come one after another anyway, and a read of
        # its host buffers must not meet a batch; two sessions run side by side.
        self._ifrt_locks: dict[int, threading.Lock] = collections.defaultdict(threading.Lock)
        self._threads = settings.executor_threads + _OTHER_THREADS
        self._recv_lock = threading.Lock()
        self._runs_lock = threading.Lock()
        self._run_slots = settings.executor_threads
        self._queued_runs: collections.deque[dict[str, Any]] = collections.deque()
        # Runs sent ahead (``protocol``), under ``_runs_lock``: by handle, the runs
        # waiting for a run not ended yet to make it (one list per promising run);
        # promised handles freed before they were made; handles whose run failed,
        # with the first failure of the chain that failed it, until they are freed.
        self._promised: dict[int, list[dict[str, Any]]] = {}
        self._unwanted: set[int] = set()
        self._failed: dict[int, Root] = {}
        # A run known to take less than this (all of it: inputs, run, answer) is done
        # by the thread holding the pipe, which reads the next request after it.
        self._quick_run_s = settings.runtime_quick_run_ms / 1000
        self._run_times: dict[str, float] = {}  # the last run's seconds, by executable
        self.runs = self.quick_runs = self.runs_waited = 0
        self._quick_watch = _QuickWatch(self._send)
        self._slices: dict[int, Any] = {}  # batched runs' splits, by rows (_piece)
        self._maps = frames.SegmentMaps()  # the API process's segments, mapped here
        self._launch_lock = threading.Lock()  # runs of sharded executables, one at a time
        self.relaid = 0  # kept outputs moved to the layout a run wanted (_placed)
        # Single-device runs go to the least busy of this runtime's devices, taking
        # turns when all are idle; each device's runs in flight, and runs so far.
        devices = self.compiler.devices
        self._singles = [jax.sharding.SingleDeviceSharding(d) for d in devices]
        self._slot_of = {d.id: i for i, d in enumerate(devices)}
        self._busy = [0] * len(devices)
        self.device_runs = [0] * len(devices)
        self._turn = 0
        self._slots_lock = threading.Lock()
        self._avals: dict[tuple[Any, Any], Any] = {}  # jax avals of inputs, by shape and dtype
        try:  # jaxlib's transfer; jax.device_put where a jaxlib lacks it
            from jax._src.lib import xla_client

            self._put = xla_client.batched_device_put
            self._during_call = xla_client.HostBufferSemantics.IMMUTABLE_ONLY_DURING_CALL
        except (ImportError, AttributeError):
            self._put = None
        # jaxlib's wait for many arrays in one call (what jax.block_until_ready ends in):
        # a run's 25 outputs waited for one by one cost 57 us, in one call 7.
        self._ready: Callable[[list[Any]], Any] = getattr(
            xla_client, "batched_block_until_ready", _each_ready) if self._put else _each_ready

    # -- the loop ----------------------------------------------------------------

    def serve(self) -> None:
        devices = [_device_doc(d) for d in self.compiler.devices]
        ready: Ready = {"id": 0, "kind": Kind.READY, "pid": os.getpid(),
                        "backend": self.compiler.backend_info(), "device": devices[0],
                        "devices": devices}
        memory.freeze_startup_objects()  # jax, its backend, the compiler
        self._send(ready)
        threading.Thread(target=self.compiler.warm, daemon=True).start()
        if self._quick_run_s > 0:
            threading.Thread(target=self._quick_watch.watch, name="jitserve-quick-watch",
                             daemon=True).start()
        for i in range(self._threads - 1):
            threading.Thread(target=self._take_turns, name=f"jitserve-runtime-{i}",
                             daemon=True).start()
        self._take_turns()

    def _take_turns(self) -> None:
        """``_follow``; a thread that fails ends the runtime (the API process restarts
        it, failing its runs), rather than leaving the pipe to threads that wait for
        it, or a run without an answer."""
        try:
            self._follow()
        except BaseException:
            log.exception("a runtime thread failed; the runtime exits")
            os._exit(1)

    def _follow(self) -> None:
        """Read requests and answer them; the thread holding ``_recv_lock`` reads.

        Threads take turns at the pipe (leader and followers), so a request is
        answered by the thread that read it, with no hand-off to a pool. The
        reader passes the pipe on before it answers, except for frees (never
        answered) and quick runs (``_quick``), which it does before reading again:
        then no other thread wakes. It lets go of the pipe before anything that
        would block (``_send``, when the API process is slow to read). At most
        ``executor_threads`` runs go at once; a run that finds none free waits in
        a queue that finishing runs drain, while the reader goes on reading.
        """
        while True:
            self._hold()
            try:
                frame = self._pipe.recv_bytes()
            except (EOFError, OSError):
                os._exit(0)  # the API process is gone or closed us: nothing to finish
            message = frames.unpack(frame)
            if not isinstance(message, dict):
                self._send(_failure(0, "internal", f"protocol error: a request is a map, not "
                                                   f"{message!r:.40}"))
                continue
            for handle in message.pop("free", ()):  # frees riding on a request
                self._drop(handle)
            op = message.get("op")
            if op == _FREE:  # no answer
                HANDLERS[_FREE](self, message)
                continue
            if op == _CANCEL:  # no answer of its own; the run it names is answered
                HANDLERS[_CANCEL](self, message)
                continue
            if op != _RUN:
                self._let_go()
                self._answer(message)
                continue
            with self._runs_lock:
                self._promise(message)
                if self._parked(message):  # waits for a run sent before it, in no slot
                    self.runs_waited += 1
                    continue
                if self._run_slots == 0:
                    self._queued_runs.append(message)
                    continue
                self._run_slots -= 1
            run: dict[str, Any] | None = message
            quick = self._quick(message)
            if quick:
                self.quick_runs += 1
            else:
                self._let_go()
            while run is not None:
                self._run(run, quick)
                run, quick = self._next_run(), False
                if run is not None:  # a queued run: not this thread's to read for
                    self._let_go()

    # -- runs sent ahead (protocol) ----------------------------------------------

    def _promise(self, m: dict[str, Any]) -> None:
        """From now on, the handles run ``m`` names for its outputs are promised.
        Under ``_runs_lock``, by the reader, in the pipe's order."""
        out = m.get("out")
        if isinstance(out, list) and "split" not in m:
            waiting: list[dict[str, Any]] = []
            for handle in out:
                if type(handle) is int and handle < 0:
                    self._promised[handle] = waiting

    def _parked(self, m: dict[str, Any]) -> bool:
        """Park run ``m`` if an argument of its is promised by a run not ended yet;
        whether it was. Under ``_runs_lock``."""
        for a in m.get("args") or ():
            handle = a.get("handle") if isinstance(a, dict) else None
            if type(handle) is int and handle < 0:
                waiting = self._promised.get(handle)
                if waiting is not None:
                    waiting.append(m)
                    return True
        return False

    def _kept(self, out: list[int], outputs: list[Any]) -> None:
        """The run that promised ``out`` made ``outputs``: keep them (but those
        freed meanwhile), and let the runs waiting for them go."""
        with self._runs_lock:
            self._ended(out, self.buffers, outputs)

    def _broken(self, out: list[int], why: Root) -> None:
        """The run that promised ``out`` failed: the runs waiting for them go, and fail
        with ``why``, the first failure of the chain (its own, or its input's: a chain's
        messages nested each link's before, and grew with it). Under ``_runs_lock``."""
        self._ended(out, self._failed, [why] * len(out))

    def _ended(self, out: list[int], into: dict[int, Any], values: list[Any]) -> None:
        """The run that promised ``out`` ended: each handle's value goes ``into`` its
        place (the buffers, or the failures), but for those freed meanwhile; the
        runs waiting for them go. Under ``_runs_lock``."""
        waiting: list[dict[str, Any]] = []
        for handle, value in zip(out, values):
            waiting = self._promised.pop(handle, waiting)
            if handle in self._unwanted:
                self._unwanted.discard(handle)
            else:
                into[handle] = value
        self._unpark(waiting)

    def _unpark(self, waiting: list[dict[str, Any]]) -> None:
        """Runs whose awaited outputs are made (or failed): first in the queue, unless
        they wait for another run still; the thread whose run made them takes them
        next (``_next_run``). Under ``_runs_lock``."""
        ready = [m for m in waiting if not self._parked(m)]
        self._queued_runs.extendleft(reversed(ready))

    def _consume_given(self, m: dict[str, Any]) -> None:
        """Drop the buffers run ``m`` was given (``give``), which a run that ended
        before it took them did not: the API process sends no free for them."""
        for a in m.get("args") or ():
            if isinstance(a, dict) and a.get("give") and "handle" in a:
                self._drop(a["handle"])

    def _drop(self, handle: Any) -> None:
        """Free output ``handle``; a promised one as soon as it is made."""
        if type(handle) is not int or handle >= 0:
            self.buffers.pop(handle, None)
            return
        with self._runs_lock:
            if self.buffers.pop(handle, None) is None:
                if handle in self._promised:
                    self._unwanted.add(handle)
                else:
                    self._failed.pop(handle, None)

    def _hold(self) -> None:
        """Take the pipe, unless this thread holds it."""
        me = threading.get_ident()
        if self._reader != me:
            self._recv_lock.acquire()
            self._reader = me

    def _let_go(self) -> None:
        """Hand the pipe to the next thread, if this one holds it."""
        if self._reader == threading.get_ident():
            self._reader = None
            self._recv_lock.release()

    def _quick(self, m: dict[str, Any]) -> bool:
        """Whether run ``m`` is known to be quick: its executable is loaded, and its
        last run here took under ``JITSERVE_RUNTIME_QUICK_RUN_MS``."""
        exe_id: str = m.get("executable_id", "")
        last = self._run_times.get(exe_id)
        return (last is not None and last < self._quick_run_s
                and self.compiler.loaded_executable(exe_id) is not None)

    def _run(self, m: dict[str, Any], quick: bool) -> None:
        """Answer run ``m``, and keep how long that took. Kept before the answer goes:
        the next run of the executable may be read by another thread as soon as the
        API process has the answer, and must find it known by then. ``quick``: this
        thread holds the pipe, and reads on after it (``op_run``)."""
        t0 = time.perf_counter()
        reply = self._reply(m, HANDLERS[_RUN], m.get("id", 0), quick)
        self.runs += 1
        out = m.get("out")
        if reply["kind"] != _OK:
            self._consume_given(m)
            if isinstance(out, list) and out:
                with self._runs_lock:
                    if out[0] in self._promised:  # not kept: the run failed before it made them
                        self._broken(out, reply.get("root") or  # type: ignore[arg-type]
                                     {"code": reply["code"], "message": reply["message"]})
        if len(self._run_times) >= _RUN_TIMES_KEPT:
            self._run_times.clear()
        self._run_times[m.get("executable_id", "")] = time.perf_counter() - t0
        self._send(reply)

    def _next_run(self) -> dict[str, Any] | None:
        """A queued run for this thread's run slot, else ``None`` (the slot is free)."""
        with self._runs_lock:
            if self._queued_runs:
                return self._queued_runs.popleft()
            self._run_slots += 1
            return None

    def _answer(self, message: dict[str, Any]) -> None:
        """Answer a request other than a run or a free, by its op's handler; a request
        whose op has none is answered with a protocol error."""
        try:
            handler = HANDLERS[message["op"]]
        except (KeyError, TypeError):  # no op, none of ours, or not even a string
            handler = _unknown_op
        self._send(self._reply(message, handler))

    def _reply(self, message: dict[str, Any], handler: Handler, *args: Any) -> Mapping[str, Any]:
        """The answer to ``message``: ``handler``'s, or the error it raised."""
        from jitserve.compiler.errors import CompilerError

        rid = message.get("id", 0)
        try:
            return {"id": rid, "kind": _OK, **handler(self, message, *args)}
        except RemoteFailure as e:
            return _failure(rid, e.code, str(e), e.root)
        except CompilerError as e:
            return _failure(rid, str(e.code), str(e))
        except Exception as e:  # noqa: BLE001 - everything a program does is reported
            return _failure(rid, *self._classify(e))

    def _classify(self, e: Exception) -> tuple[str, str]:
        """The code and message of a failure that is not the runtime's own refusal."""
        from jitserve.compiler.errors import first_line

        text = first_line(e)
        if ("RESOURCE_EXHAUSTED" in text or isinstance(e, MemoryError)
                or isinstance(e, OSError) and e.errno == errno.ENOMEM):  # a mmap past the cap
            limit = (f" (this runtime's limit is {self.memory_limit:,} bytes, "
                     "JITSERVE_RUNTIME_MAX_MEMORY_BYTES)" if self.memory_limit else "")
            return "out_of_memory", f"out of memory{limit}: {text}"
        return "execution_failed", text

    def _send(self, reply: Mapping[str, Any]) -> None:
        """Write ``reply`` framed as ``Connection.send_bytes`` frames it.

        Never waiting while this thread holds the pipe, for room to write or for
        another thread's write: the API process may be writing requests faster than
        it reads answers (its event loop blocks on a full pipe), so the thread that
        would read them must not wait on it.
        """
        frame = memoryview(frames.frame(frames.pack(reply)))
        if not self._send_lock.acquire(blocking=False):  # another thread is writing
            self._let_go()
            self._send_lock.acquire()
        try:
            while frame:
                try:
                    frame = frame[os.write(self._write_fd, frame):]
                except BlockingIOError:
                    self._let_go()
                    select.select([], [self._write_fd], [])
        finally:
            self._send_lock.release()

    # -- programs ----------------------------------------------------------------

    def op_decode(self, m: DecodeRequest) -> DecodeAnswer:
        # A copy of its own: the segment goes back to the API process's cache.
        data = frames.unpack_arrays([m["program"]])[0].tobytes()
        try:
            program, created = self.compiler.programs.put(data, m.get("format"))
        finally:
            _let_go_of_copies(len(data))
        return {"program": _program_json(program), "created": created}

    def op_program(self, m: ProgramRequest) -> ProgramAnswer:
        program = self._stored_program(m["program_id"])
        if program is None:
            return {"program": None}
        return {"program": _program_json(program), "payload": program.payload}

    def _program(self, program_id: str) -> Any:
        program = self._stored_program(program_id)
        if program is None:
            raise RemoteFailure("unknown_program", f"runtime has no program {program_id}")
        return program

    def _stored_program(self, program_id: str) -> Any:
        """The program from memory, else from the tiers (decoded again), else ``None``."""
        program = self.compiler.programs.cached(program_id)
        if program is not None:
            return program
        program = self.compiler.programs.get(program_id)
        if program is not None:
            _let_go_of_copies(len(program.payload))
        return program

    # -- executables -------------------------------------------------------------

    def op_lookup(self, m: LookupRequest) -> LookupAnswer:
        from jitserve.wire import Aval

        program = self._program(m["program_id"])
        docs = m.get("avals")
        avals = None if docs is None else [Aval.from_json(a) for a in docs]
        static_key, donate, scope = m.get("static_key", ""), m.get("donate", ()), m.get("scope", "")
        chosen = m.get("compiler_options")
        if not m.get("compile", True):
            key = self.compiler.executable_id(program, avals, static_key, donate, scope,
                                              overrides=chosen)
            public = (self.compiler.executable_id(program, avals, static_key, donate,
                                                  overrides=chosen) if scope else key)
            if (self.compiler.cached(program, avals, static_key, donate, scope,
                                     overrides=chosen) is None
                    and not self._in_l2(key) and not self._in_l2(public)):
                return {"miss": key}
        lookup = self.compiler.lookup(program, avals, static_key, donate, scope, overrides=chosen)
        return {"executable": _lookup_json(lookup)}

    def _in_l2(self, key: str) -> bool:
        for tier in self.compiler.tiers:
            try:
                if tier.contains(key):
                    return True
            except Exception:  # noqa: BLE001 - a failing tier is a miss, as in a lookup
                continue
        return False

    def _executable(self, m: RunRequest) -> Any:
        exe = self.compiler.loaded_executable(m["executable_id"])
        if exe is None:  # evicted, or this runtime restarted since: the tiers have it,
            found = self.compiler.load(m["executable_id"])  # by id, no program decode
            exe = None if found is None else found.executable
        if exe is None:  # not even there (evicted from L2): compile from the program
            from jitserve.wire import Aval

            program = self._program(m["program_id"])
            docs = m.get("avals")
            avals = None if docs is None else [Aval.from_json(a) for a in docs]
            exe = self.compiler.lookup(program, avals, m.get("static_key", ""),
                                       m.get("donate", ()), m.get("scope", ""),
                                       overrides=m.get("compiler_options")).executable
        return exe

    # -- runs and buffers --------------------------------------------------------

    def _to_device(self, array: Any, slot: int = 0, copy: bool = False) -> Any:
        """``jax.device_put(array, device)`` (this runtime's ``slot``-th) by jaxlib's own
        call, which is what ``device_put`` ends in: its Python layers cost 70-100 us
        per array, 20 times the transfer of a small one (docs/performance.md).
        ``copy``: the array never keeps a view of ``array`` (copied during the call)."""
        sharding, device = self._singles[slot], self.compiler.devices[slot]
        if self._put is None:
            return self._jax.device_put(array, device, may_alias=False if copy else None)
        key = (array.shape, array.dtype)
        aval = self._avals.get(key)
        if aval is None:
            from jax._src import core

            if len(self._avals) >= _AVALS_KEPT:
                self._avals.clear()
            aval = self._avals[key] = core.ShapedArray(array.shape, array.dtype)
        if copy:
            return self._put(aval, sharding, [array], [device], True, True, self._during_call,
                             enable_x64=True)
        return self._put(aval, sharding, [array], [device], True, enable_x64=True)

    def _copy_to_device(self, array: Any, device: Any) -> Any:
        """``_to_device`` of a copy of ``array`` onto ``device`` (one of this runtime's)."""
        return self._to_device(array, self._slot_of[device.id], copy=True)

    def _take_slot(self, args: list[dict[str, Any]]) -> int:
        """The device a single-device run takes: where its first kept input lives (it
        moves no further), else the least busy, taking turns among equals."""
        n = len(self._busy)
        slot = None
        for a in args:
            buf = self.buffers.get(a["handle"]) if "handle" in a else None
            if buf is not None and len(buf.sharding.device_set) == 1:
                slot = self._slot_of.get(next(iter(buf.sharding.device_set)).id)
                break
        with self._slots_lock:
            if slot is None:
                slot = min(range(n), key=lambda i: (self._busy[i], (i - self._turn) % n))
                self._turn = (slot + 1) % n
            self._busy[slot] += 1
            self.device_runs[slot] += 1
        return slot

    def _placed(self, buf: Any, sharding: Any) -> Any:
        """``buf`` (a kept output) where a run wants it: as it is when it is laid out so,
        else re-laid device to device (a sharded output for a single-device program is
        gathered; one of another layout is moved shard by shard)."""
        if buf.sharding == sharding or buf.sharding.is_equivalent_to(sharding, buf.ndim):
            return buf
        self.relaid += 1
        return self._jax.device_put(buf, sharding)

    def op_run(self, m: RunRequest, rid: int = 0, quick: bool = False) -> RunAnswer | SplitAnswer:
        """Run an executable; ``started`` names request ``rid`` when it begins, unless the
        run is ``quick`` (this thread holds the pipe: ``_follow``)."""
        exe = self._executable(m)
        sharded = exe.device_count > 1
        if sharded or len(self._busy) == 1:
            with self._slots_lock:
                self.device_runs[0] += 1
            return self._run_on(exe, m, rid, quick, 0)
        slot = self._take_slot(m["args"])
        try:
            return self._run_on(self.compiler.on_device(exe, slot), m, rid, quick, slot)
        finally:
            with self._slots_lock:
                self._busy[slot] -= 1

    def _run_on(self, exe: Any, m: RunRequest, rid: int, quick: bool,
                slot: int) -> RunAnswer | SplitAnswer:
        """``op_run`` of ``exe`` on the runtime's ``slot``-th device (its first N, sharded)."""
        args: list[Any] = []
        host = frames.unpack_arrays([a for a in m["args"] if "handle" not in a], self._maps)
        host_iter = iter(host)
        donated = set(m.get("donate", ()))
        sharded = exe.device_count > 1
        for i, a in enumerate(m["args"]):
            if "handle" in a:
                # A donated input is consumed: the API process gives its buffer up
                # ("give") when nothing else holds it, else the run gets a copy.
                take = self.buffers.pop if a.get("give") else self.buffers.get
                buf = take(a["handle"], None)
                if buf is None:
                    why = self._failed.get(a["handle"])
                    if why is not None:
                        raise RemoteFailure("dependency_failed", f"args[{i}]: the call that "
                                            f"makes it failed: {why['code']}: {why['message']}",
                                            why)
                    raise RemoteFailure("future_expired", f"args[{i}]: its buffer was freed")
                placed = self._placed(buf, exe.in_shardings[i] if sharded else self._singles[slot])
                args.append(placed.copy() if i in donated and not a.get("give")
                            and placed is buf else placed)
            elif sharded:
                args.append(self._jax.device_put(next(host_iter), exe.in_shardings[i]))
            else:
                args.append(self._to_device(next(host_iter), slot))
        del host, host_iter
        # A quick run says nothing before its answer, unless it overruns (_QuickWatch):
        # ``started`` and the API process's wake-up for it cost a twentieth of a
        # cached call.
        if quick:
            self._quick_watch.begin(rid)
        else:
            self._send({"id": rid, "kind": _STARTED})
        t0 = time.perf_counter()
        try:
            # Runs of sharded executables launch one at a time, each waited for: XLA:CPU
            # deadlocks with many collective runs in flight, and launches in different
            # orders on different devices can too.
            with self._launch_lock if sharded else contextlib.nullcontext():
                outputs = exe.run(args)
                self._ready(outputs)
        finally:
            if quick:
                self._quick_watch.end()
        run_s = time.perf_counter() - t0
        if m.get("split") is not None:
            return self._split(outputs, [int(n) for n in m["split"]], run_s)
        promised = m.get("out")
        if promised is not None:
            if len(promised) != len(outputs):
                raise RemoteFailure("internal", f"protocol error: the run names {len(promised)} "
                                                f"output handles for {len(outputs)} outputs")
            handles = list(promised)
        else:
            handles = []
            for out in outputs:
                handle = next(self._handles)
                self.buffers[handle] = out
                handles.append(handle)
        reply: RunAnswer = {"handles": handles, "run_s": run_s}
        carried = exe.carried
        if carried is None:
            carried = wire.carried_outputs([out.nbytes for out in outputs])
        if carried:
            # Small outputs come along (all, or a loss beside a model): fetching them
            # later would cost a round trip.
            import numpy as np

            packed, _ = frames.pack_arrays([np.asarray(outputs[i]) for i in carried], None)
            values: list[ArrayDesc | None] = [None] * len(outputs)
            for i, desc in zip(carried, packed):
                values[i] = desc
            reply["values"] = values
        if promised is not None:  # last: a run waiting for them may donate them at once
            self._kept(handles, list(outputs))
        return reply

    def _split(self, outputs: list[Any], rows: list[int], run_s: float) -> SplitAnswer:
        """A batched run's answer (``service.batching``): every output cut along its
        leading axis into ``rows`` (one piece per call, in order; the rest is padding,
        dropped), each piece a buffer of its own under a new handle."""
        import numpy as np

        starts = np.cumsum([0, *rows[:-1]]).tolist()
        cpu = self.device.platform == "cpu"
        pieces = [[self._piece(np.asarray(out) if cpu else out, a, n)
                   for a, n in zip(starts, rows)] for out in outputs]
        del outputs  # the batch's own buffers go; only the calls' pieces stay
        self._jax.block_until_ready(pieces)
        handles: list[list[int]] = []
        values: list[Any] = []
        for call in zip(*pieces):
            mine = []
            for piece in call:
                handle = next(self._handles)
                self.buffers[handle] = piece
                mine.append(handle)
            handles.append(mine)
            if sum(p.nbytes for p in call) <= wire.INLINE_OUTPUTS_BYTES:
                values.append(frames.pack_arrays([np.asarray(p) for p in call], None)[0])
            else:
                values.append(None)
        return {"handles": handles, "values": values, "run_s": run_s}

    def _piece(self, out: Any, start: int, rows: int) -> Any:
        """Rows ``start:start+rows`` of ``out`` as a new device array, with no compile per
        pattern of calls: on the CPU a copy of the host view ``out`` (the host is the
        device), elsewhere a dynamic slice compiled once per (output aval, rows)."""
        jax = self._jax
        if self.device.platform == "cpu":
            return jax.device_put(out[start:start + rows].copy(), self.device)
        take = self._slices.get(rows)
        if take is None:
            take = self._slices[rows] = jax.jit(
                lambda x, i: jax.lax.dynamic_slice_in_dim(x, i, rows, axis=0))
        return take(out, start)

    def op_put(self, m: PutRequest) -> PutAnswer:
        """Keep host arrays on the device under new handles (``POST /v1/arrays``)."""
        import numpy as np

        jax = self._jax
        # These views are of a segment the API process reuses once we answer. On the
        # CPU device_put may share a host buffer: a copy. Elsewhere the transfer is
        # the copy, and it is done before the answer (block_until_ready), so a second
        # host copy would only halve the upload's speed.
        shared = self.device.platform == "cpu"
        arrays = [jax.device_put(np.array(a, copy=True) if shared else a, self.device)
                  for a in frames.unpack_arrays(m["args"])]
        jax.block_until_ready(arrays)
        handles = []
        for array in arrays:
            handle = next(self._handles)
            self.buffers[handle] = array
            handles.append(handle)
        return {"handles": handles}

    def op_fetch(self, m: FetchRequest) -> FetchAnswer:
        """Copy outputs to the host: big ones into the segment the API process named
        (``into``), the others inline."""
        import numpy as np

        bufs = []
        for handle in m["handles"]:
            buf = self.buffers.get(handle)
            if buf is None:
                raise RemoteFailure("future_expired", "the outputs were freed")
            bufs.append(buf)
        into = m.get("into")
        if into is None:
            return {"arrays": frames.write_arrays([np.asarray(b) for b in bufs], [None] * len(bufs),
                                                  None, None)}
        mapping = frames.Segment.open(into["shm"])
        try:
            arrays = []
            for buf, offset in zip(bufs, into["offsets"]):
                if offset is not None and len(buf.sharding.device_set) > 1:
                    arrays.append(_write_shards(buf, mapping, offset, into["shm"]))
                else:
                    arrays.extend(frames.write_arrays([np.asarray(buf)], [offset], mapping,
                                                      into["shm"]))
            return {"arrays": arrays}
        finally:
            mapping.close()

    def op_forget(self, m: ForgetRequest) -> ForgetAnswer:
        """Drop an executable from every tier (``DELETE /v1/executables/{id}``)."""
        return {"tiers": self.compiler.forget(str(m["executable_id"]))}

    def op_text(self, m: TextRequest) -> TextAnswer:
        """An executable's optimized HLO, as XLA prints it (``jax.stages.Compiled.as_text``),
        from L1 or loaded from a tier by its id; ``None`` when no tier has it."""
        exe = self.compiler.loaded_executable(str(m["executable_id"]))
        if exe is None:
            found = self.compiler.load(str(m["executable_id"]))
            exe = None if found is None else found.executable
        if exe is None:
            return {"text": None}
        loaded = exe.loaded
        if hasattr(loaded, "get_hlo_text"):
            return {"text": str(loaded.get_hlo_text())}
        return {"text": "\n\n".join(m.to_string() for m in loaded.hlo_modules())}

    def op_stats(self, m: StatsRequest) -> StatsAnswer:
        catalog = self.compiler.catalog
        compiler = self.compiler.stats()
        answer: StatsAnswer = {
            "buffers": len(self.buffers), "compilations": compiler["compilations"],
            "l1_entries": compiler["l1_entries"], "l1_bytes": compiler["l1_bytes"],
            "cache": catalog.state, "redis": catalog.shared_stats(), "runs": self.runs,
            "quick_runs": self.quick_runs, "quick_runs_overran": self._quick_watch.overran,
            "relaid": self.relaid, "device_runs": list(self.device_runs),
            "runs_waited": self.runs_waited, "promised": len(self._promised),
            "failed_handles": len(self._failed)}
        if m.get("memory"):
            answer["device_memory"] = self._device_memory()
        return answer

    def _device_memory(self) -> list[dict[str, int]]:
        """Each device's memory as XLA's allocator reports it, or, where it reports
        nothing (the CPU), the bytes of this process's live arrays on it: outputs of
        calls and IFRT sessions' arrays, a sharded one counted on each of its devices."""
        import jax

        devices = self.compiler.devices
        reported = [d.memory_stats() for d in devices]
        if all(reported):
            return [{"in_use": int(s.get("bytes_in_use", 0)), "limit": int(s.get("bytes_limit", 0)),
                     "peak": int(s.get("peak_bytes_in_use", 0))} for s in reported]
        held = dict.fromkeys((d.id for d in devices), 0)
        for array in jax.live_arrays():
            if array.is_deleted():
                continue
            sharding = array.sharding
            on = sharding.device_set
            each = array.nbytes if len(on) == 1 else (
                math.prod(sharding.shard_shape(array.shape)) * array.dtype.itemsize)
            for device in on:
                if device.id in held:
                    held[device.id] += int(each)
        return [{"in_use": held[d.id]} for d in devices]

    # -- IFRT proxy sessions (runtimes.ifrt) -------------------------------------

    @property
    def _sessions(self) -> Any:
        if self._ifrt is None:
            from .ifrt import Sessions

            self._ifrt = Sessions(self.compiler, self._copy_to_device)
        return self._ifrt

    def op_ifrt(self, m: IfrtRequest) -> IfrtAnswer:
        """One batch of a session, in order (the API process sends the next one after
        this answer): the responses, and the host buffers it made, small ones inline."""
        import numpy as np

        from .ifrt import unpack_buffers

        # A host buffer this runtime cannot map (its address space is used up) fails the
        # requests that name it, as a buffer the server refused does, not the batch.
        buffers: dict[int, Any] = {}
        refused = dict(m.get("refused") or {})
        for handle, desc in (m.get("buffers") or {}).items():
            try:
                buffers.update(unpack_buffers({handle: desc}))
            except (OSError, MemoryError) as e:
                refused[handle] = f"host buffer {handle}: {self._classify(e)[1]}"
        with self._ifrt_locks[int(m["session"])]:
            responses, made, compiled = self._sessions.serve(
                int(m["session"]), str(m.get("owner", "")), list(m["requests"]), buffers,
                m.get("quotas"), str(m.get("scope", "")), m.get("max_run_bytes"), refused,
                m.get("host"))
            host: dict[int, dict[str, Any]] = {}
            for handle, data in made.items():
                if data.nbytes < frames.INLINE_MAX_BYTES:
                    self._sessions.read(int(m["session"]), handle)
                    host[handle] = frames.write_arrays([np.asarray(data)], [None], None, None)[0]
                else:
                    host[handle] = {"nbytes": int(data.nbytes)}
        device_bytes, arrays = self._sessions.holding(int(m["session"]))
        return {"responses": responses, "host": host, "compiles": compiled,
                "device_bytes": device_bytes, "arrays": arrays}

    def op_ifrt_read(self, m: IfrtReadRequest) -> IfrtReadAnswer:
        from .ifrt import IfrtFailure

        with self._ifrt_locks[int(m["session"])]:
            try:
                data = self._sessions.read(int(m["session"]), int(m["handle"]))
            except IfrtFailure as e:
                raise RemoteFailure("not_found", str(e)) from None
        into = m["into"]
        mapping = frames.Segment.open(into["shm"])
        try:
            return {"arrays": frames.write_arrays([data], into["offsets"], mapping, into["shm"])}
        finally:
            mapping.close()

    def op_ifrt_close(self, m: IfrtCloseRequest) -> IfrtCloseAnswer:
        with self._ifrt_locks.pop(int(m["session"]), threading.Lock()):
            if self._ifrt is None:
                return {}
            used: IfrtCloseAnswer = self._sessions.close(int(m["session"]))
            return used

    def op_cancel(self, m: CancelRequest) -> None:
        """Take a queued run out of the queue and answer it ``future_cancelled``. Done by
        the reader, as a free is: a run that began is not touched."""
        rid = m.get("run")
        message = "deleted while it waited to run"
        with self._runs_lock:
            run = next((q for q in self._queued_runs if q.get("id") == rid), None)
            if run is not None:
                self._queued_runs.remove(run)
            else:  # parked, waiting for another run's outputs?
                for waiting in {id(w): w for w in self._promised.values()}.values():
                    run = next((q for q in waiting if q.get("id") == rid), None)
                    if run is not None:
                        waiting.remove(run)
                        break
            if run is None:
                return
            if run.get("out"):
                self._broken(run["out"], {"code": "future_cancelled", "message": message})
        self._consume_given(run)
        self._send(_failure(int(rid), "future_cancelled", message))

    def op_free(self, m: FreeRequest) -> None:
        """Drop outputs. Never answered: the reader does it before it reads on."""
        for handle in m.get("handles", ()):
            self._drop(handle)


class _QuickWatch:
    """Says ``started`` for a quick run that turns out not to be.

    The API process starts a run's deadline (and lets a DELETE stop it) when the
    run says ``started``. A quick run does not, as its answer follows at once; so
    that one which hangs this time still has a deadline, this thread looks every
    ``_QUICK_WATCH_S`` and says it for a quick run it sees twice: 50-100 ms late.
    After a second without quick runs it sleeps until the next one begins.
    """

    def __init__(self, send: Callable[[Reply], None]) -> None:
        self._send = send
        self._running: int | None = None  # the id of the quick run going on
        self._begun = 0
        self._awake = False
        self._wake = threading.Event()
        self.overran = 0  # quick runs this said ``started`` for

    def begin(self, rid: int) -> None:
        """Quick run ``rid`` starts (one at a time: the thread holding the pipe runs it)."""
        self._running = rid
        self._begun += 1
        if not self._awake:
            self._awake = True
            self._wake.set()

    def end(self) -> None:
        self._running = None

    def watch(self) -> None:
        seen = said = None
        idle, begun = 0, self._begun
        while True:
            if idle >= _QUICK_WATCH_IDLE_LOOKS:
                self._awake = False
                self._wake.clear()
                if self._begun == begun and self._running is None:  # else begin missed us
                    self._wake.wait()
                self._awake = True
                idle = 0
            time.sleep(_QUICK_WATCH_S)
            rid = self._running
            if rid is not None and rid == seen and rid != said:
                self._send({"id": rid, "kind": _STARTED})
                said = rid
                self.overran += 1
            seen = rid
            idle = idle + 1 if self._begun == begun and rid is None else 0
            begun = self._begun


# How a runtime serves a request: ``handler(server, request, *extra)``, returning its
# answer (a free has none).
Handler = Callable[..., Any]

# What serves each request (``protocol.Op``): the runtime answers to these and nothing
# else. The reader does a free itself, and gives a run a run slot (``_follow``);
# every other request is answered by ``_answer``.
HANDLERS: Final[dict[Op, Handler]] = {
    Op.DECODE: RuntimeServer.op_decode,
    Op.PROGRAM: RuntimeServer.op_program,
    Op.LOOKUP: RuntimeServer.op_lookup,
    Op.RUN: RuntimeServer.op_run,
    Op.PUT: RuntimeServer.op_put,
    Op.FETCH: RuntimeServer.op_fetch,
    Op.FORGET: RuntimeServer.op_forget,
    Op.TEXT: RuntimeServer.op_text,
    Op.STATS: RuntimeServer.op_stats,
    Op.FREE: RuntimeServer.op_free,
    Op.CANCEL: RuntimeServer.op_cancel,
    Op.IFRT: RuntimeServer.op_ifrt,
    Op.IFRT_READ: RuntimeServer.op_ifrt_read,
    Op.IFRT_CLOSE: RuntimeServer.op_ifrt_close,
}


def _unknown_op(server: RuntimeServer, m: dict[str, Any]) -> NoReturn:
    """The handler of a request whose op has none: a protocol error, for its sender."""
    raise RemoteFailure("internal", f"protocol error: a runtime has no op {m.get('op')!r:.40}; "
                        f"it answers {', '.join(HANDLERS)}")


def _each_ready(arrays: list[Any]) -> None:
    """Wait for each of ``arrays`` (where jaxlib has no batched wait)."""
    for a in arrays:
        a.block_until_ready()


def _failure(rid: int, code: str, message: str, root: Root | None = None) -> Failure:
    failure: Failure = {"id": rid, "kind": _ERROR, "code": code, "message": message}
    if root is not None:
        failure["root"] = root
    return failure


def _write_shards(buf: Any, mapping: Any, offset: int, name: str) -> dict[str, Any]:
    """A sharded output assembled in a segment: each shard's bytes written once, in place
    (replicas skipped), where a host copy of the whole array and then a copy of that
    would write every byte twice."""
    import numpy as np

    target = np.ndarray(buf.shape, buf.dtype, buffer=mapping, offset=offset)
    for shard in buf.addressable_shards:
        if shard.replica_id == 0:
            target[shard.index] = np.asarray(shard.data)
    del target  # no view may outlive the mapping, which is closed next
    return {"dtype": wire.dtype_name(buf.dtype), "shape": list(buf.shape), "shm": name,
            "offset": offset}


def _let_go_of_copies(size: int) -> None:
    """After a program of ``size`` bytes was decoded: its transient copies (the blob read,
    the flatbuffer's, the MLIR module's, the blob written) go back to the kernel, so this
    process holds the program once (docs/runtimes.md)."""
    if size >= frames.INLINE_MAX_BYTES:
        memory.trim()


def _device_doc(device: Any) -> DeviceDoc:
    """What the READY message says of ``device``, its memory limit where XLA reports one."""
    doc: DeviceDoc = {"id": device.id, "platform": device.platform,
                      "device_kind": device.device_kind}
    try:
        limit = int((device.memory_stats() or {}).get("bytes_limit", 0))
    except Exception:  # noqa: BLE001 - a backend without memory stats: no limit to report
        limit = 0
    if limit > 0:
        doc["memory_limit"] = limit
    return doc


def _program_json(program: Any) -> ProgramDoc:
    return {**program.to_json(), "name": program.name}


# The structured parts of an executable's meta its record shows (compiler.catalog).
_RECORD_FIELDS = ("key_parts", "recompiled_because", "cost", "sharding")


def _lookup_json(lookup: Any) -> ExecutableDoc:
    exe = lookup.executable
    meta = {k: v for k, v in exe.meta.items()
            if isinstance(v, (str, int, float, bool, type(None))) or k in _RECORD_FIELDS}
    return {"executable_id": lookup.executable_id, "tier": str(lookup.tier),
            "compile_seconds": lookup.compile_seconds, "nbytes": exe.nbytes,
            "in_avals": [a.to_json() for a in exe.in_avals],
            "out_avals": [a.to_json() for a in exe.out_avals], "out_tree": exe.out_tree,
            "memory": None if exe.memory is None else exe.memory.to_json(), "meta": meta}


_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000


def _leave_the_network() -> str | None:
    """Move this process into a network namespace of its own, with no interfaces up:
    a program (or a kernel it reaches) cannot open a connection anywhere.

    Needs no privilege where unprivileged user namespaces are allowed; where
    neither works (a container whose seccomp profile forbids ``unshare``), the
    runtime goes on with the host's network and says so. Call it while the
    process has one thread (before jax starts its own).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNET) == 0:
        return "a network namespace of its own"
    uid, gid = os.getuid(), os.getgid()
    if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) != 0:
        log.warning("runtime keeps the host's network: unshare failed (%s)",
                    os.strerror(ctypes.get_errno()))
        return None
    # The same ids inside as outside, so files in the cache directory stay ours.
    with contextlib.suppress(OSError):
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
    return "user and network namespaces of its own"


def _confine_files(settings: dict[str, Any]) -> None:
    """Let this runtime write only to its disk tier and to shared-memory segments
    (``landlock``; docs/runtimes.md). jax and XLA on CPU write nowhere else."""
    writable = [frames.SHM_DIR]  # the segments that carry big arrays both ways
    if settings.get("disk_cache", True):
        cache_dir = Path(settings["cache_dir"]).expanduser()
        cache_dir.mkdir(parents=True, exist_ok=True)
        writable.append(cache_dir)
    # /dev/null: the compile workers' stdin, and whatever discards output there.
    where = landlock.confine(writable, writable_files=[Path("/dev/null")])
    if where:
        log.info("runtime writes only where it must: %s", where)


def main(read_fd: int, write_fd: int) -> None:
    pipe = frames.Pipe(read_fd, write_fd)
    config: Config = frames.unpack(pipe.recv_bytes())
    logging.basicConfig(level=config.get("log_level", "WARNING").upper(), stream=sys.stderr,
                        format=f"runtime {config.get('index')}: %(levelname)s %(name)s: %(message)s")
    if config.get("platform", "cpu") == "cpu":
        _limit_memory(config.get("max_memory_bytes"))
    if config.get("isolate_network"):
        where = _leave_the_network()
        if where:
            log.info("runtime has no network: %s", where)
    if config.get("platform", "cpu") == "cpu":  # before jax: Landlock binds this one thread
        _confine_files(config["settings"])
    try:
        RuntimeServer(pipe, config).serve()
    except (MemoryError, OSError, RuntimeError, ImportError) as e:  # jax's libraries, threads
        if not _out_of_memory(e):
            raise
        log.error("runtime ran out of memory outside any request (its address-space cap, "
                  "JITSERVE_RUNTIME_MAX_MEMORY_BYTES, is %s bytes): %s",
                  f"{config.get('max_memory_bytes') or 0:,}", e)
        logging.shutdown()
        os._exit(EXIT_OUT_OF_MEMORY)


def _out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` says the process could not get memory (a thread's stack or a
    library's mapping past the cap are refused in these words)."""
    text = str(e)
    return (isinstance(e, MemoryError) or isinstance(e, OSError) and e.errno == errno.ENOMEM
            or "can't start new thread" in text or "Cannot allocate memory" in text
            or "failed to map segment" in text)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
