"""One caller's runaway work never fails another's (issue 40), on real servers.

Endless loops fill a runtime's run slots; these tests check that a cheap call is
placed around them, that calls only queued behind them are sent again (not
failed) when a deadline stops the runtime, that a co-runner stopped with it says
so with its own code, that cancelling every loop stops them, and that ids of any
shape are refused as unknown, never as a server error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import jax
import numpy as np
import pytest
from e2e.conftest import _serve, metric_total, wait_ready
from jax import export, lax

from jitserve import wire

pytestmark = pytest.mark.timeout(240)


def _export(fn: Callable[..., Any]) -> bytes:
    spec = jax.ShapeDtypeStruct((), np.float32)
    return bytes(export.export(jax.jit(fn))(spec).serialize())


# Counts up until adding one no longer changes the float (2**24), then spins forever.
ENDLESS = _export(lambda x: lax.while_loop(lambda c: c > -1.0, lambda c: c + 1.0, x))


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Two runtimes of two run slots each, no API keys: calls are placed by program."""
    yield from _serve(tmp_path_factory.mktemp("runaway"), {
        "JITSERVE_RUNTIMES": "2", "JITSERVE_EXECUTOR_THREADS": "2",
        "JITSERVE_EXECUTION_TIMEOUT_S": "120"})


class Caller:
    def __init__(self, url: str, key: str | None = None) -> None:
        headers = {} if key is None else {"authorization": f"Bearer {key}"}
        self.http = httpx.Client(base_url=url, timeout=60, headers=headers)

    def upload(self, program: bytes) -> str:
        r = self.http.post("/v1/programs", content=program,
                           headers={"content-type": wire.OCTET_STREAM})
        assert r.status_code in (200, 201), r.text
        return str(r.json()["program_id"])

    def submit(self, pid: str, x: Any, **extra: Any) -> httpx.Response:
        return self.http.post(f"/v1/programs/{pid}/execute",
                              content=wire.packb({"args": [x], **extra}),
                              headers={"content-type": wire.MSGPACK})

    def execute(self, pid: str, x: Any, **extra: Any) -> str:
        r = self.submit(pid, np.float32(x) if isinstance(x, (int, float)) else x, **extra)
        assert r.status_code in (200, 202), r.text
        return str(r.json()["future_id"])

    def status(self, fid: str) -> str:
        return str(self.http.get(f"/v1/futures/{fid}").json()["status"])

    def wait_running(self, *fids: str) -> None:
        deadline = time.monotonic() + 60
        for fid in fids:
            while self.status(fid) != "running":
                assert time.monotonic() < deadline, f"{fid} never started"
                time.sleep(0.05)

    def final(self, fid: str, within_s: float = 60) -> dict[str, Any]:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            view = self.http.get(f"/v1/futures/{fid}", params={"wait": 1000}).json()
            if view["status"] in ("done", "failed", "cancelled"):
                return dict(view)
        pytest.fail(f"future {fid} still {view['status']} after {within_s} s")

    def value(self, fid: str) -> float:
        r = self.http.get(f"/v1/futures/{fid}/result", params={"wait": 60_000})
        assert r.status_code == 200, r.text
        return float(wire.unpackb(r.content)["outputs"][0])

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def caller(url: str) -> Iterator[Caller]:
    c = Caller(url)
    yield c
    c.close()


def _same_runtime_program(c: Caller, pid: str) -> tuple[str, float]:
    """A cheap program (``x * k``) that placement sends where ``pid``'s calls go (the
    hash of its id picks the same of the two runtimes), and its ``k``."""
    for k in range(2, 40):
        other = c.upload(_export(lambda x, k=k: x * np.float32(k)))
        if int(other[:8], 16) % 2 == int(pid[:8], 16) % 2:
            return other, float(k)
    pytest.fail("no program id with the same parity in 38 tries")


def test_a_cheap_call_goes_around_loops_that_fill_its_runtime(caller: Caller, url: str) -> None:
    endless = caller.upload(ENDLESS)
    cheap, k = _same_runtime_program(caller, endless)
    loops = [caller.execute(endless, i) for i in range(2)]
    caller.wait_running(*loops)
    # Its program's runtime has both run slots taken: it runs on the other one at once.
    assert caller.value(caller.execute(cheap, 3)) == 3 * k
    assert [caller.status(f) for f in loops] == ["running", "running"]
    for fid in loops:  # the last delete stops their runtime
        caller.http.delete(f"/v1/futures/{fid}")
    wait_ready(url)


def test_cancelling_every_loop_on_a_runtime_stops_it(caller: Caller, url: str) -> None:
    endless = caller.upload(ENDLESS)
    before = metric_total(url, 'jitserve_runtime_restarts_total{reason="cancel"}')
    loops = [caller.execute(endless, i) for i in range(2)]
    caller.wait_running(*loops)
    first = caller.http.delete(f"/v1/futures/{loops[0]}").json()
    # The other loop is the caller's too, but not cancelled yet: stopping would take it down.
    assert first["status"] == "running", first
    assert "1 other running execution" in first["detail"]
    second = caller.http.delete(f"/v1/futures/{loops[1]}").json()
    assert second == {"future_id": loops[1], "status": "cancelled"}
    runtimes = wait_ready(url)
    assert metric_total(url, 'jitserve_runtime_restarts_total{reason="cancel"}') == before + 1
    assert all(r["in_flight"] == 0 for r in runtimes), runtimes  # neither loop burns on


@pytest.mark.parametrize("bad", ["zz", "*", "%C3%A8", "g" * 64, "0x12", "-1"])
def test_ids_of_any_shape_are_unknown_not_a_server_error(caller: Caller, bad: str) -> None:
    for method, path in [("GET", f"/v1/programs/{bad}"), ("DELETE", f"/v1/programs/{bad}"),
                         ("POST", f"/v1/programs/{bad}/compile"),
                         ("POST", f"/v1/programs/{bad}/execute"),
                         ("GET", f"/v1/futures/{bad}"), ("GET", f"/v1/executables/{bad}")]:
        body = {"args": [1.0]} if path.endswith("execute") else {}
        r = caller.http.request(method, path, json=body if method == "POST" else None)
        assert r.status_code in (400, 404), (method, path, r.status_code, r.text)
        assert r.json()["error"]["code"] in ("not_found", "bad_request"), r.text


KEY = "runaway-key-0123456789"


@pytest.fixture(scope="module")
def one_runtime(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One runtime of two run slots, one API key with a 4 MiB device-bytes quota."""
    yield from _serve(tmp_path_factory.mktemp("one-runtime"), {
        "JITSERVE_API_KEYS": KEY, "JITSERVE_RUNTIMES": "1", "JITSERVE_EXECUTOR_THREADS": "2",
        "JITSERVE_EXECUTION_TIMEOUT_S": "120", "JITSERVE_TENANT_MAX_DEVICE_BYTES": str(4 << 20),
        "JITSERVE_MAX_BODY_BYTES": str(4 << 20)})


def test_runs_queued_behind_a_late_run_go_again(one_runtime: str) -> None:
    """One runtime, two run slots: a loop with a short deadline and one with a long
    one fill it, and cheap calls wait in its queue (a deleted one leaves it). The short deadline stops the
    runtime: that loop fails ``execution_timeout``, the other ``runtime_stopped``
    (stopped for another's sake, not crashed), and the cheap call, which never
    began, is sent again and is done."""
    url = one_runtime
    c = Caller(url, KEY)
    resent = metric_total(url, "jitserve_runs_resent_total")
    try:
        endless, double = c.upload(ENDLESS), c.upload(_export(lambda x: x * 2))
        assert c.value(c.execute(double, 1)) == 2  # compiled and cached before
        late = c.execute(endless, 0, timeout_s=5)
        beside = c.execute(endless, 1)
        c.wait_running(late, beside)
        queued = [c.execute(double, i) for i in range(3)]
        dropped = c.execute(double, 9)
        assert {c.status(f) for f in [*queued, dropped]} == {"pending"}  # no run slot free
        # A delete takes a queued call out of the runtime's queue: it never runs.
        assert c.http.delete(f"/v1/futures/{dropped}").json()["status"] == "cancelled"
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/readyz", timeout=10).json()["runtimes"][0]["in_flight"] != 5:
            assert time.monotonic() < deadline, "the deleted call stayed in the queue"
            time.sleep(0.05)
        assert c.final(late)["error"]["code"] == "execution_timeout"
        stopped = c.final(beside)["error"]
        assert stopped["code"] == "runtime_stopped", stopped
        assert "passed its deadline" in stopped["message"]
        assert [c.value(f) for f in queued] == [0, 2, 4]
        assert metric_total(url, "jitserve_runs_resent_total") == resent + 3
    finally:
        c.close()


def test_inputs_of_queued_calls_count_against_the_keys_device_bytes(one_runtime: str) -> None:
    """A key fills its runtime with loops, then queues calls with 1 MiB inputs: the
    server holds those bytes for it, so they count against its device-bytes quota
    (4 MiB) from the moment each call is accepted, and show in the gauge."""
    url = one_runtime
    wait_ready(url)  # back from the last test's stop
    c = Caller(url, KEY)
    try:
        n = (1 << 20) // 4
        total = c.upload(_export_1d(lambda x: x.sum(), n))
        endless = c.upload(ENDLESS)
        x = np.ones(n, np.float32)
        assert c.value(c.execute(total, x)) == n  # compiled before the runtime fills
        loops = [c.execute(endless, i) for i in range(2)]
        c.wait_running(*loops)
        queued = [c.execute(total, x) for _ in range(3)]
        refused = c.submit(total, x)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["quota"] == "device_bytes"
        assert metric_total(url, "jitserve_device_bytes_in_use") >= 3 << 20
        for fid in loops:  # the last delete stops the runtime; the queued calls go again
            c.http.delete(f"/v1/futures/{fid}")
        assert [c.value(f) for f in queued] == [n] * 3
        assert metric_total(url, "jitserve_device_bytes_in_use") < 1 << 20  # inputs let go
        assert c.value(c.execute(total, x)) == n
    finally:
        c.close()


def _export_1d(fn: Callable[..., Any], n: int) -> bytes:
    spec = jax.ShapeDtypeStruct((n,), np.float32)
    return bytes(export.export(jax.jit(fn))(spec).serialize())
