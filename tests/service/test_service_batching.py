"""The batch queue (``service.batching``) with a fake executor: no runtimes, no HTTP.

What goes into one run, when it runs, how it is padded and split, and how
cancels and failures reach every member.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from jitserve.compiler.records import Program
from jitserve.service.calls.batching import Batcher, BatchingConfig, NotBatchable, batch_dimension
from jitserve.service.calls.executables import CallOptions, RemoteExecutable, Resolved
from jitserve.service.calls.executor import SplitPiece
from jitserve.service.calls.futures import FutureStore
from jitserve.service.metrics import Metrics
from jitserve.service.runtimes import RemoteError
from jitserve.wire import Aval, FutureStatus, ProgramFormat

pytestmark = pytest.mark.timeout(30)


def _program(ins: Sequence[tuple[Any, ...]], outs: Sequence[tuple[Any, ...]] | None) -> Program:
    return Program("p" * 64, ProgramFormat.JAX_EXPORT, b"", tuple(Aval(s, "float32") for s in ins),
                   None if outs is None else tuple(Aval(s, "float32") for s in outs))


PROGRAM = _program([("b", 3), ("b",)], [("b", 3)])


class _Buffer:
    alive = True

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows


class _Runtime:
    index = 0


class _Pool:
    def place(self, owner: str | None, hint: str = "", devices: int = 1) -> _Runtime:
        return _Runtime()


class _Executor:
    """Runs a batch as ``x * s`` on the host, splitting as the runtime does."""

    def __init__(self) -> None:
        self.runs: list[list[int]] = []
        self.fail: RemoteError | None = None

    def admit(self, exe: RemoteExecutable) -> None:
        pass

    async def run_split(self, runtime: Any, program: Program, exe: RemoteExecutable,
                        options: CallOptions, host: list[np.ndarray], rows: Sequence[int],
                        out_nbytes: Any, timeout_s: float | None,
                        on_started: Any) -> tuple[float, list[SplitPiece]]:
        self.runs.append([len(host[0]), *rows])
        on_started()
        await asyncio.sleep(0)
        if self.fail is not None:
            raise self.fail
        y = host[0] * host[1][:, None]
        starts = np.cumsum([0, *rows[:-1]])
        return 0.001, [SplitPiece([_Buffer(y[a:a + n])], [y[a:a + n]])  # type: ignore[list-item]
                       for a, n in zip(starts, rows)]


@pytest.fixture
def parts() -> tuple[Batcher, _Executor, FutureStore, list[list[Aval]]]:
    futures = FutureStore(ttl_s=60, max_live=1000, max_device_bytes=1 << 30)
    executor = _Executor()
    compiled: list[list[Aval]] = []

    async def compile(program: Program, avals: Sequence[Aval], options: CallOptions,
                      owner: str | None, runtime: Any) -> Resolved:
        compiled.append(list(avals))
        exe = RemoteExecutable("e" * 64, tuple(avals), (Aval((avals[0].shape[0], 3), "float32"),),
                               None, None, {}, 0)
        return Resolved(exe, exe.executable_id, "memory", 0.0)

    batcher = Batcher(compile, _Pool(), futures, executor, Metrics())  # type: ignore[arg-type]
    return batcher, executor, futures, compiled


def _args(rows: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((rows, 3)).astype(np.float32),
            rng.standard_normal(rows).astype(np.float32)]


async def _settled(*futs: Any) -> None:
    for fut in futs:
        await asyncio.wait_for(fut.wait_final(), 5)


@pytest.mark.parametrize(("rows", "bucket"), [(1, 1), (2, 2), (3, 4), (5, 8), (33, 48),
                                              (48, 48)])
def test_buckets_are_powers_of_two_up_to_the_maximum(rows: int, bucket: int) -> None:
    assert BatchingConfig(48, 2).bucket(rows) == bucket


@pytest.mark.parametrize(("ins", "outs", "why"), [
    ([], [], "no inputs"),
    ([(4, 3)], [(4, 3)], "input 0"),
    ([("b", 3), ("n",)], [("b",)], "input 1"),
    ([("b", "n")], [("b",)], "only its leading"),
    ([("b", 3)], [(3,)], "output 0"),
    ([("b", 3)], None, "unknown before compiling"),
    ([("2*b", 3)], [("2*b",)], "input 0"),
])
def test_signatures_that_cannot_batch(ins: Any, outs: Any, why: str) -> None:
    with pytest.raises(NotBatchable, match=why):
        batch_dimension(_program(ins, outs))


def test_a_batchable_signature() -> None:
    assert batch_dimension(PROGRAM) == "b"


async def test_calls_wait_for_the_delay_then_run_once_padded(parts: Any) -> None:
    batcher, executor, futures, compiled = parts
    batcher.configure(None, PROGRAM, BatchingConfig(64, 20))
    calls = [_args(n, i) for i, n in enumerate((1, 2, 2))]
    futs = [batcher.offer(PROGRAM, a, "", None, None) for a in calls]
    assert all(f is not None and f.status is FutureStatus.PENDING for f in futs)
    await _settled(*futs)
    assert executor.runs == [[8, 1, 2, 2]]  # 5 rows, padded to 8
    assert [a.shape for a in compiled[0]] == [(8, 3), (8,)]
    for (x, s), fut in zip(calls, futs):
        assert fut.status is FutureStatus.DONE and fut.out_avals[0].shape == (len(x), 3)
        np.testing.assert_array_equal(fut.host[0], x * s[:, None])


async def test_a_full_batch_runs_at_once_and_the_next_starts(parts: Any) -> None:
    batcher, executor, _, _ = parts
    batcher.configure(None, PROGRAM, BatchingConfig(4, 1000))
    futs = [batcher.offer(PROGRAM, _args(n, n), "", None, None) for n in (3, 2, 2)]
    await _settled(*futs[:2])  # 3 + 2 > 4: the first ran alone; 2 + 2 filled the second
    assert executor.runs == [[4, 3], [4, 2, 2]]


async def test_calls_that_do_not_fit_are_not_batched(parts: Any) -> None:
    batcher, _, _, _ = parts
    batcher.configure(None, PROGRAM, BatchingConfig(4, 5))
    x, s = _args(2)
    assert batcher.offer(PROGRAM, [x, s[:1]], "", None, None) is None  # leading dims differ
    assert batcher.offer(PROGRAM, [x.astype(np.float64), s], "", None, None) is None
    assert batcher.offer(PROGRAM, _args(5), "", None, None) is None  # over max_batch_size
    assert batcher.offer(PROGRAM, [x, {"future": "f", "output": 0}], "", None, None) is None
    assert batcher.offer(PROGRAM, [x, s], "", "someone-else", None) is None  # not opted in


async def test_static_keys_and_owners_never_share_a_batch(parts: Any) -> None:
    batcher, executor, _, _ = parts
    batcher.configure(None, PROGRAM, BatchingConfig(64, 5))
    batcher.configure("k2", PROGRAM, BatchingConfig(64, 5))
    futs = [batcher.offer(PROGRAM, _args(1), key, owner, None)
            for key, owner in [("", None), ("a", None), ("", "k2"), ("", None)]]
    await _settled(*futs)
    assert sorted(len(r) - 1 for r in executor.runs) == [1, 1, 2]


async def test_a_cancelled_call_is_left_out(parts: Any) -> None:
    batcher, executor, futures, _ = parts
    batcher.configure(None, PROGRAM, BatchingConfig(64, 20))
    futs = [batcher.offer(PROGRAM, _args(n, n), "", None, None) for n in (1, 2, 3)]
    status, _ = futures.delete(futs[1])
    assert status is FutureStatus.CANCELLED
    await _settled(futs[0], futs[2])
    assert executor.runs == [[4, 1, 3]]
    assert futs[0].status is futs[2].status is FutureStatus.DONE


async def test_a_failed_run_fails_every_member(parts: Any) -> None:
    batcher, executor, _, _ = parts
    executor.fail = RemoteError("out_of_memory", "out of memory")
    batcher.configure(None, PROGRAM, BatchingConfig(64, 1))
    futs = [batcher.offer(PROGRAM, _args(1, i), "", None, None) for i in range(3)]
    await _settled(*futs)
    assert {f.status for f in futs} == {FutureStatus.FAILED}
    assert {f.error["code"] for f in futs} == {"out_of_memory"}


async def test_unconfigure_and_close(parts: Any) -> None:
    batcher, executor, _, _ = parts
    batcher.configure(None, PROGRAM, BatchingConfig(64, 1000))
    fut = batcher.offer(PROGRAM, _args(1), "", None, None)
    assert batcher.unconfigure(None, PROGRAM.program_id)
    assert batcher.config(None, PROGRAM.program_id) is None
    assert batcher.offer(PROGRAM, _args(1), "", None, None) is None
    await batcher.close()  # the queued call fails; nothing is lost silently
    assert fut.status is FutureStatus.FAILED and fut.error["code"] == "unavailable"
    assert executor.runs == []


class _Shared:
    """The replicas' store (``Ownership.set_batching``/``batching``) as a dict."""

    def __init__(self) -> None:
        self.docs: dict[tuple[str | None, str], dict[str, Any]] = {}
        self.reads = 0

    async def set_batching(self, owner: str | None, program_id: str,
                           config: dict[str, Any] | None) -> None:
        if config is None:
            self.docs.pop((owner, program_id), None)
        else:
            self.docs[(owner, program_id)] = config

    async def batching(self, owner: str | None, program_id: str) -> dict[str, Any] | None:
        self.reads += 1
        return self.docs.get((owner, program_id))


async def test_replicas_share_the_configuration() -> None:
    async def no_compile(*args: Any) -> Resolved:
        raise AssertionError("nothing runs here")

    shared = _Shared()
    here, there = (Batcher(no_compile, _Pool(), FutureStore(ttl_s=60, max_live=10,  # type: ignore[arg-type]
                                                            max_device_bytes=1 << 20),
                           _Executor(), Metrics(), shared=shared)
                   for _ in range(2))
    await here.store("k", PROGRAM, BatchingConfig(16, 3))
    assert shared.docs[("k", PROGRAM.program_id)] == {"max_batch_size": 16, "max_delay_ms": 3.0}
    await there.refresh("k", PROGRAM.program_id)
    assert there.config("k", PROGRAM.program_id) == BatchingConfig(16, 3)
    await there.refresh("k", PROGRAM.program_id)  # fresh enough: no second read
    assert shared.reads == 1
    await here.store("k", PROGRAM, None)
    assert here.config("k", PROGRAM.program_id) is None and not shared.docs
    await there.refresh("k", PROGRAM.program_id, force=True)
    assert there.config("k", PROGRAM.program_id) is None
