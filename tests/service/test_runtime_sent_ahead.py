"""Runs sent ahead (``runtimes.protocol``): a call whose input is an output of a call
already sent to the same runtime is sent at once, naming the handle that run
promised; the runtime runs it when that run has made it, with no round trip
through the API process between the two. Real runtime processes of the test's
own; their ``stats`` answer counts the runs that waited, the handles promised
and not made yet, and the failed ones not freed yet.

Each test holds a run going (``spin``, seconds long) while the calls it is about
are sent, and checks that it still was (the API process and the test share one
event loop, so what the store says between two awaits is what has happened)."""

from __future__ import annotations

import asyncio

import jax
import jax.numpy as jnp
import numpy as np

from jitserve import wire
from jitserve.wire import FutureStatus

Y = np.full((256, 256), 0.01, np.float32)
LONG = np.int32(8000)  # seconds of matmuls: room for a few requests meanwhile
# Some 50 ms, well over ``runtime_quick_run_ms``: after a run of it, ``spin`` is known
# to be long, so its next run hands the pipe on at once. After a warm-up of one step
# it could be known quick, and a long run would keep the pipe until it ended.
WARM = np.int32(300)


async def _stats(api) -> dict:
    return await api.app.services.runtimes.runtimes[0].request("stats", {}, timeout_s=60)


async def _start(api, pid: str, args: list, **extra) -> str:
    r = await api.execute(pid, args, **extra)
    assert r.status_code == 202, r.text
    return r.json()["future_id"]


async def _running(api, fid: str) -> None:
    while (status := (await api.http.get(f"/v1/futures/{fid}")).json()["status"]) == "pending":
        await asyncio.sleep(0.005)
    assert status == "running", status


def _status(api, fid: str) -> FutureStatus:
    return api.app.services.futures.get(fid, None).status


async def _behind_a_long_run(api) -> tuple[str, int, str]:
    """The ``spin`` program, the buffers its runtime holds once it has run, and the
    future of a long run of it, running."""
    pid = await api.upload("spin")
    await api.outputs(pid, [Y, WARM])
    held = (await _stats(api))["buffers"]
    blocker = await _start(api, pid, [Y, LONG])
    await _running(api, blocker)
    return pid, held, blocker


def _spin(y: np.ndarray, n: int) -> np.ndarray:
    return np.asarray(jax.jit(lambda x: jax.lax.fori_loop(
        0, n, lambda i, z: jnp.tanh(z @ z), x))(y))


async def test_a_call_on_a_running_call_s_output_is_sent_at_once_and_waits_there(make_api) -> None:
    async with make_api(own_runtimes=True) as api:
        pid = await api.upload("spin")
        await api.outputs(pid, [Y, WARM])
        before = await _stats(api)
        waited = await api.metric("jitserve_runtime_runs_waited_total")
        a = await _start(api, pid, [Y, np.int32(4000)])
        await _running(api, a)
        b = await _start(api, pid, [{"future": a, "output": 0}, np.int32(1)])
        # Both runs are in the runtime now: b's did not wait for a's answer.
        assert _status(api, a) is FutureStatus.RUNNING, "a ended too soon: a slow machine?"
        assert api.app.services.runtimes.runtimes[0].runs == 2
        assert _status(api, b) is FutureStatus.PENDING
        r = await api.result(b, wait=120_000)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(wire.unpackb(r.content)["outputs"][0],
                                   _spin(_spin(Y, 4000), 1), rtol=1e-5)
        ra = await api.result(a, wait=1)  # a's own outputs are there too
        np.testing.assert_allclose(wire.unpackb(ra.content)["outputs"][0], _spin(Y, 4000),
                                   rtol=1e-5)
        after = await _stats(api)
        assert await api.metric("jitserve_runtime_runs_waited_total") == waited + 1
    assert after["runs_waited"] == before["runs_waited"] + 1
    assert (after["promised"], after["failed_handles"]) == (0, 0)


async def test_calls_sent_ahead_on_a_cancelled_call_fail_naming_it(make_api) -> None:
    """One run at a time: ``a`` waits in the runtime's queue behind a long run, and a
    chain of calls there each for the one before's output. Deleting ``a`` takes it
    out of the queue; every call of the chain fails naming that first failure, in a
    message that does not grow with the chain (each link nested the one before's),
    and the long run is untouched."""
    async with make_api(own_runtimes=True, executor_threads=1) as api:
        pid, held, blocker = await _behind_a_long_run(api)
        a = await _start(api, pid, [Y, np.int32(1)])
        chain = [a]
        for _ in range(5):
            chain.append(await _start(api, pid, [{"future": chain[-1], "output": 0},
                                                 np.int32(1)]))
        r = await api.http.delete(f"/v1/futures/{a}")
        assert r.status_code == 200, r.text
        assert r.json()["status"] == "cancelled"
        assert _status(api, blocker) is FutureStatus.RUNNING, "too slow a machine?"
        said = ("args[0]: the call that makes it failed: future_cancelled: "
                "deleted while it waited to run")
        root = {"code": "future_cancelled", "message": "deleted while it waited to run"}
        for fid in chain[1:]:
            r = await api.result(fid, wait=120_000)
            assert r.status_code == 422, r.text
            error = r.json()["error"]
            assert (error["code"], error["message"]) == ("future_failed", said)
            assert error["cause"]["root"] == root, error
        # A call on the chain's end, once it failed, is refused naming the root once.
        r = await api.execute(pid, [{"future": chain[-1], "output": 0}, np.int32(1)])
        assert r.status_code == 422, r.text
        error = r.json()["error"]
        assert error["message"] == (f"args[0] refers to future {chain[-1]}, which failed: "
                                    "a call before it failed first: future_cancelled: "
                                    "deleted while it waited to run"), error
        assert error["root"] == root
        assert (await api.result(blocker, wait=120_000)).status_code == 200
        stats = await _stats(api)  # the frees of the chain's outputs ride on it
    assert (stats["promised"], stats["failed_handles"]) == (0, 0)
    assert stats["buffers"] == held + 1  # the blocker's output, and nothing else
    assert stats["runs_waited"] == 5  # the chain but a


async def test_a_chain_on_a_call_past_its_deadline_names_that_failure_once(make_api) -> None:
    """A long run past its deadline, and a chain of calls sent ahead behind it, each on
    the one before's output. The deadline stops the runtime; the chain goes back to
    waiting in the API process, and each of its calls fails there naming the run
    that began it (its future and its code), the same words down the chain."""
    async with make_api(own_runtimes=True, executor_threads=1) as api:
        pid = await api.upload("spin")
        await api.outputs(pid, [Y, WARM])
        first = await _start(api, pid, [Y, np.int32(10**8)], timeout_s=1)
        await _running(api, first)
        chain = [first]
        for _ in range(5):
            chain.append(await _start(api, pid, [{"future": chain[-1], "output": 0},
                                                 np.int32(1)]))
        r = await api.result(first, wait=120_000)
        assert r.status_code == 422, r.status_code
        timed_out = r.json()["error"]["cause"]
        assert timed_out["code"] == "execution_timeout", timed_out
        messages = []
        for fid in chain[1:]:
            r = await api.result(fid, wait=120_000)
            assert r.status_code == 422, r.text
            error = r.json()["error"]["cause"]
            assert error["code"] == "future_failed", error
            assert error["root"] == {"future_id": first, **timed_out}, error
            messages.append(error["message"])
        assert messages[0] == f"args[0] refers to future {first}, which failed: " + \
            timed_out["message"]
        for fid, message in zip(chain[1:-1], messages[1:]):
            assert message == (f"args[0] refers to future {fid}, which failed: future "
                               f"{first} failed first: execution_timeout: "
                               f"{timed_out['message']}")


async def test_an_output_released_before_its_run_made_it_is_dropped_when_made(make_api) -> None:
    async with make_api(own_runtimes=True, executor_threads=1) as api:
        pid, held, blocker = await _behind_a_long_run(api)
        a = await _start(api, pid, [Y, np.int32(1)])  # queued there, its output promised
        fut_a = api.app.services.futures.get(a, None)  # the store forgets it: all released
        r = await api.http.post("/v1/futures/release",
                                json={"outputs": [{"future": a, "output": 0}]})
        assert r.status_code == 200, r.text
        assert _status(api, blocker) is FutureStatus.RUNNING, "too slow a machine?"
        assert (await _stats(api))["promised"] == 2  # the blocker's output, and a's
        assert (await api.result(blocker, wait=120_000)).status_code == 200
        while fut_a.status is not FutureStatus.DONE:  # a ran after the blocker
            await asyncio.sleep(0.005)
        stats = await _stats(api)
    assert stats["promised"] == 0
    assert stats["buffers"] == held + 1  # the blocker's; a's was dropped as it was made


async def test_calls_sent_ahead_go_again_when_their_runtime_is_lost_before_they_began(
        make_api) -> None:
    """``a`` (host inputs only) waits in the runtime's queue behind a long run; ``b``
    waits there for ``a``'s output, and ``c`` for ``b``'s, each donating it (so the
    callers hold neither ``a`` nor ``b``). The runtime is killed: the long run fails
    with it, ``a`` is sent again to the restarted runtime, and ``b`` and ``c`` go
    again behind it, on its new output, as if they had waited in the API process."""
    async with make_api(own_runtimes=True, executor_threads=1) as api:
        pid = await api.upload("spin")
        await api.outputs(pid, [Y, np.int32(1)], donate=[0])  # compiled so: b, c go at once
        _, _, blocker = await _behind_a_long_run(api)
        a = await _start(api, pid, [Y, np.int32(1)])
        b = await _start(api, pid, [{"future": a, "output": 0}, np.int32(1)], donate=[0])
        c = await _start(api, pid, [{"future": b, "output": 0}, np.int32(1)], donate=[0])
        runtime = api.app.services.runtimes.runtimes[0]
        assert runtime.runs == 4, "too slow a machine?"  # all four are in the runtime
        runtime.kill("cancel")
        r = await api.result(blocker, wait=120_000)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["cause"]["code"] == "runtime_stopped"
        r = await api.result(c, wait=120_000)
        assert r.status_code == 200, r.text
        np.testing.assert_allclose(wire.unpackb(r.content)["outputs"][0],
                                   _spin(_spin(_spin(Y, 1), 1), 1), rtol=1e-5)
        for fid in (a, b):  # donated: released
            assert (await api.result(fid, wait=1)).status_code == 404
        assert await api.metric("jitserve_runs_resent_total") == 3


async def test_a_call_sent_ahead_on_an_output_that_went_with_its_runtime_fails_naming_it(
        make_api) -> None:
    """Two runs at a time: a long run, and ``a``; ``c`` waits in the runtime for both
    their outputs. ``a`` ends, and its caller lets its output go (``c``'s run holds it
    there). The runtime is lost before ``c`` begins: ``a`` ended, so nothing makes its
    output again, and ``c`` cannot go again. It fails naming the loss; it failed
    ``future_expired``, "which was released", as if its caller had let go too soon."""
    async with make_api(own_runtimes=True, executor_threads=2) as api:
        add = await api.upload("add256")
        await api.outputs(add, [Y, Y])  # compiled: c goes at once
        pid, _, blocker = await _behind_a_long_run(api)
        a = await _start(api, pid, [Y, WARM * 10])
        c = await _start(api, add, [{"future": a, "output": 0},
                                    {"future": blocker, "output": 0}])
        runtime = api.app.services.runtimes.runtimes[0]
        assert _status(api, a) is not FutureStatus.DONE, "too slow a machine?"
        assert runtime.runs == 3  # all three are in the runtime: c was sent ahead
        while _status(api, a) is not FutureStatus.DONE:
            await asyncio.sleep(0.005)
        r = await api.http.post("/v1/futures/release",
                                json={"outputs": [{"future": a, "output": 0}]})
        assert r.status_code == 200 and r.json()["released"] == 1, r.text
        assert _status(api, c) is FutureStatus.PENDING, "too slow a machine?"
        runtime.kill("cancel")
        r = await api.result(c, wait=120_000)
        assert r.status_code == 422, r.text
        cause = r.json()["error"]["cause"]
        assert cause["code"] == "runtime_stopped", cause
