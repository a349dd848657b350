"""Runs executions off the event loop and settles their futures.

``Executor.submit`` takes a compiled executable and its arguments: host arrays
(numpy, decoded from the request) or references to other futures' outputs. It
returns at once; a task then waits for the referenced futures (on the loop, no
polling), and a small thread pool puts host arrays on the device, runs, and
blocks until the outputs are ready. Referenced outputs are passed as the device
arrays they already are, so chaining moves no bytes through the host.

An execution that has not started yet can be cancelled (``Future`` deletion calls
``ExecutionJob.cancel``); one that is running always finishes.

Device memory: a future reserves its declared outputs in the ``FutureStore``, but
a run also allocates intermediates (XLA's temp buffers: a loop's carry, say) that
no output shows. Their size is known before the run (``Executable.memory``, XLA's
memory analysis). ``Executor.admit`` refuses, before any future exists, a call
whose intermediates and outputs exceed ``max_run_bytes``
(``JITSERVE_MAX_EXECUTION_BYTES``: 422 ``limit_exceeded``). While it runs, an
execution holds its temp bytes against the same device-bytes budget as the
futures' outputs (``TempBudget``); one that does not fit waits for running ones
to finish (one runs whenever none is running, so nothing waits for good).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import threading
import time
from collections.abc import AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np

from jitserve.compiler.compile import MemoryStats
from jitserve.compiler.errors import LimitExceeded, first_line
from jitserve.service.futures import Future, FutureStore
from jitserve.service.metrics import Metrics
from jitserve.wire import FutureStatus

__all__ = ["ExecutionJob", "Executor", "FutureRef"]


# Inputs of at least this many host bytes are freed before the program runs; for
# smaller ones the wait and the collection would cost more than they save.
_FREE_INPUTS_EARLY_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True)
class FutureRef:
    """Argument: output ``index`` of another ``future``, resolved when it is done."""

    future: Future
    index: int


Arg = np.ndarray | jax.Array | FutureRef


class _Cancelled(Exception):
    """The job was cancelled before its thread picked it up."""


class _DependencyFailed(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class ExecutionJob:
    """One queued execution: the handshake between cancel and start is under a lock."""

    def __init__(self, future: Future, executable: Any, args: Sequence[Arg]) -> None:
        self.future = future
        self.executable = executable
        self.args: list[Arg] | None = list(args)
        self.task: asyncio.Task[None] | None = None
        self._lock = threading.Lock()
        self._started = False
        self._cancelled = False

    def cancel(self) -> bool:
        """Cancel if not started yet; whether it was cancelled. Call on the event loop."""
        with self._lock:
            if self._started:
                return False
            self._cancelled = True
        self.args = None  # let go of the host arrays now
        if self.task is not None:
            self.task.cancel()
        return True

    def start(self) -> None:
        """Claim the job for a worker thread; ``_Cancelled`` if it was cancelled."""
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

    def _fits(self, nbytes: int) -> bool:
        used = self._futures.device_bytes + self.in_flight
        return self.in_flight == 0 or used + nbytes <= self._futures.max_device_bytes

    @contextlib.asynccontextmanager
    async def hold(self, nbytes: int) -> AsyncIterator[None]:
        """Count ``nbytes`` as in flight for the duration of the block."""
        if nbytes <= 0:
            yield
            return
        async with self._changed:
            await self._changed.wait_for(lambda: self._fits(nbytes))
            self._add(nbytes)
        try:
            yield
        finally:
            async with self._changed:
                self._add(-nbytes)
                self._changed.notify_all()

    def _add(self, nbytes: int) -> None:
        self.in_flight += nbytes
        self._metrics.execution_temp_bytes.set(self.in_flight)


class Executor:
    """A thread pool that runs executables on ``device`` and settles futures.

    Args:
      device: where inputs go and programs run (``compiler.device``).
      futures: the store whose futures this settles.
      metrics: where execution counts and timings go.
      threads: concurrent executions.
      max_run_bytes: the most device bytes (intermediates and outputs) one run may
        allocate; ``None``: the futures' ``max_device_bytes``.
    """

    def __init__(self, device: Any, futures: FutureStore, metrics: Metrics, threads: int,
                 *, max_run_bytes: int | None = None) -> None:
        self.device = device
        self.max_run_bytes = max_run_bytes or futures.max_device_bytes
        self._futures = futures
        self._metrics = metrics
        self._budget = TempBudget(futures, metrics)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="jitserve-exec")
        self._tasks: set[asyncio.Task[None]] = set()

    def admit(self, executable: Any) -> None:
        """Refuse a run that may never fit; call it before the run's future is created.

        ``LimitExceeded`` (422) when the intermediates and outputs of one run exceed
        ``max_run_bytes``: retrying cannot help. A run that fits the limit but not
        beside what others hold now waits for its turn (``TempBudget``).
        """
        mem: MemoryStats | None = getattr(executable, "memory", None)
        if mem is None or mem.run_bytes <= self.max_run_bytes:
            return  # without a memory analysis (backend), only outputs are counted
        raise LimitExceeded(
            f"one run of this program needs {mem.run_bytes:,} bytes of device memory "
            f"({_sizes(mem)}), over the limit of {self.max_run_bytes:,} bytes "
            "(JITSERVE_MAX_EXECUTION_BYTES)")

    def submit(self, future: Future, executable: Any, args: Sequence[Arg]) -> ExecutionJob:
        """Start running ``executable`` on ``args`` for ``future``; returns at once."""
        job = ExecutionJob(future, executable, args)
        future.job = job
        job.task = asyncio.get_running_loop().create_task(self._run(job))
        self._tasks.add(job.task)
        job.task.add_done_callback(self._tasks.discard)
        return job

    async def _run(self, job: ExecutionJob) -> None:
        fut = job.future
        memory: MemoryStats | None = getattr(job.executable, "memory", None)
        try:
            await self._resolve(job)
            loop = asyncio.get_running_loop()
            async with self._budget.hold(memory.temp_bytes if memory is not None else 0):
                outputs, run_s = await loop.run_in_executor(self._pool, self._work, job, loop)
        except (asyncio.CancelledError, _Cancelled):
            return  # the store already marked it cancelled
        except _DependencyFailed as e:
            self._futures.fail(fut, e.code, str(e))
        except Exception as e:  # the program failed on the device; the future says why
            self._futures.fail(fut, "future_failed", f"execution failed: {first_line(e)}")
        else:
            self._metrics.execute_seconds.observe(run_s)
            self._futures.complete(fut, outputs, run_s)

    async def _resolve(self, job: ExecutionJob) -> None:
        """Replace future references by the device arrays they name, waiting if needed."""
        assert job.args is not None
        for i, arg in enumerate(job.args):
            if isinstance(arg, FutureRef):
                await arg.future.wait_final()
                job.args[i] = _output_of(arg, i)

    def _work(self, job: ExecutionJob, loop: asyncio.AbstractEventLoop) -> tuple[list[Any], float]:
        """In a worker thread: transfer, run, and wait for the outputs."""
        job.start()
        fut, args = job.future, job.args
        job.args = None
        queued_s = max(time.time() - fut.created, 0.0)
        loop.call_soon_threadsafe(self._futures.mark_running, fut, queued_s)
        assert args is not None
        host_bytes = sum(a.nbytes for a in args if not isinstance(a, jax.Array))
        on_device = [a if isinstance(a, jax.Array) else jax.device_put(a, self.device) for a in args]
        del args
        if host_bytes >= _FREE_INPUTS_EARLY_BYTES:
            # Transfers are asynchronous: wait for them so the host copies are freed
            # before the outputs are allocated (peak memory 2x, not 3x, of a big input).
            jax.block_until_ready(on_device)
            # jax lets go of the host buffers from a runtime thread, which takes effect
            # at the next garbage collection (jax-ml/jax#14882). A young-generation
            # collection runs that hook cheaply, so big inputs are freed before the
            # outputs are allocated.
            gc.collect(0)
        t0 = time.perf_counter()
        outputs = job.executable.run(on_device)
        jax.block_until_ready(outputs)
        return list(outputs), time.perf_counter() - t0

    async def close(self) -> None:
        """Cancel what is queued and wait for running executions to end."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.to_thread(self._pool.shutdown, wait=True, cancel_futures=True)


def _sizes(mem: MemoryStats) -> str:
    alias = f" - {mem.alias_bytes:,} aliased to inputs" if mem.alias_bytes else ""
    return (f"{mem.temp_bytes:,} for intermediates + {mem.output_bytes:,} for outputs"
            f"{alias}")


def _output_of(ref: FutureRef, position: int) -> Any:
    """The device array ``ref`` names, or ``_DependencyFailed`` saying why there is none."""
    dep = ref.future
    where = f"args[{position}] refers to future {dep.future_id}"
    if dep.status is FutureStatus.DONE and dep.outputs is not None:
        return dep.outputs[ref.index]
    if dep.status is FutureStatus.FAILED:
        msg = (dep.error or {}).get("message", "")
        raise _DependencyFailed("future_failed", f"{where}, which failed: {msg}")
    if dep.status is FutureStatus.CANCELLED:
        raise _DependencyFailed("future_cancelled", f"{where}, which was cancelled")
    raise _DependencyFailed("future_expired", f"{where}, which was {dep.removed or 'removed'}")
