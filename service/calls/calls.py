"""Program calls: compile on demand, then execute into a future.

``Calls.execute`` is the whole of ``POST /v1/programs/{id}/execute`` below the
HTTP layer: it turns the decoded arguments (numpy arrays and future references)
into concrete avals, creates the future and hands the work to the executor.
Finding the executable is a lookup on the runtime the call is placed on
(``service.runtimes``), which decodes, compiles or loads it; the answer (its
signature) is kept here by call (``ExecutableIndex``), so a cached call goes
straight to its run.

A call never waits for a compile: when the executable is not known yet, the
future is created ``compiling`` (its outputs' avals are the program's own) and
answered at once; the lookup runs in a task, and its refusal (a compile error,
a timeout, a quota) becomes the future's error. Only a program whose output
shapes depend on its inputs (shape polymorphism) compiles before the answer,
since the future must say its outputs' avals.

The arguments that name other futures' outputs are held from the moment the
call is accepted: a buffer is retained, and an output still to be computed is
pinned (``FutureStore.pin``), so that releasing or deleting those futures cannot
free what this call will read.

With tenants kept apart (API keys on), a lookup that no cache can answer waits
for its tenant's turn at the compilers (``service.scheduler``) and counts
against the tenant's compiles per minute; every executable looked up becomes
the tenant's (``service.tenants``), within its quota of executables.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jitserve import wire
from jitserve.compiler.errors import CompilerError
from jitserve.compiler.options import check_compiler_options
from jitserve.compiler.records import Program, check_donate, check_inputs
from jitserve.wire import Aval, ErrorCode, FutureStatus, TierName

from ..console import CompileRecord, Console
from ..errors import (
    BadRequest,
    FutureCancelled,
    FutureFailed,
    NotFound,
    ServiceError,
    Unavailable,
)
from ..metrics import Metrics
from ..runtimes import Buffer, Op, RemoteError, Runtime, RuntimeLost, RuntimePool
from ..runtimes.protocol import ForgetRequest, LookupRequest, TextRequest
from .batching import Batcher, SharedConfigs
from .executables import (
    CallKey,
    CallOptions,
    ExecutableIndex,
    RemoteExecutable,
    Resolved,
    call_key,
    canonical,
    host_aval,
)
from .executor import Arg, Executor, FutureRef
from .futures import Future, FutureStore
from .scheduler import FairScheduler
from .tenants import Tenants

__all__ = ["Call", "Calls", "RuntimeRefusal", "ask", "refusal"]

log = logging.getLogger("jitserve.calls")

_NO_OPTIONS = CallOptions()


@dataclasses.dataclass(frozen=True)
class Call:
    """A started execution: its future and where its executable came from
    (``pending`` while it compiles)."""

    future: Future
    tier: str


class _CompileJob:
    """The job of a ``compiling`` future: a cancel lets the compile finish (its
    executable is cached for the next caller) but nothing runs."""

    def cancel(self) -> bool:
        return True

    def stop(self) -> str | None:  # never running: the store cancels it instead
        return "it is still compiling"

    def unqueue(self) -> bool:  # never sent: ``cancel`` did it
        return False


class RuntimeRefusal(CompilerError):
    """A runtime's refusal of a program, with the code it gave (or one for its death)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def refusal(e: RemoteError, during: str) -> Exception:
    """The exception a route raises for a runtime's ``e`` while ``during`` (e.g. "compiling")."""
    if e.code == "unavailable":
        return Unavailable(str(e))
    if isinstance(e, RuntimeLost):
        decoding = during == "decoding"
        if e.code == "execution_timeout":
            code = ErrorCode.INVALID_PROGRAM if decoding else ErrorCode.COMPILE_TIMEOUT
            return RuntimeRefusal(code, f"{during} ran past its time limit and was stopped")
        code = ErrorCode.INVALID_PROGRAM if decoding else ErrorCode.COMPILE_FAILED
        return RuntimeRefusal(code, f"{during} the program stopped its runtime: {e}")
    try:
        code = ErrorCode(e.code)
    except ValueError:
        code = ErrorCode.COMPILER_ERROR
    return RuntimeRefusal(code, str(e))


async def ask(runtime: Runtime, op: Op, message: Mapping[str, Any], program: Program, *,
              timeout_s: float | None = None) -> dict[str, Any]:
    """A request about ``program``; a runtime that does not know it is sent it first."""
    try:
        return await runtime.request(op, message, timeout_s=timeout_s, retry=True)
    except RemoteError as e:
        if e.code != "unknown_program":
            raise
    await runtime.decode(program.payload, program.format.value, timeout_s=timeout_s)
    return await runtime.request(op, message, timeout_s=timeout_s, retry=True)


class Calls:
    """Compiles and runs programs for callers.

    Args:
      runtimes: where programs compile and run (``service.runtimes.RuntimePool``).
      futures: where new futures go.
      executor: runs them.
      metrics: cache, compile and transfer counters.
      index: signatures of executables by call (shared with the catalog).
      lookup_timeout_s: the longest a lookup (lowering, compile, load) may take.
      tenants: who owns which executable, and the compile quota; omitted, one tenant.
      scheduler: turns at the compilers for the tenants' lookups; omitted, every
        lookup goes straight to its runtime (one tenant: nobody to be fair to).
      shared_batching: where the replicas keep their callers' batching configurations
        (``service.cluster``); omitted, this process keeps its own.
      console: keeps each lookup the index could not answer (``service.console``).
    """

    def __init__(self, runtimes: RuntimePool, futures: FutureStore, executor: Executor,
                 metrics: Metrics, index: ExecutableIndex, *, lookup_timeout_s: float,
                 tenants: Tenants | None = None, scheduler: FairScheduler | None = None,
                 shared_batching: SharedConfigs | None = None,
                 console: Console | None = None) -> None:
        self._runtimes = runtimes
        self._console = console
        self._futures = futures
        self._executor = executor
        self._metrics = metrics
        self._index = index
        self._lookup_timeout_s = lookup_timeout_s
        self._tenants = tenants or Tenants()
        self._scheduler = scheduler
        self._tasks: set[asyncio.Task[None]] = set()
        # Dynamic batching of the programs callers opted in (service/calls/batching.py).
        self.batcher = Batcher(self.compile, runtimes, futures, executor, metrics,
                               shared=shared_batching, scope=self._tenants.scope)

    async def compile(self, program: Program, in_avals: Sequence[Aval] | None,
                      options: CallOptions = _NO_OPTIONS, owner: str | None = None,
                      runtime: Runtime | None = None, key: CallKey | None = None) -> Resolved:
        """The ``Resolved`` for ``program`` at ``in_avals`` (compiling if needed).

        ``key``: their ``call_key``, when the caller has it. ``QuotaExceeded`` when
        ``owner`` would pass its executables or compiles quota.
        """
        scope = self._tenants.scope(owner)
        if options.scope != scope:  # the caller's own executables (Tenants.scope)
            options, key = dataclasses.replace(options, scope=scope), None
        key = key or call_key(program.program_id, in_avals, options)
        known = self._index.get(key)
        if known is not None:  # no round trip: the runs name the executable
            lookup = Resolved(known, known.executable_id, TierName.MEMORY, 0.0)
        else:
            runtime = runtime or self._runtimes.place(owner, program.program_id,
                                                      program.nr_devices)
            try:
                lookup = await self._lookup(runtime, program, in_avals, options, owner)
            except CompilerError as e:  # the console lists refused compiles too
                if self._console is not None:
                    self._console.compiled(CompileRecord(
                        time.time(), owner, program.program_id, program.name,
                        "" if in_avals is None else ", ".join(str(a) for a in in_avals),
                        "failed", 0.0, error={"code": str(e.code), "message": str(e)}))
                raise
            self._index.put(key, lookup.executable)
            # Also by the avals an execute of host arrays names (a compile may give none).
            plain = [canonical(Aval(a.shape, a.dtype)) for a in lookup.executable.in_avals]
            self._index.put(call_key(program.program_id, plain, options), lookup.executable)
            # One line per lookup the index could not answer, and the console keeps it.
            record = _record_of(program, lookup, owner)
            record.log()
            if self._console is not None:
                self._console.compiled(record)
        return self._claim(lookup, owner, program)

    def _claim(self, lookup: Resolved, owner: str | None, program: Program) -> Resolved:
        """``lookup``, its executable now ``owner``'s, counted."""
        self._tenants.claim_executable(owner, lookup.executable_id, program.program_id)
        self._metrics.lookup(lookup.tier, lookup.compile_seconds)
        return lookup

    async def _lookup(self, runtime: Runtime, program: Program, in_avals: Sequence[Aval] | None,
                      options: CallOptions, owner: str | None) -> Resolved:
        """A lookup on ``runtime``: straight away, or, for a tenant's compile, in its turn."""
        message: LookupRequest = {
            "program_id": program.program_id, "static_key": options.static_key,
            "donate": list(options.donate),
            "avals": None if in_avals is None else [a.to_json() for a in in_avals]}
        if options.scope:
            message["scope"] = options.scope
        if options.compiler_options:
            message["compiler_options"] = dict(options.compiler_options)
        if self._scheduler is None or owner is None or not self._tenants.scoped:
            return _lookup_of(await self._ask(runtime, {**message, "compile": True}, program))
        probe = await self._ask(runtime, {**message, "compile": False}, program)
        if "miss" not in probe:  # a cache answers: no turn to wait for, no compile to count
            lookup = _lookup_of(probe)
            self._tenants.check_executable_room(owner, lookup.executable_id)
            return lookup
        self._tenants.check_executable_room(owner, probe["miss"])  # before paying for a compile
        budget = self._tenants.compiles
        token = budget.reserve(owner)
        try:
            reply = await self._scheduler.run_async(owner, self._ask, runtime,
                                                    {**message, "compile": True}, program)
        except BaseException:
            budget.give_back(owner, token)
            raise
        lookup = _lookup_of(reply)
        if lookup.tier != TierName.COMPILED:  # another caller compiled it meanwhile
            budget.give_back(owner, token)
        return lookup

    async def _ask(self, runtime: Runtime, message: LookupRequest,
                   program: Program) -> dict[str, Any]:
        try:
            return await ask(runtime, Op.LOOKUP, message, program,
                             timeout_s=self._lookup_timeout_s)
        except RemoteError as e:
            raise refusal(e, "compiling") from None

    async def execute(self, program: Program, args: Sequence[Any], static_key: str,
                      owner: str | None, timeout_s: float | None = None,
                      donate: Sequence[int] = (),
                      compiler_options: Mapping[str, Any] | None = None) -> Call:
        """Start running ``program`` on ``args``; returns before it compiles or runs.

        ``args`` are decoded wire values: numpy arrays or ``{"future", "output"}``
        references to the caller's own futures. ``timeout_s``: the caller's deadline
        for the run (the server's ``execution_timeout_s`` caps it). ``donate``: the
        arguments the run may consume (``jax.jit``'s ``donate_argnums``, on the
        flat arguments); the outputs they name are released for the caller.
        ``compiler_options``: XLA options for its executable, as ``jax.jit``'s (those
        ``compiler.options`` allows; ``InvalidProgram`` names any other).
        """
        options = CallOptions(static_key, check_donate(donate, len(args)),
                              self._tenants.scope(owner), check_compiler_options(compiler_options))
        if not options.donate and not options.compiler_options:  # opted in (calls.batching)
            await self.batcher.refresh(owner, program.program_id)
            batched = self.batcher.offer(program, args, static_key, owner, timeout_s)
            if batched is not None:
                self._transferred(_host_bytes(args))
                batched.tier = "batched"
                return Call(batched, "batched")
        inputs, avals, deps = self._resolve(args, owner)
        runtime = self._place(owner, program, inputs)
        self._executor.hold(inputs)
        try:
            key = call_key(program.program_id, avals, options)
            known = self._index.get(key)
            # A call that must compile first is accepted at once, its future reserving
            # its outputs' sizes; a sharded program's device bytes are known once compiled.
            if known is None and program.out_avals is not None and program.nr_devices == 1 and all(
                    a.is_static for a in program.out_avals):
                fut = self._compiling(program, avals, options, owner, runtime, inputs,
                                      timeout_s)
                self._give_up(args, options.donate, deps)
                fut.tier = "pending"
                return Call(fut, "pending")
            if known is not None:  # no round trip, nothing to await
                lookup = self._claim(Resolved(known, known.executable_id, TierName.MEMORY, 0.0),
                                     owner, program)
            else:
                lookup = await self.compile(program, avals, options, owner, runtime, key)
            exe = lookup.executable
            exe.check_inputs(avals)
            self._executor.admit(exe)  # its intermediates count too (executor.py)
            fut = self._futures.create(
                owner=owner, executable_id=lookup.executable_id, out_avals=exe.out_avals,
                out_tree=exe.out_tree, compile_s=lookup.compile_seconds,
                input_bytes=(nbytes := _host_bytes(inputs)),
                out_bytes=exe.out_device_bytes)
        except BaseException:
            self._executor.drop(inputs)
            raise
        self._transferred(nbytes)
        self._give_up(args, options.donate, deps)
        fut.tier = str(lookup.tier)
        self._executor.submit(fut, runtime, program, exe, options, inputs, timeout_s)
        return Call(fut, lookup.tier)

    def _give_up(self, args: Sequence[Any], donate: Sequence[int],
                 deps: Mapping[str, Future]) -> None:
        """Release the outputs the call donates (its own hold keeps them until it runs);
        ``deps``: the futures its arguments name, by id (``_resolve``)."""
        if not donate:
            return
        released: dict[str, list[int]] = {}
        for i in donate:
            arg = args[i]
            if not isinstance(arg, np.ndarray):
                released.setdefault(arg["future"], []).append(arg["output"])
        for future_id, indices in released.items():
            self._futures.let_go(deps[future_id], indices)

    def _compiling(self, program: Program, avals: list[Aval], options: CallOptions,
                   owner: str | None, runtime: Runtime, inputs: list[Arg],
                   timeout_s: float | None) -> Future:
        """A ``compiling`` future whose lookup, then run, go on in a task."""
        assert program.out_avals is not None
        check_inputs(program.in_avals, avals)
        nbytes = _host_bytes(inputs)
        fut = self._futures.create(owner=owner, executable_id="", out_avals=program.out_avals,
                                   out_tree=None, compiling=True, input_bytes=nbytes)
        fut.job = _CompileJob()
        self._transferred(nbytes)
        task = asyncio.get_running_loop().create_task(self._compile_then_run(
            fut, program, avals, options, owner, runtime, inputs, timeout_s))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return fut

    async def _compile_then_run(self, fut: Future, program: Program, avals: list[Aval],
                                options: CallOptions, owner: str | None, runtime: Runtime,
                                inputs: list[Arg], timeout_s: float | None) -> None:
        try:
            lookup = await self.compile(program, avals, options, owner, runtime)
            exe = lookup.executable
            exe.check_inputs(avals)
            _check_outputs(fut, exe)
            self._executor.admit(exe)
        except asyncio.CancelledError:  # shutdown
            self._executor.drop(inputs)
            raise
        except Exception as e:  # noqa: BLE001 - every refusal becomes the future's error
            self._executor.drop(inputs)
            if not fut.status.is_final:
                code, message, extra = _failure(e)
                self._futures.fail(fut, code, message, **extra)
            return
        if fut.status.is_final:  # cancelled while it compiled
            self._executor.drop(inputs)
            return
        self._futures.compiled(fut, lookup.executable_id, exe.out_tree, lookup.compile_seconds,
                               str(lookup.tier))
        self._executor.submit(fut, runtime, program, exe, options, inputs, timeout_s)

    async def put(self, arrays: Sequence[Any], owner: str | None) -> Future:
        """A done future whose outputs are ``arrays``, kept on a runtime."""
        host = []
        for i, a in enumerate(arrays):
            if not isinstance(a, np.ndarray):
                raise BadRequest(f"arrays[{i}] must be an array {{dtype, shape, data}}, "
                                 f"got {_describe(a)}")
            host.append(a)
        fut = self._futures.create(owner=owner, executable_id="",
                                   out_avals=[host_aval(a) for a in host], out_tree=None)
        fut.tier = "put"
        self._transferred(_host_bytes(host))
        try:
            await self._executor.put(fut, self._runtimes.place(owner, secrets.token_hex(4)), host)
        except RemoteError as e:
            self._futures.delete(fut)
            raise RuntimeRefusal(_code(e.code), f"keeping the arrays on the device failed: "
                                                f"{e}") from None
        return fut

    async def outputs(self, fut: Future, which: Sequence[int] | None = None) -> list[np.ndarray]:
        """The outputs of a done future on the host (``which``: those only, in that
        order), counted as sent out; they stay on their runtime as well.

        Small outputs came with the run's answer; big ones are fetched from their
        runtime. ``NotFound`` for a released output, ``FutureFailed`` (its cause
        naming the runtime's code) when they are gone with their runtime.
        """
        if fut.outputs is None:
            raise NotFound(f"future {fut.future_id}'s outputs were released")
        which = range(len(fut.outputs)) if which is None else which
        buffers = [fut.outputs[k] for k in which]
        released = [k for k, buf in zip(which, buffers) if buf is None]
        if released:
            raise NotFound(f"output {released[0]} of future {fut.future_id} was released")
        # A copy: a sibling released while the rest is fetched leaves ``fut.host``.
        known: list[Any] = list(fut.host) if fut.host is not None else [None] * len(fut.outputs)
        missing = [k for k in which if known[k] is None]
        try:
            fetched = dict(zip(missing, await self._runtimes.fetch(
                [fut.outputs[k] for k in missing]))) if missing else {}
        except RemoteError as e:
            raise FutureFailed(f"future {fut.future_id}'s outputs are gone: {e}",
                               cause={"code": e.code, "message": str(e)}) from None
        host = [fetched[k] if known[k] is None else known[k] for k in which]
        self._metrics.transferred("out", sum(a.nbytes for a in host))
        return host

    def _transferred(self, nbytes: int) -> None:
        self._metrics.transferred("in", nbytes)

    async def close(self) -> None:
        """Stop the compiles in progress (shutdown)."""
        await self.batcher.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _place(self, owner: str | None, program: Program, args: Sequence[Arg]) -> Runtime:
        """Callers by API key; without keys, where the first input future lives (its data
        moves no further) if that runtime has the devices the program takes, else by
        program."""
        if owner is None:
            for arg in args:
                runtime = (arg.runtime if isinstance(arg, Buffer) else
                           arg.future.runtime if isinstance(arg, FutureRef) else None)
                if runtime is not None:
                    if runtime.group.size >= program.nr_devices:
                        return runtime
                    break
        return self._runtimes.place(owner, program.program_id, program.nr_devices)

    def _resolve(self, args: Sequence[Any], owner: str | None
                 ) -> tuple[list[Arg], list[Aval], dict[str, Future]]:
        """The arguments as what the executor takes, their avals, and the futures they
        name by id (each looked up once: a model's leaves are one future's outputs)."""
        inputs: list[Arg] = []
        avals: list[Aval] = []
        deps: dict[str, Future] = {}
        for i, arg in enumerate(args):
            if isinstance(arg, np.ndarray):
                inputs.append(arg)
                avals.append(host_aval(arg))
                continue
            if not wire.is_future_ref(arg):
                raise BadRequest(f"args[{i}] must be an array {{dtype, shape, data}} or a "
                                 f"future reference {{future, output}}, got {_describe(arg)}")
            future_id, k = arg["future"], arg["output"]
            dep = deps.get(future_id)
            if dep is None:
                dep = deps[future_id] = self._futures.get(future_id, owner)
            inputs.append(_output_of(dep, k, i))
            avals.append(dep.out_avals[k])
        return inputs, avals, deps

    def known(self) -> list[RemoteExecutable]:
        """The executables this process has looked up (the catalog's local listing)."""
        return self._index.values()

    async def text(self, executable_id: str, owner: str | None) -> str | None:
        """Executable ``executable_id``'s optimized HLO, as XLA prints it, from a runtime
        of ``owner``'s that holds it or loads it by id (a sharded one, on as many
        devices as it takes), else from another that does; ``None`` when none has it."""
        devices = next((int(e.meta.get("device_count", 1)) for e in self._index.values()
                        if e.executable_id == executable_id), 1)
        first = self._runtimes.place(owner, executable_id, devices)
        for runtime in [first, *(r for r in self._runtimes.fitting(devices) if r is not first)]:
            try:
                reply = await runtime.request(Op.TEXT, TextRequest(executable_id=executable_id),
                                              timeout_s=self._lookup_timeout_s, retry=True)
            except RemoteError as e:
                raise RuntimeRefusal(_code(e.code), f"reading executable {executable_id} "
                                                    f"failed: {e}") from None
            text = reply.get("text")
            if isinstance(text, str):
                return text
        return None

    async def forget(self, executable_id: str) -> list[str]:
        """Drop ``executable_id`` wherever it is kept: every runtime's L1, the disk and
        Redis tiers (each runtime drops it from all), and this process's index, so the
        next call compiles it again. The tiers that held it (``index`` for this process's)."""
        replies = await self._runtimes.broadcast(Op.FORGET, ForgetRequest(executable_id=executable_id),
                                                 timeout_s=self._lookup_timeout_s)
        held = {tier for reply in replies for tier in reply.get("tiers", ())}
        if self._index.forget(executable_id):
            held.add("index")
        return sorted(held)


def _check_outputs(fut: Future, exe: RemoteExecutable) -> None:
    """The compiled outputs must be those the future announced (the program's)."""
    got = [(a.shape, a.dtype) for a in exe.out_avals]
    if got != [(a.shape, a.dtype) for a in fut.out_avals]:
        raise RuntimeRefusal(ErrorCode.COMPILER_ERROR,
                             f"the executable's outputs {[str(a) for a in exe.out_avals]} are "
                             f"not the program's {[str(a) for a in fut.out_avals]}")


def _code(code: str) -> ErrorCode:
    try:
        return ErrorCode(code)
    except ValueError:
        return ErrorCode.INTERNAL


def _failure(e: Exception) -> tuple[str, str, dict[str, Any]]:
    """The code, message and other fields a future fails with when its compile is refused."""
    if isinstance(e, ServiceError):
        return str(e.code), e.message, dict(e.extra)
    if isinstance(e, CompilerError):
        return str(e.code), str(e), {}
    log.exception("compiling for a future failed unexpectedly")
    return str(ErrorCode.COMPILER_ERROR), f"compiling failed: {type(e).__name__}: {e}", {}


def _lookup_of(reply: dict[str, Any]) -> Resolved:
    doc = reply["executable"]
    exe = RemoteExecutable.from_json(doc)
    return Resolved(exe, exe.executable_id, doc["tier"], float(doc["compile_seconds"]))


def _host_bytes(args: Sequence[Any]) -> int:
    """The bytes of the host arrays among ``args`` (the rest live on runtimes)."""
    return sum(a.nbytes for a in args if isinstance(a, np.ndarray))


def _output_of(dep: Future, k: int, i: int) -> Arg:
    """Argument ``i``, output ``k`` of ``dep``: its buffer once done, else a reference
    to it; refused if it cannot be read."""
    if not 0 <= k < len(dep.out_avals):
        raise BadRequest(f"args[{i}] asks for output {k} of future {dep.future_id}, "
                         f"which has {len(dep.out_avals)} outputs")
    if k in dep.released:
        raise BadRequest(f"args[{i}] refers to output {k} of future {dep.future_id}, "
                         "which was released")
    status = dep.status
    if status is FutureStatus.DONE and dep.outputs is not None:
        return dep.outputs[k]  # a buffer on its runtime: no transfer if we go there
    if status is FutureStatus.FAILED:
        msg, root = dep.failed_input(f"args[{i}] refers to future {dep.future_id}")
        raise FutureFailed(msg, root=root)
    if status is FutureStatus.CANCELLED:
        raise FutureCancelled(f"args[{i}] refers to future {dep.future_id}, which was cancelled")
    return FutureRef(dep, k)


def _describe(value: Any) -> str:
    if isinstance(value, dict):
        return f"a map with keys {sorted(map(str, value))[:8]}"
    return type(value).__name__


def _record_of(program: Program, lookup: Resolved, owner: str | None) -> CompileRecord:
    """What a lookup the index could not answer found: what compiled (or loaded), how long."""
    exe = lookup.executable
    reasons = (exe.meta.get("recompiled_because") if lookup.tier == TierName.COMPILED
               else None)
    return CompileRecord(time.time(), owner, program.program_id, program.name,
                         ", ".join(str(a) for a in exe.in_avals), str(lookup.tier),
                         lookup.compile_seconds, tuple(reasons) if reasons else None,
                         lookup.executable_id)
