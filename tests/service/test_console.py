"""The console's history (``service.console``) stays bounded and scoped, and its routes
answer from it (in-process, on the session's runtime).

The history is driven by a fake clock: buckets of seconds that wrap, rings that
drop the oldest, latency bins, and who sees what.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from jitserve.service.api.auth import owner_of
from jitserve.service.console import (
    COMPILES_KEPT,
    EXITS_KEPT,
    CompileRecord,
    Console,
    Viewer,
    key_label,
)
from jitserve.wire import FutureStatus

pytestmark = pytest.mark.timeout(120)

ALICE, BOB = owner_of("alice-key-0123456789"), owner_of("bob-key-0123456789")
ADMIN = Viewer(None, admin=True)


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@dataclasses.dataclass
class Fut:
    owner: str | None
    created: float
    tier: str = "memory"
    status: FutureStatus = FutureStatus.DONE
    error: dict[str, Any] | None = None


def _record(at: float, owner: str | None, program: str = "p" * 64, tier: str = "compiled",
            seconds: float = 0.5, because: tuple[str, ...] | None = None,
            error: dict[str, str] | None = None) -> CompileRecord:
    return CompileRecord(at, owner, program, "f", "float32[8]", tier, seconds, because,
                         "" if error else "e" * 64, error)


def test_calls_are_counted_per_second_with_their_latency_and_tier() -> None:
    clock = Clock()
    console = Console(window_s=60, clock=clock)
    for latency in (0.001, 0.002, 0.004, 0.1):
        console.call_finished(Fut(None, clock.now - latency))
    console.call_finished(Fut(None, clock.now - 0.01, tier="compiled"))
    console.call_finished(Fut(None, clock.now, tier="put"))  # an upload of arrays: no call
    console.call_finished(Fut(None, clock.now - 2.0, tier="pending", status=FutureStatus.FAILED,
                              error={"code": "execution_timeout", "message": "deadline"}))
    work = console.work(ADMIN, 10)
    assert work["step_s"] == 1 and len(work["points"]) == 10
    last = work["points"][-1]
    assert last["calls"] == 6 and last["errors"] == {"execution_timeout": 1}
    totals = work["totals"]
    assert totals["calls"] == 6 and totals["errors"] == {"execution_timeout": 1}
    # Bins are a tenth of a decade wide: each quantile is its bin's upper bound.
    assert 0.004 <= totals["p50_s"] <= 0.004 * 1.26
    assert 2.0 <= totals["p99_s"] <= 2.0 * 1.26
    tiers = console.tiers(ADMIN, 10)["totals"]
    assert tiers["tiers"] == {"memory": 4, "compiled": 1}  # failed while pending: no tier
    assert tiers["hit_rate"] == 0.8


def test_the_window_wraps_and_forgets_what_is_older() -> None:
    clock = Clock()
    console = Console(window_s=30, clock=clock)
    console.call_finished(Fut(None, clock.now))
    clock.now += 5
    console.call_finished(Fut(None, clock.now))
    console.call_finished(Fut(None, clock.now))
    assert console.work(ADMIN, 30)["totals"]["calls"] == 3
    assert console.work(ADMIN, 3)["totals"]["calls"] == 2
    clock.now += 27  # the first second is out of the window, and its bucket is reused
    console.call_finished(Fut(None, clock.now))
    assert console.work(ADMIN, 30)["totals"]["calls"] == 3
    clock.now += 30
    assert console.work(ADMIN, 30)["totals"]["calls"] == 0
    assert console.work(ADMIN, 10_000)["window_s"] == 30  # never past what is kept


def test_a_key_sees_its_own_calls_refusals_and_compiles_an_admin_all() -> None:
    clock = Clock()
    console = Console(window_s=60, clock=clock)
    console.call_finished(Fut(ALICE, clock.now))
    console.call_finished(Fut(BOB, clock.now))
    console.call_finished(Fut(BOB, clock.now, status=FutureStatus.FAILED, error={
        "code": "too_many_requests", "quota": "compiles_per_minute", "message": "quota"}))
    console.refused(ALICE, "too_many_requests", "live_futures")
    console.refused(None, "unauthorized")
    console.compiled(_record(clock.now, ALICE, "a" * 64))
    console.compiled(_record(clock.now, BOB, "b" * 64))
    alice, bob = Viewer(ALICE, admin=False), Viewer(BOB, admin=False)
    assert console.work(alice, 10)["totals"]["calls"] == 1
    assert console.work(alice, 10)["totals"]["errors"] == {"too_many_requests": 1}
    assert console.work(alice, 10)["totals"]["quota_refusals"] == [
        {"key": key_label(ALICE), "quota": "live_futures", "count": 1}]
    assert console.work(bob, 10)["totals"]["quota_refusals"] == [
        {"key": key_label(BOB), "quota": "compiles_per_minute", "count": 1}]
    everyone = console.work(ADMIN, 10)["totals"]
    assert everyone["calls"] == 3
    assert everyone["errors"] == {"too_many_requests": 2, "unauthorized": 1}
    assert len(everyone["quota_refusals"]) == 2
    assert [c["program_id"] for c in console.compiles(alice)["recent"]] == ["a" * 64]
    assert {c["program_id"] for c in console.compiles(ADMIN)["recent"]} == {"a" * 64, "b" * 64}
    assert console.compiles(alice)["recent"][0]["key"] == ALICE[:12]


def test_owners_past_the_cap_share_one_bucket_seen_by_admins_only() -> None:
    clock = Clock()
    console = Console(window_s=10, clock=clock)
    owners = [owner_of(f"key-{i}") for i in range(200)]
    for owner in owners:
        console.refused(owner, "bad_request")
    assert console.work(ADMIN, 10)["totals"]["errors"] == {"bad_request": 200}
    assert len(console._slots[int(clock.now) % 10]) <= 65  # 64 owners, and the rest
    late = Viewer(owners[-1], admin=False)  # counted with the others: not shown apart
    assert console.work(late, 10)["totals"]["errors"] == {}
    assert console.work(Viewer(owners[0], admin=False), 10)["totals"]["errors"] == {
        "bad_request": 1}


def test_compiles_and_exits_keep_only_the_newest() -> None:
    clock = Clock()
    console = Console(clock=clock)
    for i in range(COMPILES_KEPT + 50):
        clock.now += 1
        console.compiled(_record(clock.now, None, f"{i:064x}", seconds=i / 1000))
    doc = console.compiles(ADMIN, limit=10)
    assert doc["kept"] == COMPILES_KEPT
    assert doc["recent"][0]["program_id"] == f"{COMPILES_KEPT + 49:064x}"  # newest first
    assert len(doc["recent"]) == 10
    assert doc["slowest"][0]["seconds"] == (COMPILES_KEPT + 49) / 1000
    for i in range(EXITS_KEPT + 5):
        console.runtime_exited(i % 2, i, "crashed with SIGKILL", "runtime_crashed")
    assert len(console.exits()) == EXITS_KEPT
    assert console.exits()[0]["generation"] == EXITS_KEPT + 4
    assert console.last_exits()[1]["generation"] == EXITS_KEPT + 3


def test_the_most_recompiled_program_says_why_and_refusals_are_listed() -> None:
    clock = Clock()
    console = Console(clock=clock)
    console.compiled(_record(clock.now, None, "a" * 64))
    console.compiled(_record(clock.now + 1, None, "a" * 64,
                             because=("shape: arg 0 float32[8] -> float32[16]",)))
    console.compiled(_record(clock.now + 2, None, "b" * 64))
    console.compiled(_record(clock.now + 3, None, "a" * 64, tier="disk"))
    console.compiled(_record(clock.now + 4, None, "c" * 64, tier="failed",
                             error={"code": "compile_failed", "message": "x" * 5000}))
    doc = console.compiles(ADMIN)
    top = doc["most_recompiled"][0]
    assert top["program_id"] == "a" * 64 and top["compiles"] == 2
    assert top["recompiled_because"] == ["shape: arg 0 float32[8] -> float32[16]"]
    assert doc["failed"] == 1
    assert len(doc["recent"][0]["error"]["message"]) < 500  # a long message is cut


def test_sessions_are_read_from_their_server_and_scoped() -> None:
    console = Console()
    assert console.sessions(ADMIN) is None
    console.sessions_from(lambda: [{"session": "1", "owner": ALICE, "device_bytes": 64},
                                   {"session": "2", "owner": BOB, "device_bytes": 0}])
    mine = console.sessions(Viewer(ALICE, admin=False))
    assert mine == [{"session": "1", "key": ALICE[:12], "device_bytes": 64}]
    assert len(console.sessions(ADMIN) or []) == 2
    console.sessions_from(None)
    assert console.sessions(ADMIN) is None


# -- the routes, in process ---------------------------------------------------------------

async def test_the_routes_show_a_call_a_compile_and_a_refusal(make_api: Any,
                                                              x: np.ndarray) -> None:
    async with make_api() as api:
        pid = await api.upload("triple")
        await api.outputs(pid, [x])
        refused = await api.execute(pid, [x.astype(np.float64)])
        assert refused.status_code == 400
        work = (await api.http.get("/v1/console/work", params={"seconds": 60})).json()
        assert work["viewer"] == {"key": "none", "admin": True}
        assert work["totals"]["calls"] >= 1
        assert work["totals"]["errors"].get("signature_mismatch") == 1
        compiles = (await api.http.get("/v1/console/compiles")).json()
        assert any(c["program_id"] == pid and c["tier"] in ("compiled", "disk", "memory")
                   for c in compiles["recent"])
        devices = (await api.http.get("/v1/console/devices")).json()
        assert devices["runtimes"] and devices["devices"]
        assert "in_use" in devices["devices"][0]["memory"]
        sessions = (await api.http.get("/v1/console/sessions")).json()
        assert sessions == {"viewer": {"key": "none", "admin": True}, "enabled": False,
                            "sessions": []}
        bad = await api.http.get("/v1/console/work", params={"seconds": 100_000})
        assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_request"
        page = await api.http.get("/console")
        assert page.status_code == 200 and "/static/console.js" in page.text
        assert "default-src 'none'" in page.headers["content-security-policy"]
