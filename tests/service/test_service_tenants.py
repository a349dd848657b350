"""Tenants in process: the one-tenant server without keys, the fair compile scheduler,
the compile budget and the future store's per-owner limits.

The cross-tenant 404s and the quotas against real servers are in
tests/e2e/test_tenants_e2e.py.
"""

from __future__ import annotations

import asyncio
import os
import threading

import jax
import numpy as np
import pytest
from jax import export

from jitserve.compiler.errors import LimitExceeded
from jitserve.service.calls.futures import FutureStore
from jitserve.service.calls.quotas import CompileBudget, QuotaExceeded, Quotas
from jitserve.service.calls.scheduler import FairScheduler
from jitserve.service.calls.tenants import Tenants
from jitserve.service.settings import Settings
from jitserve.wire import Aval

pytestmark = pytest.mark.timeout(120)

OCTET = {"content-type": "application/octet-stream"}
ALICE, BOB = "alice-key-0123456789", "bob-key-0123456789"


def _unique_program(k: float) -> bytes:
    """x * k on float32[2, 3]: bytes no other test uploads."""
    spec = jax.ShapeDtypeStruct((2, 3), np.float32)
    return bytes(export.export(jax.jit(lambda x: x * np.float32(k)))(spec).serialize())


# -- without API keys: one tenant, as before -------------------------------------------------


async def test_without_keys_everything_is_one_tenant(make_api, x) -> None:
    data = _unique_program(7.25)
    async with make_api() as api:
        r = await api.http.post("/v1/programs", content=data, headers=OCTET)
        assert r.status_code == 201
        pid = r.json()["program_id"]
        assert (await api.http.post("/v1/programs", content=data, headers=OCTET)).status_code == 200
        run = await api.execute(pid, [x], wait=30_000)
        assert run.status_code == 200
        # The listing is the catalog's, unscoped.
        listed = (await api.http.get("/v1/executables")).json()["executables"]
        assert any(e["program_id"] == pid for e in listed)
        # DELETE forgets it until the next upload, which is then "new" again.
        assert (await api.http.delete(f"/v1/programs/{pid}")).json() == {
            "program_id": pid, "status": "deleted"}
        for method, path in [("GET", f"/v1/programs/{pid}"), ("DELETE", f"/v1/programs/{pid}")]:
            r = await api.http.request(method, path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
        assert (await api.execute(pid, [x])).status_code == 404
        assert (await api.http.post("/v1/programs", content=data, headers=OCTET)).status_code == 201
        assert (await api.http.delete("/v1/programs/" + "e" * 64)).status_code == 404


async def test_without_keys_no_quota_applies(make_api, x) -> None:
    # Tenant quotas set tiny are ignored without keys: only the totals count.
    async with make_api(tenant_max_live_futures=1, tenant_max_program_bytes=1,
                        tenant_max_executables=1) as api:
        pid = await api.upload("add_mul")
        await api.upload("triple")
        for _ in range(3):
            assert (await api.execute(pid, [x, x])).status_code in (200, 202)


# -- the fair scheduler ------------------------------------------------------------------------


class Gates:
    """Blocking calls that each wait for their own gate, and the order they started in."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self._gates: dict[str, threading.Event] = {}
        self._lock = threading.Lock()

    def call(self, name: str) -> str:
        gate = self._gates.setdefault(name, threading.Event())
        with self._lock:
            self.started.append(name)
        assert gate.wait(30), f"{name} was never let go"
        return name

    def open(self, name: str) -> None:
        self._gates.setdefault(name, threading.Event()).set()

    async def until_started(self, n: int) -> None:
        for _ in range(500):
            if len(self.started) >= n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"only {self.started} started")


async def test_a_tenant_cannot_hold_every_slot() -> None:
    sched, gates = FairScheduler(slots=2, per_tenant=1), Gates()
    slow = [asyncio.create_task(sched.run("a", gates.call, f"a{i}")) for i in range(3)]
    await gates.until_started(1)
    b = asyncio.create_task(sched.run("b", gates.call, "b0"))
    await gates.until_started(2)
    assert gates.started == ["a0", "b0"]  # b got the second slot, a's queue waits
    assert sched.running("a") == 1 and sched.waiting("a") == 2
    gates.open("b0")
    assert await b == "b0"
    assert not slow[0].done()  # b finished while a's first call still runs
    for name in ("a0", "a1", "a2"):
        gates.open(name)
    assert await asyncio.gather(*slow) == ["a0", "a1", "a2"]
    assert sched.running("a") == 0 and sched.waiting("a") == 0


async def test_waiters_are_served_round_robin_not_fifo() -> None:
    sched, gates = FairScheduler(slots=1, per_tenant=1), Gates()
    blocker = asyncio.create_task(sched.run("z", gates.call, "z"))
    await gates.until_started(1)
    tasks = [asyncio.create_task(sched.run(t, gates.call, f"{t}{i}"))
             for t, i in [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]]
    await asyncio.sleep(0.05)  # all queued behind z
    for name in ("z", "a0", "b0", "a1", "b1", "a2"):
        gates.open(name)
    await asyncio.gather(blocker, *tasks)
    assert gates.started == ["z", "a0", "b0", "a1", "b1", "a2"]


async def test_cancelled_callers_give_their_turn_and_slot_back() -> None:
    sched, gates = FairScheduler(slots=1, per_tenant=1), Gates()
    running = asyncio.create_task(sched.run("a", gates.call, "a0"))
    await gates.until_started(1)
    queued = asyncio.create_task(sched.run("b", gates.call, "b0"))
    await asyncio.sleep(0.05)
    queued.cancel()  # gave up while waiting: its turn goes
    running.cancel()  # gave up while running: the slot stays taken until the call ends
    await asyncio.gather(queued, running, return_exceptions=True)
    assert sched.waiting("b") == 0 and sched.running("a") == 1
    after = asyncio.create_task(sched.run("c", gates.call, "c0"))
    await asyncio.sleep(0.05)
    assert gates.started == ["a0"]
    gates.open("a0")
    gates.open("c0")
    assert await after == "c0"
    assert gates.started == ["a0", "c0"]


async def test_a_failing_call_frees_its_slot() -> None:
    sched = FairScheduler(slots=1, per_tenant=1)

    def boom() -> None:
        raise ValueError("no")

    with pytest.raises(ValueError):
        await sched.run("a", boom)
    assert await sched.run("a", lambda: 3) == 3


# -- the compile budget and the quotas' defaults --------------------------------------------------


def test_compile_budget_slides_and_refunds() -> None:
    now = [1000.0]
    budget = CompileBudget(2, clock=lambda: now[0])
    first = budget.reserve("a")
    now[0] += 10
    budget.reserve("a")
    with pytest.raises(QuotaExceeded) as e:
        budget.reserve("a")
    assert e.value.quota == "compiles_per_minute" and e.value.retry_after_s == 50
    assert e.value.extra == {"quota": "compiles_per_minute"}
    budget.reserve("b")  # another tenant has its own
    budget.give_back("a", first)  # a cache answered after all
    token = budget.reserve("a")
    assert budget.full("a")
    now[0] += 61
    assert not budget.full("a")
    budget.give_back("a", token)  # already out of the window: nothing to undo


def test_quota_defaults_share_the_totals_between_keys() -> None:
    keys = [f"key-{i}-0123456789" for i in range(4)]
    s = Settings(env="test", api_keys=keys, max_live_futures=100, max_device_bytes=4096,
                 l1_max_entries=10, programs_max_bytes=1 << 20)
    q = Quotas.from_settings(s, compile_workers=2)
    assert (q.live_futures, q.device_bytes, q.executables, q.program_bytes) == (25, 1024, 10, 1 << 20)
    assert q.compile_slots == 1 and q.compiles_per_minute == s.tenant_compiles_per_minute
    assert Quotas.from_settings(s, compile_workers=3).compile_slots == 2
    s = Settings(env="test", api_keys=keys, tenant_max_live_futures=7, tenant_compile_share=1.0)
    q = Quotas.from_settings(s, compile_workers=2)
    assert q.live_futures == 7 and q.compile_slots == 2
    # IFRT sessions: a fair share of the server's limit, which is, unset, as many as half
    # the host's memory holds at JITSERVE_IFRT_MAX_HOST_BYTES each (at least 4).
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    s = Settings(env="test", api_keys=keys, ifrt_max_host_bytes=memory // 40)
    assert s.ifrt_sessions_limit == 20 and Quotas.from_settings(s, 2).ifrt_sessions == 5
    assert Settings(env="test", ifrt_max_host_bytes=memory).ifrt_sessions_limit == 4
    s = Settings(env="test", api_keys=keys, ifrt_max_sessions=9, tenant_max_ifrt_sessions=3)
    assert s.ifrt_sessions_limit == 9 and Quotas.from_settings(s, 2).ifrt_sessions == 3
    assert Quotas.from_settings(Settings(env="test", api_keys=keys, ifrt_max_sessions=2),
                                2).ifrt_sessions == 1


def test_tenants_index_scopes_and_counts_program_bytes() -> None:
    quotas = Quotas(live_futures=1, device_bytes=1, compiles_per_minute=1, executables=1,
                    program_bytes=100, compile_slots=1)
    t = Tenants(quotas, scoped=True)
    assert t.claim_program("a", "p1", 60, stored_before=False)
    assert t.claim_program("b", "p1", 60, stored_before=True)  # new to b: 201
    assert not t.claim_program("a", "p1", 60, stored_before=True)  # a's re-upload: 200
    with pytest.raises(QuotaExceeded) as e:
        t.check_program_room("a", "p2", 50)
    assert e.value.quota == "program_bytes"
    t.claim_executable("a", "e1", "p1")
    with pytest.raises(QuotaExceeded):
        t.claim_executable("a", "e2", "p1")
    assert t.sees_executable("a", "e1") and not t.sees_executable("b", "e1")
    assert t.drop_program("a", "p1") and not t.drop_program("a", "p1")
    assert not t.sees_program("a", "p1") and t.sees_program("b", "p1")
    assert t.executables_of("a") == []  # the program's executables went with it
    assert t.claim_program("a", "p2", 50, stored_before=False)


# -- the future store's per-owner limits ---------------------------------------------------------


def test_future_store_limits_each_owner_apart() -> None:
    store = FutureStore(ttl_s=60, max_live=10, max_device_bytes=1 << 20, owner_max_live=2,
                        owner_max_device_bytes=100)
    avals = [Aval((2, 3), "float32")]  # 24 bytes
    made = [store.create(owner="a", executable_id="e", out_avals=avals, out_tree=None)
            for _ in range(2)]
    with pytest.raises(QuotaExceeded) as e:
        store.create(owner="a", executable_id="e", out_avals=avals, out_tree=None)
    assert e.value.quota == "live_futures"
    store.create(owner="b", executable_id="e", out_avals=avals, out_tree=None)
    store.create(owner=None, executable_id="e", out_avals=avals * 10, out_tree=None)  # no owner
    store.delete(made[0])
    assert store.live_of("a") == 1 and store.device_bytes_of("a") == 24
    with pytest.raises(QuotaExceeded) as e:
        store.create(owner="a", executable_id="e", out_avals=avals * 4, out_tree=None)
    assert e.value.quota == "device_bytes"
    with pytest.raises(LimitExceeded):  # more than the whole quota: retrying cannot help
        store.create(owner="a", executable_id="e", out_avals=avals * 5, out_tree=None)
    store.delete(made[1])
    assert store.live_of("a") == 0 and store.device_bytes_of("a") == 0
    assert store.device_bytes == 24 + 240
