"""A cached call's short path: sent from ``Executor.submit`` and answered by the lane.

``Executor._send_now`` sends a run that has nothing to wait for straight from
``submit`` (no task); the others go through ``Executor._run`` as before. The
execute lane answers in front of the middleware stack, doing their part itself.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from jitserve import wire
from jitserve.service.calls.executor import TempBudget
from jitserve.service.calls.futures import FutureStore
from jitserve.service.metrics import Metrics

ROUTE = "/v1/programs/{program_id}/execute"


@pytest.fixture
def sends(api):
    """Whether each run ``submit`` saw was sent at once (``True``) or left to a task."""
    executor = api.app.services.executor
    send_now = executor._send_now
    seen: list[bool] = []

    def spy(*args):
        sent = send_now(*args)
        seen.append(sent)
        return sent

    executor._send_now = spy
    return seen


async def test_a_cached_call_is_sent_from_submit_without_a_task(api, x, sends) -> None:
    pid = await api.upload("add_mul")
    await api.execute(pid, [x, x], wait=30_000)  # compiles: the run follows in a task
    sends.clear()
    for _ in range(3):
        out = await api.outputs(pid, [x, x])
        np.testing.assert_array_equal(out[0], x + x)
        np.testing.assert_array_equal(out[1], x * 2)
    assert sends == [True, True, True]
    assert not api.app.services.executor._tasks
    assert api.app.services.executor._budget.in_flight == 0
    assert await api.metric("jitserve_execution_temp_bytes") == 0


async def test_a_call_on_a_running_future_waits_in_a_task(api, x, sends) -> None:
    add_mul, triple = await api.upload("add_mul"), await api.upload("triple")
    await api.execute(add_mul, [x, x], wait=30_000)
    await api.execute(triple, [x], wait=30_000)
    sends.clear()
    first = (await api.execute(add_mul, [x, x])).json()["future_id"]
    r = await api.execute(triple, [{"future": first, "output": 1}], wait=30_000)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], x * 6)
    # the second was sent at once only if the first had ended by then
    assert sends[0] is True and len(sends) == 2


async def test_an_input_left_on_the_runtime_is_sent_by_handle(api, x, sends) -> None:
    add_mul, triple = await api.upload("add_mul"), await api.upload("triple")
    await api.execute(triple, [x], wait=30_000)
    fid = wire.unpackb((await api.execute(add_mul, [x, x], wait=30_000)).content)["future_id"]
    sends.clear()
    r = await api.execute(triple, [{"future": fid, "output": 0}], wait=30_000)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], (x + x) * 3)
    assert sends == [True]


async def test_the_budget_takes_only_what_fits_and_wakes_waiters_when_given_back() -> None:
    futures = FutureStore(ttl_s=60, max_live=10, max_device_bytes=100)
    budget = TempBudget(futures, Metrics())
    assert budget.try_take(0) and budget.in_flight == 0
    assert budget.try_take(60) and budget.in_flight == 60
    assert not budget.try_take(60)  # would pass the limit beside the first
    waited = asyncio.Event()

    async def waiter() -> None:
        async with budget.hold(60):
            waited.set()

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0.05)
    assert not waited.is_set()
    assert not budget.try_take(1)  # someone waits: no overtaking
    budget.give(60)
    await asyncio.wait_for(task, 5)
    assert waited.is_set() and budget.in_flight == 0


async def test_the_lane_answers_an_unexpected_error_as_the_stack_would(api, x) -> None:
    pid = await api.upload("add_mul")
    before = await api.metric("jitserve_requests_total", route=ROUTE, status="500")

    async def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    api.app.services.calls.execute = broken
    r = await api.execute(pid, [x, x], wait=1000)
    assert r.status_code == 500
    assert r.json()["error"] == {"code": "internal", "message": "internal server error"}
    assert await api.metric("jitserve_requests_total", route=ROUTE, status="500") == before + 1


async def test_the_lane_counts_its_answers_by_route_and_status(api, x) -> None:
    pid = await api.upload("add_mul")
    before = await api.metric("jitserve_requests_total", route=ROUTE, status="200")
    for _ in range(2):
        assert (await api.execute(pid, [x, x], wait=30_000)).status_code == 200
    assert await api.metric("jitserve_requests_total", route=ROUTE, status="200") == before + 2


async def test_a_wait_that_times_out_leaves_the_other_waiters_waiting() -> None:
    store = FutureStore(ttl_s=60, max_live=10, max_device_bytes=1 << 20)
    fut = store.create(owner=None, executable_id="e", out_avals=[], out_tree=None)
    longer = asyncio.create_task(fut.wait_final(30))
    change = asyncio.create_task(fut.wait_change(fut.status, 30))
    assert await fut.wait_final(0.05) is False  # its timer wakes every waiter once
    await asyncio.sleep(0.05)
    assert not longer.done() and not change.done()  # they looked, and wait on
    store.mark_running(fut, 0.0)
    await asyncio.wait_for(change, 5)
    store.complete(fut, [], 0.0)
    assert await asyncio.wait_for(longer, 5) is True
    assert await fut.wait_final(0) is True


async def test_waits_given_up_leave_nothing_behind_and_a_change_wakes_the_rest() -> None:
    store = FutureStore(ttl_s=60, max_live=10, max_device_bytes=1 << 20)
    fut = store.create(owner=None, executable_id="e", out_avals=[], out_tree=None)
    for _ in range(50):  # long polls that time out on a future that does not change
        await fut.wait_change(fut.status, 0.001)
    cancelled = asyncio.create_task(fut.wait_final(30))
    waiting = [asyncio.create_task(fut.wait_final(30)) for _ in range(3)]
    await asyncio.sleep(0.01)
    cancelled.cancel()
    await asyncio.sleep(0.01)
    assert fut._waiters is not None and len(fut._waiters) == 3  # only those still waiting
    store.complete(fut, [], 0.0)
    assert await asyncio.wait_for(asyncio.gather(*waiting), 5) == [True] * 3
    assert fut._waiters is None


async def test_a_bug_in_sending_fails_the_future_instead_of_leaving_it_pending(api, x) -> None:
    pid = await api.upload("add_mul")
    await api.execute(pid, [x, x], wait=30_000)
    executor = api.app.services.executor

    def broken(*args):
        raise TypeError("a bug")

    executor._send_now = broken
    r = await api.execute(pid, [x, x], wait=30_000)
    assert r.status_code == 202  # accepted, then failed: the wait ends at once
    fid = r.json()["future_id"]
    error = (await api.result(fid)).json()["error"]
    assert error["code"] == "future_failed" and "TypeError" in error["message"]
    assert executor._budget.in_flight == 0


async def test_an_input_of_64_kib_goes_by_shared_memory_in_one_segment_reused(api, sends) -> None:
    """``frames.SHARED_FROM_BYTES``: a training step's batch goes to the runtime in a
    segment, not through the pipe, still sent at once; the segment comes back when
    the run has answered, and the next call takes it again."""
    pid = await api.upload("plus1")
    v = np.arange(1 << 14, dtype=np.float32)  # 64 KiB
    assert (await api.execute(pid, [v], wait=30_000)).status_code == 200
    segments = api.app.services.runtimes.segments
    small = {s.name for s in segments._free if s.size < 1 << 20}
    assert small  # the first call's, given back
    sends.clear()
    for k in range(5):
        out = await api.outputs(pid, [v + k])
        np.testing.assert_array_equal(out[0], v + k + 1)
    assert sends == [True] * 5
    assert {s.name for s in segments._free if s.size < 1 << 20} == small  # reused, no more
