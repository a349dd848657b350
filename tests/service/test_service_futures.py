"""Futures: long-polling, cancellation, failure, TTL expiry and resource limits."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

import numpy as np
import pytest

from jitserve import wire
from jitserve.service.calls.futures import FutureStore
from jitserve.wire import FutureStatus

pytestmark = pytest.mark.timeout(60)


@contextlib.contextmanager
def executor_blocked(api) -> Iterator[asyncio.Event]:
    """Hold every execution before it is sent to its runtime until the event is set.

    Work submitted meanwhile stays queued: not started, so still cancellable.
    Runs that would be sent at once (``Executor._send_now``) take the queued path too.
    """
    gate = asyncio.Event()
    executor = api.app.services.executor
    marshal = executor._marshal
    executor._send_now = lambda *args: False

    async def held(job):
        await gate.wait()
        return await marshal(job)

    executor._marshal = held
    try:
        yield gate
    finally:
        gate.set()
        executor._marshal = marshal
        del executor._send_now


async def test_long_poll_returns_when_the_status_changes(make_api, x) -> None:
    async with make_api(executor_threads=1) as api:
        pid = await api.upload("add_mul")
        await api.execute(pid, [x, x], wait=30_000)  # compiled: later calls only queue
        with executor_blocked(api) as gate:
            fid = (await api.execute(pid, [x, x])).json()["future_id"]
            poll = asyncio.create_task(api.http.get(f"/v1/futures/{fid}", params={"wait": 20_000}))
            await asyncio.sleep(0.3)
            assert not poll.done()  # still pending: the poll waits
            released = time.monotonic()
            gate.set()
            status = (await poll).json()["status"]
            assert time.monotonic() - released < 2.0  # woken by the change, not the timeout
        assert status in ("running", "done")


async def test_long_poll_times_out_with_the_same_status(make_api, x) -> None:
    async with make_api(executor_threads=1) as api:
        pid = await api.upload("add_mul")
        await api.execute(pid, [x, x], wait=30_000)  # compiled: the next call starts pending
        with executor_blocked(api):
            fid = (await api.execute(pid, [x, x])).json()["future_id"]
            start = time.monotonic()
            r = await api.http.get(f"/v1/futures/{fid}", params={"wait": 300})
            assert 0.25 < time.monotonic() - start < 2.0
            assert r.json()["status"] == "pending"
            r = await api.http.get(f"/v1/futures/{fid}/result", params={"wait": 100})
            assert r.status_code == 409 and r.json()["error"]["code"] == "future_pending"


async def test_wait_is_capped_by_max_wait_ms(make_api, x) -> None:
    async with make_api(executor_threads=1, max_wait_ms=200) as api:
        pid = await api.upload("add_mul")
        with executor_blocked(api):
            start = time.monotonic()
            r = await api.execute(pid, [x, x], wait=60_000)
            assert r.status_code == 202
            assert time.monotonic() - start < 5.0


async def test_delete_cancels_a_queued_execution(make_api, x) -> None:
    async with make_api(executor_threads=1) as api:
        pid = await api.upload("add_mul")
        await api.execute(pid, [x, x], wait=30_000)  # compiled: the next call starts pending
        with executor_blocked(api):
            fid = (await api.execute(pid, [x, x])).json()["future_id"]
            assert (await api.http.get(f"/v1/futures/{fid}")).json()["status"] == "pending"
            r = await api.http.delete(f"/v1/futures/{fid}")
            assert r.status_code == 200
            assert r.json() == {"future_id": fid, "status": "cancelled"}
        await asyncio.sleep(0.1)
        assert (await api.http.get(f"/v1/futures/{fid}")).status_code == 404
        assert await api.metric("jitserve_executions_total", status="cancelled") == 1
        assert await api.metric("jitserve_executions_total", status="done") == 1  # the warm-up
        assert await api.metric("jitserve_device_bytes_in_use") == 2 * x.nbytes  # its outputs


async def test_a_cancelled_dependency_fails_its_dependents(make_api, x) -> None:
    async with make_api(executor_threads=1) as api:
        add_mul, triple = await api.upload("add_mul"), await api.upload("triple")
        await api.execute(add_mul, [x, x], wait=30_000)  # compiled: no status change
        await api.execute(triple, [x], wait=30_000)      # but the one the test waits for
        with executor_blocked(api):
            first = (await api.execute(add_mul, [x, x])).json()["future_id"]
            second = (await api.execute(triple, [{"future": first, "output": 0}])).json()
            await api.http.delete(f"/v1/futures/{first}")
            status = (await api.http.get(f"/v1/futures/{second['future_id']}",
                                         params={"wait": 5_000})).json()
        assert status["status"] == "failed"
        assert status["error"]["code"] == "future_cancelled"
        assert first in status["error"]["message"]
        r = await api.result(second["future_id"])
        assert r.status_code == 422
        err = r.json()["error"]
        assert err["code"] == "future_failed" and err["cause"]["code"] == "future_cancelled"
        # Referencing the gone future now is a plain 404.
        r = await api.execute(triple, [{"future": first, "output": 0}])
        assert r.status_code == 404


async def test_futures_expire_after_their_ttl(make_api, x) -> None:
    async with make_api(future_ttl_s=0.3, sweep_interval_s=0.05) as api:
        pid = await api.upload("add_mul")
        r = await api.execute(pid, [x, x], wait=30_000)
        fid = wire.unpackb(r.content)["future_id"]
        assert await api.metric("jitserve_device_bytes_in_use") == 48
        await asyncio.sleep(0.6)
        assert len(api.app.services.futures) == 0  # the sweeper took it
        assert (await api.http.get(f"/v1/futures/{fid}")).status_code == 404
        assert await api.metric("jitserve_device_bytes_in_use") == 0


async def test_expiry_is_checked_on_access_too(make_api, x) -> None:
    async with make_api(future_ttl_s=0.2, sweep_interval_s=3600) as api:
        pid = await api.upload("add_mul")
        fid = wire.unpackb((await api.execute(pid, [x, x], wait=30_000)).content)["future_id"]
        await asyncio.sleep(0.3)
        r = await api.http.get(f"/v1/futures/{fid}/result")
        assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


async def test_too_many_live_futures_is_429(make_api, x) -> None:
    async with make_api(max_live_futures=2) as api:
        pid = await api.upload("add_mul")
        fids = [(await api.execute(pid, [x, x])).json()["future_id"] for _ in range(2)]
        r = await api.execute(pid, [x, x])
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "too_many_requests"
        assert int(r.headers["retry-after"]) >= 1
        await api.http.delete(f"/v1/futures/{fids[0]}")
        assert (await api.execute(pid, [x, x])).status_code == 202


async def test_device_bytes_limit_is_429(make_api, x) -> None:
    # Each add_mul call holds 2 outputs of 24 bytes, and its 2 inputs of 24 bytes until
    # its run ends: 96 bytes to be accepted, 48 once done.
    async with make_api(max_device_bytes=150) as api:
        pid = await api.upload("add_mul")
        assert (await api.execute(pid, [x, x], wait=30_000)).status_code == 200
        assert (await api.execute(pid, [x, x], wait=30_000)).status_code == 200
        r = await api.execute(pid, [x, x])
        assert r.status_code == 429 and "Retry-After" in r.headers
        assert "device" in r.json()["error"]["message"]


async def test_outputs_bigger_than_the_device_limit_are_refused(make_api) -> None:
    async with make_api(max_device_bytes=1000) as api:
        pid = await api.upload("big")
        r = await api.execute(pid, [np.zeros(1 << 18, np.float32)])
        assert r.status_code == 422 and r.json()["error"]["code"] == "limit_exceeded"


async def test_store_ids_are_unguessable_and_owned() -> None:
    store = FutureStore(ttl_s=60, max_live=10, max_device_bytes=1 << 20)
    a = store.create(owner="alice", executable_id="e", out_avals=(), out_tree=None)
    b = store.create(owner=None, executable_id="e", out_avals=(), out_tree=None)
    assert len(a.future_id) == 32 and a.future_id != b.future_id  # 24 random bytes
    assert store.get(a.future_id, "alice") is a
    for owner in ("bob", None):
        with pytest.raises(Exception, match="no future"):
            store.get(a.future_id, owner)
    with pytest.raises(Exception, match="no future"):
        store.get(b.future_id, "alice")
    assert store.delete(a)[0] is FutureStatus.PENDING
    assert store.counts()["pending"] == 1


def _store(now: list[float], **limits: int) -> FutureStore:
    return FutureStore(ttl_s=100, max_device_bytes=1 << 20, clock=lambda: now[0],
                       **{"max_live": 1000, **limits})


def _new(store: FutureStore, owner: str | None = None):
    return store.create(owner=owner, executable_id="e", out_avals=(), out_tree=None)


def test_sweep_expires_exactly_the_futures_past_their_ttl() -> None:
    now = [0.0]
    store = _store(now)
    early = [_new(store) for _ in range(5)]
    now[0] = 50.0
    late = [_new(store, "alice") for _ in range(5)]
    store.complete(early[0], [], 0.0)  # finished at 50: lives until 150
    store.delete(early[1])
    now[0] = 120.0
    assert store.sweep() == 3  # early[2:]; early[0] got a fresh TTL, early[1] is gone
    assert {f.removed for f in early[2:]} == {"expired"} and early[0].removed is None
    assert store.sweep() == 0
    now[0] = 150.0
    assert store.sweep() == 6 and len(store) == 0
    assert all(f.removed == "expired" for f in late)


def test_a_running_future_outlives_its_ttl_until_it_ends() -> None:
    now = [0.0]
    store = _store(now)
    done_later, failed_later = _new(store), _new(store)
    for fut in (done_later, failed_later):
        store.mark_running(fut, 0.0)
    now[0] = 500.0
    assert store.sweep() == 0  # running: kept, however old
    store.complete(done_later, [], 1.0)  # a fresh TTL from its end
    store.fail_all("unavailable", "stopping")  # fails without a fresh TTL
    assert store.sweep() == 1 and failed_later.removed == "expired"
    now[0] = 599.0
    assert store.sweep() == 0
    now[0] = 600.0
    assert store.sweep() == 1 and done_later.removed == "expired"


def test_retry_after_is_the_wait_for_the_soonest_expiry() -> None:
    now = [0.0]
    store = _store(now, max_live=3, owner_max_live=2)
    first = _new(store)
    now[0] = 30.0
    _new(store, "alice")
    now[0] = 40.0
    _new(store, "alice")
    with pytest.raises(Exception, match="futures are alive") as refused:
        _new(store)
    assert refused.value.retry_after_s == 60  # first expires at 100: 60 s, the cap
    now[0] = 80.0
    with pytest.raises(Exception, match="futures are alive") as refused:
        _new(store)
    assert refused.value.retry_after_s == 20
    store.delete(first)
    with pytest.raises(Exception, match="live futures") as refused:
        _new(store, "alice")  # alice's quota: her first expires at 130
    assert refused.value.retry_after_s == 50


class _NoWalks(dict):
    """The store's futures, refusing to be walked."""

    def values(self):
        raise AssertionError("the store walked every future")

    def items(self):
        raise AssertionError("the store walked every future")

    def __iter__(self):
        raise AssertionError("the store walked every future")


def test_a_full_store_refuses_without_walking_its_futures() -> None:
    """At the limit every call sweeps and computes a Retry-After: neither may cost
    what is alive, or each refused call would cost the API process that much."""
    now = [0.0]
    store = _store(now, max_live=500, owner_max_live=10)
    for i in range(500):
        now[0] = i / 10
        _new(store, "alice" if i % 50 == 10 else None)
    store._futures = _NoWalks(store._futures)
    store._expiry._live = store._futures
    for of in store._expiry_of.values():
        of._live = store._futures
    now[0] = 50.0  # none has expired
    for owner, wait in ((None, 50), ("alice", 51)):
        with pytest.raises(Exception, match="alive|live futures") as refused:
            _new(store, owner)
        assert refused.value.retry_after_s == wait
    now[0] = 100.55
    assert store.sweep() == 6  # those created at 0 to 0.5 s


def test_expiry_bookkeeping_stays_proportional_to_what_is_alive() -> None:
    now = [0.0]
    store = _store(now)
    kept = [_new(store, "alice") for _ in range(10)]
    for i in range(5000):  # calls whose futures are deleted at once (keep=false)
        now[0] = i / 100
        store.delete(_new(store, "alice" if i % 2 else None))
        if i % 7 == 0:
            store.complete(kept[i % 10], [], 0.0)  # refreshed TTLs leave stale entries
    assert len(store._expiry._heap) <= 2 * len(store) + 64
    assert len(store._expiry_of["alice"]._heap) <= 2 * len(kept) + 64
    store.delete(kept[0])
    for fut in kept[1:]:
        store.delete(fut)
    assert store._expiry_of == {}  # an owner with nothing alive leaves nothing behind


def test_a_sharded_output_counts_its_device_bytes_until_released() -> None:
    """Issue 37: an output replicated on four devices holds four copies; the future
    counts them all against the device bytes, and gives them all back when released."""
    store = FutureStore(ttl_s=60, max_live=10, max_device_bytes=1 << 20)
    avals = (wire.Aval((4, 4), "float32"), wire.Aval((8,), "float32"))
    fut = store.create(owner=None, executable_id="e", out_avals=avals, out_tree=None,
                       out_bytes=(4 * 64, 32))
    assert store.device_bytes == 4 * 64 + 32
    store.complete(fut, [object(), object()], 0.0)
    store.release([(fut.future_id, 0)], None)
    assert store.device_bytes == 32
    store.release([(fut.future_id, 1)], None)
    assert store.device_bytes == 0
