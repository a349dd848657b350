"""Execute: waiting and polling, msgpack and JSON, dynamic shapes, chaining, streaming."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from jitserve import wire

pytestmark = pytest.mark.timeout(120)

JSON = {"content-type": "application/json", "accept": "application/json"}


async def test_execute_with_wait_returns_outputs(api, x) -> None:
    pid = await api.upload("add_mul")
    r = await api.execute(pid, [x, x], wait=30_000)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == wire.MSGPACK
    doc = wire.unpackb(r.content)
    np.testing.assert_array_equal(doc["outputs"][0], x + x)
    np.testing.assert_array_equal(doc["outputs"][1], x * 2)
    assert doc["out_tree"] == {"tuple": [None, None]}
    assert doc["future_id"]


async def test_execute_202_then_poll_and_fetch(api, x) -> None:
    pid = await api.upload("add_mul")
    r = await api.execute(pid, [x, x])
    assert r.status_code == 202, r.text
    accepted = r.json()
    assert set(accepted) >= {"future_id", "out_avals", "out_tree", "executable_id", "tier"}
    fid = accepted["future_id"]
    status = (await api.http.get(f"/v1/futures/{fid}", params={"wait": 10_000})).json()
    assert status["status"] in ("pending", "running", "done")  # no longer compiling
    result = await api.result(fid)
    assert result.status_code == 200
    np.testing.assert_array_equal(wire.unpackb(result.content)["outputs"][0], x + x)
    status = (await api.http.get(f"/v1/futures/{fid}")).json()
    assert status["status"] == "done" and status["error"] is None
    assert status["timings"]["run_s"] >= 0 and status["timings"]["queued_s"] >= 0
    assert status["expires_at"] > status["created"]
    # Fetching does not consume: the outputs stay until deleted.
    assert (await api.result(fid)).status_code == 200
    assert (await api.http.delete(f"/v1/futures/{fid}")).json() == {"future_id": fid,
                                                                      "status": "done"}
    assert (await api.http.get(f"/v1/futures/{fid}")).status_code == 404


@pytest.mark.parametrize("encoding", ["lists", "base64"])
async def test_json_in_json_out(api, x, encoding) -> None:
    pid = await api.upload("add_mul")
    if encoding == "lists":
        arg = {"dtype": "float32", "shape": [2, 3], "data": x.tolist()}
    else:
        arg = {"dtype": "float32", "shape": [2, 3], "data": base64.b64encode(x.tobytes()).decode()}
    r = await api.http.post(f"/v1/programs/{pid}/execute", params={"wait": 30_000},
                            json={"args": [arg, arg]}, headers=JSON)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    out = r.json()["outputs"][1]
    assert out == {"dtype": "float32", "shape": [2, 3], "data": (x * 2).tolist()}


async def test_x64_dtypes_and_dict_outputs(api) -> None:
    pid = await api.upload("f64")
    xs = np.array([0.1, 0.2, 0.3, 1e300], np.float64)
    r = await api.execute(pid, [xs, np.int64(2**40)], wait=30_000)
    assert r.status_code == 200, r.text
    doc = wire.unpackb(r.content)
    assert doc["out_tree"] == {"dict": {"n": None, "y": None}}
    n, y = doc["outputs"]  # dict leaves in sorted key order
    assert n.dtype == np.int64 and int(n) == 2**40 + 1
    assert y.dtype == np.float64 and y.tolist() == (xs * 2).tolist()


async def test_dynamic_dimension_compiles_per_shape(api) -> None:
    pid = await api.upload("colsum")
    for rows in (1, 4):
        a = np.ones((rows, 3), np.float32)
        r = await api.execute(pid, [a], wait=30_000)
        assert r.status_code == 200, r.text
        np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], a.sum(0))


async def test_big_result_streams_intact(api) -> None:
    pid = await api.upload("big")
    a = np.arange(1 << 18, dtype=np.float32)
    r = await api.execute(pid, [a], wait=30_000)
    assert r.status_code == 200, r.text
    assert int(r.headers["content-length"]) == len(r.content)
    np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], a + 1)


async def test_chaining_moves_no_bytes(api, x) -> None:
    add_mul, triple = await api.upload("add_mul"), await api.upload("triple")
    first = (await api.execute(add_mul, [x, x])).json()["future_id"]
    sent_before = await api.metric("jitserve_transfer_bytes_total", direction="in")
    r = await api.execute(triple, [{"future": first, "output": 1}], wait=30_000)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], x * 2 * 3)
    assert await api.metric("jitserve_transfer_bytes_total", direction="in") == sent_before


async def test_chaining_waits_for_a_pending_future(api, x) -> None:
    add_mul, triple = await api.upload("add_mul"), await api.upload("triple")
    first = (await api.execute(add_mul, [x, x])).json()["future_id"]
    # No wait: the second call may be accepted while the first is still pending.
    second = (await api.execute(triple, [{"future": first, "output": 0}])).json()["future_id"]
    r = await api.result(second)
    assert r.status_code == 200, r.text
    np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], (x + x) * 3)


async def test_result_of_a_future_without_wait_may_be_pending(api, x) -> None:
    pid = await api.upload("add_mul")
    fid = (await api.execute(pid, [x, x])).json()["future_id"]
    r = await api.http.get(f"/v1/futures/{fid}/result")
    assert r.status_code in (200, 409)
    if r.status_code == 409:
        assert r.json()["error"]["code"] == "future_pending"
