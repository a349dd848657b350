"""Calls that never wait for a compile, outputs released one by one, arrays put once.

Through the app in-process (httpx's ASGI transport) on the session's real runtime.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import numpy as np
import pytest

from jitserve import wire
from jitserve.service.runtimes import RuntimeLost, frames
from tests.service.test_service_futures import executor_blocked

# Valid and allowed, but XLA has no handler for it: it decodes, then fails to compile.
FAILS_TO_COMPILE = b"""
func.func public @main(%arg0: tensor<4xi32>) -> tensor<4xi32> {
  %0 = stablehlo.custom_call @AllocateBuffer(%arg0) : (tensor<4xi32>) -> tensor<4xi32>
  return %0 : tensor<4xi32>
}
"""


async def _status(api: Any, fid: str, wait: int = 0) -> dict[str, Any]:
    r = await api.http.get(f"/v1/futures/{fid}", params={"wait": wait} if wait else None)
    assert r.status_code == 200, r.text
    return r.json()


async def _final(api: Any, fid: str) -> dict[str, Any]:
    doc = await _status(api, fid)
    while doc["status"] not in ("done", "failed", "cancelled"):
        doc = await _status(api, fid, wait=10_000)
    return doc


async def _result(api: Any, fid: str, outputs: str | None = None) -> Any:
    params = {"wait": 10_000, **({"outputs": outputs} if outputs is not None else {})}
    return await api.http.get(f"/v1/futures/{fid}/result", params=params)


async def _release(api: Any, *refs: tuple[str, int]) -> dict[str, Any]:
    r = await api.http.post("/v1/futures/release", json={
        "outputs": [{"future": f, "output": k} for f, k in refs]})
    assert r.status_code == 200, r.text
    return r.json()


async def test_a_first_call_answers_compiling_and_runs_once_compiled(api, x) -> None:
    pid = await api.upload("add_mul")
    r = await api.execute(pid, [x, x])
    assert r.status_code == 202, r.text
    accepted = r.json()
    assert accepted["status"] == "compiling" and accepted["tier"] == "pending"
    assert accepted["out_avals"] == [{"shape": [2, 3], "dtype": "float32"}] * 2
    doc = await _final(api, accepted["future_id"])
    assert doc["status"] == "done" and doc["out_tree"] == {"tuple": [None, None]}
    assert doc["timings"]["compile_s"] >= 0
    # Known now: the next call goes straight to its run.
    again = (await api.execute(pid, [x, x])).json()
    assert again["status"] in ("pending", "running", "done") and again["executable_id"]


async def test_a_compile_error_arrives_as_the_futures_error(api) -> None:
    r = await api.http.post("/v1/programs", content=FAILS_TO_COMPILE,
                            params={"format": "stablehlo"},
                            headers={"content-type": "application/octet-stream"})
    assert r.status_code in (200, 201), r.text
    arg = np.arange(4, dtype=np.int32)
    r = await api.execute(r.json()["program_id"], [arg])
    assert r.status_code == 202 and r.json()["status"] == "compiling"
    doc = await _final(api, r.json()["future_id"])
    assert doc["status"] == "failed"
    assert doc["error"]["code"] == "compile_failed", doc
    res = await api.result(doc["future_id"])
    assert res.status_code == 422
    assert res.json()["error"]["cause"]["code"] == "compile_failed"
    assert await api.metric("jitserve_device_bytes_in_use") == 0


async def test_wrong_inputs_are_refused_before_a_future_exists(api, x) -> None:
    pid = await api.upload("add_mul")
    r = await api.execute(pid, [x, x.astype(np.float64)])
    assert r.status_code == 400 and r.json()["error"]["code"] == "signature_mismatch"
    assert await api.metric("jitserve_futures", state="compiling") == 0


async def test_deleting_a_compiling_future_cancels_it(api, x) -> None:
    pid = await api.upload("add_mul")
    fid = (await api.execute(pid, [x, x])).json()["future_id"]
    r = await api.http.delete(f"/v1/futures/{fid}")
    assert r.json()["status"] == "cancelled"
    await asyncio.sleep(0.5)
    assert await api.metric("jitserve_executions_total", status="done") == 0
    assert await api.metric("jitserve_device_bytes_in_use") == 0


async def test_outputs_are_released_one_by_one(api, x) -> None:
    pid = await api.upload("add_mul")
    await api.execute(pid, [x, x], wait=30_000)  # compiled
    fid = (await api.execute(pid, [x, x])).json()["future_id"]
    await _final(api, fid)
    held = await api.metric("jitserve_device_bytes_in_use")
    assert await _release(api, (fid, 0)) == {"released": 1, "unknown": 0}
    assert await api.metric("jitserve_device_bytes_in_use") == held - x.nbytes
    # The other output is still there, and can be fetched alone.
    r = await _result(api, fid, "1")
    assert r.status_code == 200, r.text
    (only,) = wire.unpackb(r.content)["outputs"]
    np.testing.assert_array_equal(only, x * 2)
    for which in ("0", None):  # the released one, alone or among all
        r = await _result(api, fid, which)
        assert r.status_code == 404 and "released" in r.json()["error"]["message"]
    r = await api.execute(await api.upload("triple"), [{"future": fid, "output": 0}])
    assert r.status_code == 400 and "released" in r.json()["error"]["message"]
    # The last output goes, and the future with it.
    assert await _release(api, (fid, 1), ("no-such-future", 0), (fid, 7)) == {
        "released": 1, "unknown": 2}
    assert (await api.http.get(f"/v1/futures/{fid}")).status_code == 404
    assert await api.metric("jitserve_device_bytes_in_use") == held - 2 * x.nbytes


async def test_a_released_input_stays_until_the_call_that_reads_it_has_run(make_api, x) -> None:
    async with make_api(executor_threads=1) as api:
        add_mul, triple = await api.upload("add_mul"), await api.upload("triple")
        await api.execute(add_mul, [x, x], wait=30_000)
        await api.execute(triple, [x], wait=30_000)
        with executor_blocked(api):
            first = (await api.execute(add_mul, [x, x])).json()["future_id"]
            second = (await api.execute(triple, [{"future": first, "output": 0}])).json()
            third = (await api.execute(triple, [{"future": first, "output": 1}])).json()
            # The client drops first's arrays before anything ran: nothing is cancelled.
            assert (await _release(api, (first, 0), (first, 1)))["released"] == 2
            assert (await api.http.get(f"/v1/futures/{first}")).status_code == 404
        for fut, want in ((second, (x + x) * 3), (third, x * 2 * 3)):
            r = await api.result(fut["future_id"], wait=30_000)
            assert r.status_code == 200, r.text
            np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], want)
        for fut in (second, third):
            await _release(api, (fut["future_id"], 0))
        await asyncio.sleep(0.1)
        # first's outputs went once both calls had read them; the warm-ups' remain.
        assert await api.metric("jitserve_device_bytes_in_use") == 3 * x.nbytes
        assert await api.metric("jitserve_executions_total", status="done") == 5


async def test_arrays_put_once_are_read_by_reference(api, x) -> None:
    r = await api.http.post("/v1/arrays", content=wire.packb({"arrays": [x, x + 1]}),
                            headers={"content-type": wire.MSGPACK})
    assert r.status_code == 201, r.text
    put = r.json()
    assert put["status"] == "done" and put["tier"] == "put"
    assert put["out_avals"] == [{"shape": [2, 3], "dtype": "float32"}] * 2
    pid = await api.upload("add_mul")
    refs = [{"future": put["future_id"], "output": k} for k in (0, 1)]
    r = await api.execute(pid, refs, wait=30_000)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], x + x + 1)
    r = await _result(api, put["future_id"], "1,0")
    got = wire.unpackb(r.content)["outputs"]
    np.testing.assert_array_equal(got[0], x + 1)
    np.testing.assert_array_equal(got[1], x)


async def test_big_arrays_put_come_back_whole(api) -> None:
    big = np.random.default_rng(0).standard_normal(1 << 20).astype(np.float32)  # 4 MiB
    r = await api.http.post("/v1/arrays", content=wire.packb({"arrays": [big]}),
                            headers={"content-type": wire.MSGPACK})
    assert r.status_code == 201, r.text
    fid = r.json()["future_id"]
    # Overwrite the segment the upload came through with another put first.
    other = await api.http.post("/v1/arrays", content=wire.packb({"arrays": [big * 0]}),
                                headers={"content-type": wire.MSGPACK})
    assert other.status_code == 201
    np.testing.assert_array_equal(wire.unpackb((await api.result(fid)).content)["outputs"][0],
                                  big)


@pytest.mark.parametrize("path,body,why", [
    ("/v1/arrays", {"arrays": []}, "arrays"),
    ("/v1/arrays", {"arrays": [{"future": "x", "output": 0}]}, "arrays[0]"),
    ("/v1/arrays", {"nope": 1}, "arrays"),
    ("/v1/futures/release", {"outputs": [{"future": "x"}]}, "output"),
    ("/v1/futures/release", {"outputs": [{"future": "x", "output": -1}]}, "output"),
    ("/v1/futures/release", [1, 2], "release request"),
])
async def test_bad_bodies_are_named(api, path: str, body: Any, why: str) -> None:
    r = await api.http.post(path, content=wire.packb(body),
                            headers={"content-type": wire.MSGPACK})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "bad_request" and why in r.json()["error"]["message"]


async def test_a_bad_outputs_selection_is_refused(api, x) -> None:
    pid = await api.upload("add_mul")
    fid = (await api.execute(pid, [x, x])).json()["future_id"]
    for which in ("a", "1,", "2", "-1"):
        r = await _result(api, fid, which)
        assert r.status_code == 400, (which, r.text)


async def _put(api: Any, *arrays: np.ndarray) -> str:
    r = await api.http.post("/v1/arrays", content=wire.packb({"arrays": list(arrays)}),
                            headers={"content-type": wire.MSGPACK})
    assert r.status_code == 201, r.text
    return r.json()["future_id"]


async def test_a_donated_input_is_consumed_and_released(api, x) -> None:
    pid = await api.upload("add_mul")
    state = await _put(api, x, x + 1)
    before = await api.metric("jitserve_device_bytes_in_use")
    out = await api.outputs(pid, [{"future": state, "output": 0},
                                  {"future": state, "output": 1}], donate=[0])
    np.testing.assert_array_equal(out[0], x + x + 1)
    np.testing.assert_array_equal(out[1], x * 2)
    # Donated: that output is gone for good (as a donated jax.Array is), the other stays.
    assert (await _result(api, state, "0")).status_code == 404
    np.testing.assert_array_equal(wire.unpackb((await _result(api, state, "1")).content)
                                  ["outputs"][0], x + 1)
    r = await api.execute(pid, [{"future": state, "output": 0}, x])
    assert r.status_code == 400 and "released" in r.json()["error"]["message"]
    # The donated input's bytes went back; the run's two outputs came.
    assert await api.metric("jitserve_device_bytes_in_use") == before - x.nbytes + 2 * x.nbytes


async def test_a_donated_input_another_call_holds_is_copied_for_the_run(make_api, x) -> None:
    async with make_api(executor_threads=1) as api:
        add_mul, triple = await api.upload("add_mul"), await api.upload("triple")
        await api.execute(triple, [x], wait=30_000)
        state = await _put(api, x)
        ref = {"future": state, "output": 0}
        with executor_blocked(api):  # both calls hold the buffer before either runs
            reads = (await api.execute(triple, [ref])).json()["future_id"]
            eats = (await api.execute(add_mul, [ref, x], donate=[0])).json()["future_id"]
        for fid, want in ((reads, x * 3), (eats, x + x)):
            r = await api.result(fid, wait=30_000)
            assert r.status_code == 200, r.text
            np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], want)


async def test_donating_a_host_array_or_nothing_known_is_fine(api, x) -> None:
    pid = await api.upload("add_mul")
    r = await api.execute(pid, [x, x], donate=[1], wait=30_000)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], x + x)
    r = await api.execute(pid, [x, x], donate=[2])
    assert r.status_code == 400 and "donate" in r.json()["error"]["message"]


async def test_a_fetch_keeps_the_small_output_it_has_while_a_sibling_is_released(api) -> None:
    """A step's loss came back with its run; its model is fetched from the runtime.
    A release of the loss while that fetch is on its way leaves the fetch whole (it
    read the loss before), and later fetches of the loss are refused."""
    pid = await api.upload("step")
    x = np.arange(1 << 18, dtype=np.float32) / (1 << 18)
    for _ in range(3):
        r = await api.execute(pid, [x])
        assert r.status_code in (200, 202), r.text
        fid = r.json()["future_id"]
        await _final(api, fid)
        fetched, released = await asyncio.gather(_result(api, fid, "0,1"), _release(api, (fid, 1)))
        assert fetched.status_code == 200, fetched.text
        model, loss = wire.unpackb(fetched.content)["outputs"]
        np.testing.assert_array_equal(model, x + 1)
        np.testing.assert_allclose(loss, x.sum(), rtol=1e-5)
        assert released["released"] == 1
        assert (await _result(api, fid, "1")).status_code == 404
        np.testing.assert_array_equal(
            wire.unpackb((await _result(api, fid, "0")).content)["outputs"][0], x + 1)


async def test_a_donated_output_nobody_else_holds_is_dropped_with_its_run_no_free_sent(
        api) -> None:
    """Given up to the run that consumes it (``give``): the runtime drops it there, and
    the API process sends no free for it (one per step of a training loop, a pipe
    write and a wake-up of the runtime each, before)."""
    runtime = api.app.services.runtimes.runtimes[0]
    pid = await api.upload("plus1")
    v = np.arange(1 << 14, dtype=np.float32)
    first = (await api.execute(pid, [v])).json()["future_id"]
    assert (await api.result(first, wait=30_000)).status_code == 200
    freed: list[int] = []
    send_free = runtime.send_free

    def spy(handles, generation, nbytes=0):
        freed.extend(handles)
        send_free(handles, generation, nbytes)

    runtime.send_free = spy
    try:
        given = api.app.services.futures.get(first, None).outputs[0]
        held = (await runtime.request("stats", {}, timeout_s=60))["buffers"]
        r = await api.execute(pid, [{"future": first, "output": 0}], donate=[0], wait=30_000)
        assert r.status_code == 200, r.text
        np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], v + 2)
        assert given.given and given.handle not in freed
        # its output in, the donated buffer out
        assert (await runtime.request("stats", {}, timeout_s=60))["buffers"] == held
    finally:
        runtime.send_free = send_free


async def test_a_put_whose_runtime_dies_under_it_goes_again(make_api) -> None:
    """A runtime killed while it keeps a put's arrays (another's program crashed it)
    kept nothing that lives on: the put goes again to the process that replaces it,
    and answers as if nothing happened (it answered ``502 runtime_crashed``)."""
    async with make_api(own_runtimes=True) as api:
        runtime = api.app.services.runtimes.runtimes[0]
        big = np.random.default_rng(1).standard_normal(16 << 20).astype(np.float32)  # 64 MiB
        put = asyncio.ensure_future(api.http.post(
            "/v1/arrays", content=wire.packb({"arrays": [big]}),
            headers={"content-type": wire.MSGPACK}))
        first = runtime.pid
        for _ in range(200_000):  # until the runtime has it (the test shares the app's loop)
            if runtime.in_flight():
                break
            await asyncio.sleep(0.0005)
        assert runtime.in_flight() and not put.done(), "the put never reached the runtime"
        os.kill(first, signal.SIGKILL)
        r = await put
        assert r.status_code == 201, r.text
        assert runtime.pid != first
        np.testing.assert_array_equal(
            wire.unpackb((await api.result(r.json()["future_id"])).content)["outputs"][0], big)


def _dead(pid: int) -> bool:
    """Whether ``pid`` has exited (a zombie nobody has waited for yet, or gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started (a runtime's compile workers hold its pipe too)."""
    found: list[int] = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


async def test_a_run_written_to_a_runtime_that_died_unseen_goes_again(make_api) -> None:
    """A runtime whose process died a moment ago is still ``up`` until its supervisor
    reads the end of its pipe (on the event loop). A run written to it then fails to
    write: nothing of it reached a process, so it goes again to the next one, as a run
    that never began does. It failed ``runtime_crashed`` ("exited before it took the
    request"): the resend found the runtime still ``up``, wrote again and gave up."""
    async with make_api(own_runtimes=True) as api:
        services = api.app.services
        runtime = services.runtimes.runtimes[0]
        pid = await api.upload("add_mul")
        x = np.arange(6, dtype=np.float32).reshape(2, 3)
        await api.execute(pid, [x, x], wait=30_000)  # compiled, and the executable known
        program = await services.programs.get(pid, None)
        first = runtime.pid
        gone = [first, *_children(first)]
        for each in gone:
            os.kill(each, signal.SIGKILL)
        while not all(map(_dead, gone)):  # no await: the loop cannot see the pipe's end
            time.sleep(0.001)
        assert runtime.state == "up"  # still: a run's write to it fails now

        call = await services.calls.execute(program, [x, x], "", None)
        assert await call.future.wait_final(60)
        assert call.future.status.value == "done", call.future.error
        assert runtime.pid != first
        r = await api.result(call.future.future_id)
        assert r.status_code == 200, r.text


async def test_a_run_whose_inputs_runtime_was_lost_before_it_was_sent_names_the_loss(
        make_api, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that names an output on its runtime by handle, and packs a big host input
    off the event loop before it is sent: meanwhile its runtime's process is lost and
    another started. The handle was the lost process's; sent to the next one, it named
    a buffer that process never had (``future_expired``: "its buffer was freed"), or,
    had that process made as many outputs by then, another of its own. It fails with
    the loss instead: the output it read went with the process."""
    async with make_api(own_runtimes=True) as api:
        services = api.app.services
        runtime = services.runtimes.runtimes[0]
        pid = await api.upload("add_big")
        x = np.ones(1 << 18, np.float32)
        program = await services.programs.get(pid, None)
        first = await services.calls.execute(program, [x, x], "", None)  # its output stays
        assert await first.future.wait_final(60) and first.future.status.value == "done"

        pack = frames.pack_arrays

        def pack_as_the_runtime_dies(*args: Any) -> Any:  # on a thread: _pack's
            monkeypatch.setattr(frames, "pack_arrays", pack)
            gone = [runtime.pid, *_children(runtime.pid)]
            for each in gone:
                os.kill(each, signal.SIGKILL)
            deadline = time.monotonic() + 30
            while runtime.state == "up":  # its supervisor, on the event loop, saw it end
                assert time.monotonic() < deadline, "the runtime's end was never seen"
                time.sleep(0.001)
            return pack(*args)

        monkeypatch.setattr(frames, "pack_arrays", pack_as_the_runtime_dies)
        ref = {"future": first.future.future_id, "output": 0}
        call = await services.calls.execute(program, [ref, x], "", None)
        assert await call.future.wait_final(60)
        assert frames.pack_arrays is pack  # the kill came while the run was packed
        assert call.future.status.value == "failed"
        assert call.future.error["code"] == "runtime_crashed", call.future.error
        assert "SIGKILL" in call.future.error["message"], call.future.error


async def test_a_fetch_whose_runtime_was_replaced_meanwhile_never_reads_the_next_one(
        make_api, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetch names an output by its handle, then waits for its runtime: meanwhile
    the process is lost, the next one comes up and keeps an array of its own under
    the same handle number. Sent there, the fetch read that array's bytes as the
    output's. It fails with the loss instead."""
    async with make_api(own_runtimes=True) as api:
        services = api.app.services
        runtime = services.runtimes.runtimes[0]
        x = np.arange(6, dtype=np.float32)
        kept = await services.calls.put([x], None)
        assert kept.outputs is not None
        buf = kept.outputs[0]
        wait_up = runtime.wait_up

        async def replaced(*args: Any) -> None:
            monkeypatch.setattr(runtime, "wait_up", wait_up)
            gone = [runtime.pid, *_children(runtime.pid)]
            for each in gone:
                os.kill(each, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while runtime.live_generation in (None, buf.generation):
                assert time.monotonic() < deadline, "the runtime did not come back"
                await asyncio.sleep(0.01)
            other = await services.calls.put([x * 100], None)  # the next process's first
            assert other.outputs is not None and other.outputs[0].handle == buf.handle
            await wait_up(*args)

        monkeypatch.setattr(runtime, "wait_up", replaced)
        with pytest.raises(RuntimeLost, match="SIGKILL"):
            await services.runtimes.fetch([buf])
