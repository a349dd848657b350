"""Quick runs: a run whose executable ran here in under ``runtime_quick_run_ms`` last
time is done by the runtime thread that read it, before that thread reads again;
any other run hands the pipe to another thread first, so requests behind a long
run are answered while it runs. Real runtime processes; their ``stats`` answer
counts runs, and the runs done by the reader."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from jitserve import wire


async def _stats(api) -> dict:
    runtime = api.app.services.runtimes.runtimes[0]
    return await runtime.request("stats", {}, timeout_s=60)


async def test_runs_known_quick_are_done_by_the_reader(make_api, x) -> None:
    async with make_api(own_runtimes=True, runtime_quick_run_ms=60_000) as api:
        pid = await api.upload("add_mul")
        for _ in range(4):
            out = await api.outputs(pid, [x, x])
            np.testing.assert_array_equal(out[0], x + x)
            np.testing.assert_array_equal(out[1], x * 2)
        stats = await _stats(api)
    assert stats["runs"] == 4
    assert stats["quick_runs"] == 3  # the first was not known yet


async def test_no_run_is_quick_at_zero(make_api, x) -> None:
    async with make_api(own_runtimes=True, runtime_quick_run_ms=0) as api:
        pid = await api.upload("add_mul")
        for _ in range(3):
            assert (await api.execute(pid, [x, x], wait=30_000)).status_code == 200
        stats = await _stats(api)
    assert (stats["runs"], stats["quick_runs"]) == (3, 0)


async def test_requests_behind_a_long_run_are_answered_while_it_runs(api) -> None:
    """A run of an executable known to be long hands the pipe on before it runs.

    The first run (300 steps, some 50 ms) makes ``spin`` known to be long whatever
    ran before in this session's runtime: a warm-up of one step could leave it known
    quick, and then a run of 300 steps ended before ``_QuickWatch`` said ``started``
    for it, and this test's wait for ``running`` never ended (seen in CI)."""
    pid = await api.upload("spin")
    y = np.full((256, 256), 0.01, np.float32)
    assert (await api.execute(pid, [y, np.int32(300)], wait=60_000)).status_code == 200
    for _ in range(2):
        before = (await _stats(api))["runs"]
        fid = (await api.execute(pid, [y, np.int32(3000)])).json()["future_id"]
        while (status := (await api.http.get(f"/v1/futures/{fid}")).json()["status"]) == "pending":
            await asyncio.sleep(0.005)
        assert status == "running"
        stats = await _stats(api)  # read by another thread while the run goes on
        assert stats["runs"] == before
        assert (await api.http.get(f"/v1/futures/{fid}")).json()["status"] == "running"
        assert (await api.result(fid, wait=60_000)).status_code == 200
    assert (await _stats(api))["runs"] == before + 1


@pytest.mark.timeout(300)
async def test_many_quick_runs_of_big_messages_in_flight_all_end(make_api) -> None:
    """64 calls of 64 KiB in and out fill both pipes. The thread doing quick runs
    holds the pipe, so it must not wait to write while the API process's event
    loop waits to write to it (it did: a deadlock)."""
    async with make_api(own_runtimes=True, runtime_quick_run_ms=60_000,
                        executor_threads=1) as api:
        pid = await api.upload("plus1")
        v = np.arange(1 << 14, dtype=np.float32)
        assert (await api.execute(pid, [v], wait=60_000)).status_code == 200

        async def call(k: int) -> None:
            r = await api.execute(pid, [v + k], wait=120_000)
            assert r.status_code == 200, r.text
            np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], v + k + 1)

        for _ in range(3):
            await asyncio.gather(*(call(k) for k in range(64)))
        stats = await _stats(api)
    assert stats["quick_runs"] > 0


async def _known_quick(api, pid: str, y: np.ndarray) -> None:
    """Run ``spin`` twice with one step: then its executable is known to be quick."""
    for _ in range(2):
        assert (await api.execute(pid, [y, np.int32(1)], wait=60_000)).status_code == 200
    assert (await _stats(api))["quick_runs"] >= 1


async def test_a_quick_run_that_overruns_says_it_started(make_api) -> None:
    """A quick run sends no ``started``; one that runs long this time gets it said
    for it, so it turns ``running`` (and its deadline starts) while it runs."""
    async with make_api(own_runtimes=True, runtime_quick_run_ms=60_000) as api:
        pid = await api.upload("spin")
        y = np.full((256, 256), 0.01, np.float32)
        await _known_quick(api, pid, y)
        assert (await _stats(api))["quick_runs_overran"] == 0
        # about 0.7 s here: well past the watch's two looks, 50 ms apart
        fid = (await api.execute(pid, [y, np.int32(3000)])).json()["future_id"]
        seen = set()
        while (status := (await api.http.get(f"/v1/futures/{fid}")).json()["status"]) == "pending":
            await asyncio.sleep(0.002)
        seen.add(status)
        assert (await api.result(fid, wait=60_000)).status_code == 200
        assert seen == {"running"}
        assert (await _stats(api))["quick_runs_overran"] == 1


async def test_a_quick_run_that_hangs_still_meets_its_deadline(make_api) -> None:
    async with make_api(own_runtimes=True, runtime_quick_run_ms=60_000) as api:
        pid = await api.upload("spin")
        y = np.full((256, 256), 0.01, np.float32)
        await _known_quick(api, pid, y)
        r = await api.execute(pid, [y, np.int32(1 << 30)], timeout_s=1.0, wait=60_000)
        assert r.status_code == 202, r.text
        view = (await api.http.get(f"/v1/futures/{r.json()['future_id']}")).json()
        assert view["status"] == "failed" and view["error"]["code"] == "execution_timeout", view
