"""Dynamic batching: concurrent calls to one program run as one execution.

A caller opts a program in (``PUT /v1/programs/{id}/batching``, per API key) with
a ``max_batch_size`` (rows) and a ``max_delay_ms``, the way Triton's dynamic
batcher and Ray Serve's ``@serve.batch`` do. From then on, an execute of that
program whose arguments are all host arrays (no future references, no donation)
sharing one leading dimension waits here, up to ``max_delay_ms``, for calls with
the same static key and per-example avals (every dimension but the first). When
the delay passes or the rows reach ``max_batch_size``, the queued calls are
concatenated along axis 0 (plain numpy: this process never interprets a
program), padded up to a bucket (the next power of two, at most
``max_batch_size``) by repeating the last row, and run once. The bucket is the
batch's input shape, so a shape-polymorphic program compiles once per bucket,
through the usual lookup and caches (``Calls.compile``).

The runtime cuts every output along its leading axis (``op_run``'s ``split``) so
that each call's future holds buffers of its own: fetching, chaining, releasing
and the device-memory accounting see an ordinary future. A failed run fails
every member with the runtime's code; a call cancelled before its batch is sent
is left out of it, and one deleted later has its share freed when the run ends.
Everything else (future references, donation, a call with more rows than
``max_batch_size``, arguments that do not fit the program) runs unbatched, as
it would without batching.

Only a program whose rows are independent may be batched: the server cannot
tell, so opting in says so (docs/batching.md). It checks what it can: every
input must lead with one symbolic dimension (``jax.export`` with
``symbolic_shape("b, ...")``), and every output with that same dimension, the
other dimensions static; else the opt-in is refused (``422 not_batchable``).

The configuration lives in this process and, with Redis (several replicas), in
Redis too, per API key: another replica reads it there when a call comes, at most
every ``REFRESH_S`` seconds per program and key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol

import numpy as np
from starlette.concurrency import run_in_threadpool

from jitserve.compiler.errors import CompilerError
from jitserve.compiler.records import Program
from jitserve.wire import Aval, ErrorCode

from ..errors import ServiceError
from ..metrics import Metrics
from ..runtimes import RemoteError, Runtime, RuntimePool
from .executables import CallOptions, Resolved
from .executor import Executor, run_error
from .futures import Future, FutureStore

__all__ = ["Batcher", "BatchingConfig", "NotBatchable", "SharedConfigs", "batch_dimension"]

log = logging.getLogger("jitserve.batching")

MAX_BATCH_SIZE = 4096
MAX_DELAY_MS = 1000.0
# How stale a replica's copy of a shared configuration may be, in seconds.
REFRESH_S = 5.0
# Stacking this many bytes or more goes to a thread.
_STACK_IN_THREAD_BYTES = 1 << 20

Compile = Callable[[Program, Sequence[Aval], CallOptions, "str | None", Runtime],
                   Awaitable[Resolved]]


class SharedConfigs(Protocol):
    """Where replicas keep their callers' batching (``service.cluster.Ownership``)."""

    async def set_batching(self, owner: str | None, program_id: str,
                           config: dict[str, Any] | None) -> None: ...

    async def batching(self, owner: str | None, program_id: str) -> dict[str, Any] | None: ...


class NotBatchable(ServiceError):
    """A program whose signature cannot be batched (``422 not_batchable``)."""

    code = ErrorCode.NOT_BATCHABLE


@dataclasses.dataclass(frozen=True)
class BatchingConfig:
    """How one program's calls are batched.

    Attributes:
      max_batch_size: the most rows (summed leading dimensions) in one run.
      max_delay_ms: the longest the first call of a batch waits for others.
    """

    max_batch_size: int
    max_delay_ms: float

    def to_json(self) -> dict[str, Any]:
        return {"max_batch_size": self.max_batch_size, "max_delay_ms": self.max_delay_ms}

    def bucket(self, rows: int) -> int:
        """The rows a batch of ``rows`` is padded to: a power of two, at most the maximum."""
        return min(1 << max(rows - 1, 0).bit_length(), self.max_batch_size)


def batch_dimension(program: Program) -> str:
    """The symbolic leading dimension all of ``program``'s inputs and outputs share;
    ``NotBatchable`` naming why there is none."""
    if not program.in_avals:
        raise NotBatchable("the program takes no inputs: there is nothing to batch")
    first = program.in_avals[0].shape[:1]
    dim = first[0] if first else None
    if not isinstance(dim, str) or not dim.isidentifier():
        raise NotBatchable(
            f"input 0 is {program.in_avals[0]}: a batchable program's inputs lead with one "
            "symbolic dimension (export with jax.export.symbolic_shape('b, ...'))")
    _check_leading("input", program.in_avals, dim)
    if program.out_avals is None:
        raise NotBatchable("the program's output shapes are unknown before compiling (raw "
                           "StableHLO with dynamic dimensions); export it with jax.export")
    _check_leading("output", program.out_avals, dim)
    return dim


def _check_leading(what: str, avals: Sequence[Aval], dim: str) -> None:
    for i, aval in enumerate(avals):
        if not aval.shape or aval.shape[0] != dim:
            raise NotBatchable(f"{what} {i} is {aval}, which does not lead with the batch "
                               f"dimension {dim!r}; every input and output must")
        rest = aval.shape[1:]
        if not all(isinstance(d, int) for d in rest):
            raise NotBatchable(f"{what} {i} is {aval}: only its leading dimension may be "
                               "symbolic")


class _Member:
    """One call waiting in a batch; the ``Job`` of its future."""

    def __init__(self, future: Future, args: list[np.ndarray], rows: int) -> None:
        self.future = future
        self.args: list[np.ndarray] | None = args
        self.rows = rows
        self.sent = False
        self.cancelled = False

    def cancel(self) -> bool:
        if self.sent:
            return False
        self.cancelled = True
        self.args = None
        return True

    def stop(self) -> str | None:
        return ("it runs in one execution with other calls (dynamic batching), which "
                "stopping it would take down; its outputs are dropped when it ends")

    def unqueue(self) -> bool:  # its run is the batch's, which other calls share
        return False


@dataclasses.dataclass
class _Queue:
    """The calls waiting for one (owner, program, static key, timeout, example avals)."""

    program: Program
    owner: str | None
    options: CallOptions
    timeout_s: float | None
    config: BatchingConfig
    members: list[_Member] = dataclasses.field(default_factory=list)
    rows: int = 0
    timer: asyncio.TimerHandle | None = None


class Batcher:
    """Queues batchable calls and runs them in batches.

    Args:
      compile: ``Calls.compile`` (the lookup of a bucket's executable).
      runtimes, futures, executor, metrics: the server's.
      shared: the replicas' shared configurations (``service.cluster``), when Redis is
        configured; omitted, the configurations are this process's alone.
    """

    def __init__(self, compile: Compile, runtimes: RuntimePool, futures: FutureStore,
                 executor: Executor, metrics: Metrics, *,
                 shared: SharedConfigs | None = None,
                 scope: Callable[[str | None], str] = lambda owner: "") -> None:
        self._compile = compile
        self._scope = scope  # an owner's executables' scope (Tenants.scope)
        self._runtimes = runtimes
        self._futures = futures
        self._executor = executor
        self._metrics = metrics
        self._configs: dict[tuple[str | None, str], BatchingConfig] = {}
        self._queues: dict[tuple[Any, ...], _Queue] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._shared = shared
        self._checked: dict[tuple[str | None, str], float] = {}

    # -- configuration -----------------------------------------------------------

    def configure(self, owner: str | None, program: Program, config: BatchingConfig) -> None:
        """Batch ``owner``'s calls of ``program``; ``NotBatchable`` when it cannot be."""
        batch_dimension(program)
        self._configs[(owner, program.program_id)] = config

    def config(self, owner: str | None, program_id: str) -> BatchingConfig | None:
        return self._configs.get((owner, program_id))

    def unconfigure(self, owner: str | None, program_id: str) -> bool:
        """Stop batching; whether it was on (queued calls still run)."""
        return self._configs.pop((owner, program_id), None) is not None

    # -- shared with the other replicas (Redis) -----------------------------------

    async def store(self, owner: str | None, program: Program,
                    config: BatchingConfig | None) -> None:
        """Set (``None``: clear) ``owner``'s batching of ``program`` here and, with
        replicas, for all of them (each picks it up within ``REFRESH_S``)."""
        if config is not None:
            self.configure(owner, program, config)
        if self._shared is not None:
            await self._shared.set_batching(owner, program.program_id,
                                           None if config is None else config.to_json())
        if config is None:
            self.unconfigure(owner, program.program_id)
        self._checked[(owner, program.program_id)] = time.monotonic()

    async def refresh(self, owner: str | None, program_id: str, *, force: bool = False) -> None:
        """Bring ``owner``'s batching of ``program_id`` up to what the replicas share, at
        most every ``REFRESH_S`` (a call's extra cost: one Redis read now and then)."""
        if self._shared is None:
            return
        key = (owner, program_id)
        now = time.monotonic()
        if not force and now - self._checked.get(key, -REFRESH_S) < REFRESH_S:
            return
        self._checked[key] = now
        try:
            doc = await self._shared.batching(owner, program_id)
        except Exception as e:  # noqa: BLE001 - Redis down: keep what this replica knows
            log.warning("reading the shared batching of %s failed: %s", program_id[:12], e)
            return
        if doc is None:
            self._configs.pop(key, None)
        else:
            self._configs[key] = BatchingConfig(int(doc["max_batch_size"]),
                                                float(doc["max_delay_ms"]))

    # -- calls -------------------------------------------------------------------

    def offer(self, program: Program, args: Sequence[Any], static_key: str, owner: str | None,
              timeout_s: float | None) -> Future | None:
        """The future of a call queued for a batch, or ``None`` when it is not batched
        (not opted in, or arguments that a batch cannot take): run it as usual."""
        config = self._configs.get((owner, program.program_id))
        if config is None:
            return None
        rows = _rows(program, args, config.max_batch_size)
        if rows is None:
            return None
        assert program.out_avals is not None  # batch_dimension checked
        out_avals = [Aval((rows, *a.shape[1:]), a.dtype, a.weak_type) for a in program.out_avals]
        future = self._futures.create(owner=owner, executable_id="", out_avals=out_avals,
                                      out_tree=program.out_tree,
                                      input_bytes=sum(a.nbytes for a in args
                                                      if isinstance(a, np.ndarray)))
        member = _Member(future, list(args), rows)
        future.job = member
        examples = tuple((a.shape[1:], a.dtype.str) for a in args)
        key = (owner, program.program_id, static_key, timeout_s, examples)
        queue = self._queues.get(key)
        if queue is not None and queue.rows + rows > config.max_batch_size:
            self._flush(key)
            queue = None
        if queue is None:
            options = CallOptions(static_key, scope=self._scope(owner))
            queue = self._queues[key] = _Queue(program, owner, options, timeout_s, config)
            delay = config.max_delay_ms / 1000
            queue.timer = asyncio.get_running_loop().call_later(delay, self._flush, key)
        queue.members.append(member)
        queue.rows += rows
        if queue.rows >= config.max_batch_size:
            self._flush(key)
        return future

    def _flush(self, key: tuple[Any, ...]) -> None:
        queue = self._queues.pop(key, None)
        if queue is None:
            return
        if queue.timer is not None:
            queue.timer.cancel()
        members = [m for m in queue.members if not m.cancelled]
        if not members:
            return
        for m in members:
            m.sent = True  # from here on, a cancel cannot take it out
        task = asyncio.get_running_loop().create_task(self._run(queue, members))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, queue: _Queue, members: list[_Member]) -> None:
        program, options = queue.program, queue.options
        rows = [m.rows for m in members]
        bucket = queue.config.bucket(sum(rows))
        try:  # from here every failure fails the members: none waits forever
            runtime = self._runtimes.place(queue.owner, program.program_id, program.nr_devices)
            for m in members:
                m.future.runtime = runtime
            host = await _stack([m.args for m in members if m.args is not None], bucket)
            for m in members:
                m.args = None
            avals = [Aval.of(a) for a in host]
            lookup = await self._compile(program, avals, options, queue.owner, runtime)
            exe = lookup.executable
            exe.check_inputs(avals)
            self._executor.admit(exe)
            for m in members:
                m.future.executable_id = lookup.executable_id
                m.future.out_tree = exe.out_tree
                m.future.timings.compile_s = lookup.compile_seconds
            run_s, pieces = await self._executor.run_split(
                runtime, program, exe, options, host, rows,
                [[a.nbytes for a in m.future.out_avals] for m in members], queue.timeout_s,
                on_started=lambda: self._started(members))
        except asyncio.CancelledError:  # shutdown
            self._fail(members, "unavailable", "the server shut down before the batch ran")
            raise
        except RemoteError as e:
            self._fail(members, *run_error(e))
            return
        except Exception as e:  # noqa: BLE001 - every refusal fails the members, none is lost
            self._fail(members, *_failure(e))
            return
        self._metrics.batch_calls.observe(len(members))
        self._metrics.batch_rows.observe(sum(rows))
        for m, piece in zip(members, pieces):
            self._settle(m.future, piece.buffers, piece.values, run_s)

    def _started(self, members: list[_Member]) -> None:
        now = time.time()
        for m in members:
            self._futures.mark_running(m.future, max(now - m.future.created, 0.0))

    def _settle(self, fut: Future, outputs: list[Any], values: list[np.ndarray] | None,
                run_s: float) -> None:
        dead = next((b for b in outputs if not b.alive), None)
        if dead is not None:  # the runtime died (or is being stopped) right after answering
            lost = dead.lost()
            self._futures.fail(fut, lost.code, str(lost))
            return
        if values is not None:
            fut.host = values
        self._futures.complete(fut, outputs, run_s)

    def _fail(self, members: list[_Member], code: str, message: str) -> None:
        for m in members:
            m.args = None
            if not m.future.status.is_final:
                self._futures.fail(m.future, code, message)

    async def close(self) -> None:
        """Fail what is queued, stop the batches in progress (shutdown)."""
        for key in list(self._queues):
            queue = self._queues.pop(key)
            if queue.timer is not None:
                queue.timer.cancel()
            self._fail([m for m in queue.members if not m.cancelled], "unavailable",
                       "the server shut down before the batch ran")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _rows(program: Program, args: Sequence[Any], max_rows: int) -> int | None:
    """The leading dimension all ``args`` share, if they are host arrays that fit
    ``program`` and a batch; else ``None``."""
    if len(args) != len(program.in_avals) or not args:
        return None
    rows = None
    for arg, want in zip(args, program.in_avals):
        if not isinstance(arg, np.ndarray) or arg.ndim == 0 or not want.matches(Aval.of(arg)):
            return None
        if rows is None:
            rows = int(arg.shape[0])
        elif arg.shape[0] != rows:
            return None
    return rows if rows is not None and 1 <= rows <= max_rows else None


async def _stack(calls: list[list[np.ndarray]], bucket: int) -> list[np.ndarray]:
    """Each input of the calls, concatenated along axis 0 and padded to ``bucket`` rows."""
    nbytes = sum(a.nbytes for args in calls for a in args)
    if nbytes >= _STACK_IN_THREAD_BYTES:
        return await run_in_threadpool(_stack_now, calls, bucket)
    return _stack_now(calls, bucket)


def _stack_now(calls: list[list[np.ndarray]], bucket: int) -> list[np.ndarray]:
    out = []
    for parts in zip(*calls):
        rows = sum(p.shape[0] for p in parts)
        # Padding repeats the last row (real values: no NaNs or zero divisions in
        # rows nobody reads, which some programs would trip over).
        pad = [np.repeat(parts[-1][-1:], bucket - rows, axis=0)] if bucket > rows else []
        out.append(np.concatenate([*parts, *pad], axis=0))
    return out


def _failure(e: Exception) -> tuple[str, str]:
    """The code and message members fail with when their batch could not run."""
    if isinstance(e, ServiceError):
        return str(e.code), e.message
    if isinstance(e, CompilerError):
        return str(e.code), str(e)
    log.exception("a batched run failed unexpectedly")
    return str(ErrorCode.INTERNAL), f"the batched run failed: {type(e).__name__}: {e}"
