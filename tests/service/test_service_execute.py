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


# -- the execute lane (service/api/lane.py: ExecuteLane) ---------------------


@pytest.mark.parametrize(("query", "parsed"), [
    (b"", (None, True)), (b"wait=10", (10, True)), (b"wait=0&keep=false", (0, False)),
    (b"keep=1&wait=5&wait=7", (7, True)), (b"other=x&wait=3", (3, True)),
    (b"wait=%31", (1, True)), (b"wait=%31%30&keep=%30", (10, False)),
    (b"wait=abc", None), (b"wait=-1", None), (b"wait=", None), (b"wait=%2D1", None),
    (b"keep=no", None), (b"wait=1e3", None), (b"wait=\xd9\xa3", None), (b"wait=+1", None),
])
def test_lane_reads_queries_as_starlette_and_leaves_the_rest_to_fastapi(query, parsed) -> None:
    from jitserve.service.api.lane import _query

    assert _query(query) == parsed


async def test_queries_the_lane_declines_are_answered_by_fastapi(api, x) -> None:
    pid = await api.upload("add_mul")
    body = wire.packb({"args": [x, x]})
    path = f"/v1/programs/{pid}/execute"
    headers = {"content-type": wire.MSGPACK}
    for bad in ("wait=abc", "wait=-5"):
        r = await api.http.post(f"{path}?{bad}", content=body, headers=headers)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "bad_request" and "wait" in error["message"]
    # escaped and spelled-out values the lane leaves alone mean what FastAPI says they do
    r = await api.http.post(f"{path}?wait=%31%30000&keep=no", content=body, headers=headers)
    assert r.status_code == 200, r.text
    fid = wire.unpackb(r.content)["future_id"]
    assert (await api.http.get(f"/v1/futures/{fid}")).status_code == 404  # keep=no: gone
    np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], x + x)


async def test_lane_serves_batches_of_calls_as_fastapi_does(api, x) -> None:
    pid = await api.upload("add_mul")
    before = await api.metric("jitserve_requests_total", route="/v1/calls", status="200")
    body = wire.packb({"calls": [{"program_id": pid, "args": [x, x], "inline": True}]})
    headers = {"content-type": wire.MSGPACK, "accept": wire.MSGPACK}
    r = await api.http.post("/v1/calls?wait=10000", content=body, headers=headers)
    assert r.status_code == 200, r.text
    [entry] = wire.unpackb(r.content)["calls"]
    np.testing.assert_array_equal(entry["outputs"][0], x + x)
    assert await api.metric("jitserve_requests_total", route="/v1/calls",
                            status="200") == before + 1
    r = await api.http.post("/v1/calls?wait=abc", content=body, headers=headers)  # FastAPI's
    assert r.status_code == 400 and "wait" in r.json()["error"]["message"], r.text
    r = await api.http.post("/v1/calls", content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"


async def test_lane_answers_errors_through_the_app_handlers(api, x) -> None:
    pid = await api.upload("add_mul")
    before = await api.metric("jitserve_requests_total",
                              route="/v1/programs/{program_id}/execute", status="415")
    r = await api.http.post(f"/v1/programs/{pid}/execute?wait=1000", content=b"{}",
                            headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = await api.http.post("/v1/programs/nope/execute?wait=1000",
                            content=wire.packb({"args": [x, x]}),
                            headers={"content-type": wire.MSGPACK})
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert "nope" in r.json()["error"]["message"]
    after = await api.metric("jitserve_requests_total",
                             route="/v1/programs/{program_id}/execute", status="415")
    assert after == before + 1  # counted under the route's template, as routed requests are


@pytest.mark.parametrize(("query", "parsed"), [
    (b"", (None, None)), (b"wait=10", (10, None)), (b"outputs=0,2", (None, "0,2")),
    (b"outputs=1&wait=5&outputs=3", (5, "3")), (b"outputs=%30", (None, "0")),
    (b"other=x", (None, None)),
    (b"outputs=a", None), (b"outputs=1,", None), (b"outputs=", None), (b"outputs=1234567", None),
    (b"outputs=\xd9\xa3", None), (b"wait=abc", None), (b"wait=-1", None),
])
def test_lane_reads_result_queries_as_starlette_and_leaves_the_rest_to_fastapi(
        query, parsed) -> None:
    from jitserve.service.api.lane import _result_query

    assert _result_query(query) == parsed


async def test_lane_serves_fetches_and_releases_as_fastapi_does(api, x) -> None:
    pid = await api.upload("add_mul")
    r = await api.execute(pid, [x, x])
    fid = r.json()["future_id"]

    async def counted(route: str, status: str) -> float:
        return await api.metric("jitserve_requests_total", route=route, status=status)

    result, release = "/v1/futures/{future_id}/result", "/v1/futures/release"
    before = await counted(result, "200"), await counted(result, "400")
    r = await api.http.get(f"/v1/futures/{fid}/result?wait=10000&outputs=1,0")
    assert r.status_code == 200, r.text
    got = wire.unpackb(r.content)["outputs"]
    np.testing.assert_array_equal(got[0], x * 2)  # add_mul: (x + y, x * 2)
    np.testing.assert_array_equal(got[1], x + x)
    r = await api.http.get(f"/v1/futures/{fid}/result?outputs=0", headers={"accept": wire.JSON})
    assert r.status_code == 200 and r.headers["content-type"].startswith(wire.JSON), r.text
    r = await api.http.get(f"/v1/futures/{fid}/result?outputs=7")  # ours: no such output
    assert r.status_code == 400 and "no output 7" in r.json()["error"]["message"], r.text
    r = await api.http.get(f"/v1/futures/{fid}/result?outputs=x")  # FastAPI's: the pattern
    assert r.status_code == 400 and "outputs" in r.json()["error"]["message"], r.text
    assert (await counted(result, "200"), await counted(result, "400")) == (
        before[0] + 2, before[1] + 2)
    r = await api.http.get("/v1/futures/nope/result")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"

    before_release = await counted(release, "200")
    refs = {"outputs": [{"future": fid, "output": 0}, {"future": "nope", "output": 0}]}
    r = await api.http.post(release, json=refs)
    assert r.status_code == 200 and r.json() == {"released": 1, "unknown": 1}, r.text
    r = await api.http.post(release, content=wire.packb(refs),
                            headers={"content-type": wire.MSGPACK})
    # released again: counted again (idempotent); the future, one output still held, lives
    assert r.status_code == 200 and r.json() == {"released": 1, "unknown": 1}, r.text
    assert await counted(release, "200") == before_release + 2
    r = await api.http.post(release, content=b"{}", headers={"content-type": "text/plain"})
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = await api.http.post(release, json={"outputs": "all"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", r.text
