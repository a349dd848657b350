"""``POST /v1/calls``: several calls started in order in one request (issue 38's
foundation for running ahead), against a real ``jitserve serve`` over raw HTTP.

A chain whose links take the outputs of earlier calls of the same batch gives what
the calls one by one give; a refused call is refused as its own execute would be,
the calls that take its outputs are refused naming it, and the others go on; a
donated link releases what it donates; another key's futures stay out of reach.
"""

from __future__ import annotations

from typing import Any

import httpx
import jax
import numpy as np
import pytest
from jax import export

from jitserve import wire

pytestmark = pytest.mark.timeout(180)


def _program(http: httpx.Client, headers: dict[str, str] | None = None) -> str:
    exp = export.export(jax.jit(lambda a: a * 2.0 + 1.0))(jax.ShapeDtypeStruct((4,), np.float32))
    r = http.post("/v1/programs", content=bytes(exp.serialize()),
                  headers={"content-type": wire.OCTET_STREAM, **(headers or {})})
    assert r.status_code in (200, 201), r.text
    return str(r.json()["program_id"])


def _calls(http: httpx.Client, calls: list[dict[str, Any]], *, as_json: bool = False,
           headers: dict[str, str] | None = None,
           release: list[dict[str, Any]] | None = None) -> httpx.Response:
    body = {"calls": calls, **({"release": release} if release is not None else {})}
    if as_json:
        return http.post("/v1/calls", content=wire.dumps_json(body),
                         headers={"content-type": wire.JSON, **(headers or {})})
    return http.post("/v1/calls", content=wire.packb(body),
                     headers={"content-type": wire.MSGPACK, **(headers or {})})


def _value(http: httpx.Client, future_id: str, headers: dict[str, str] | None = None) -> Any:
    r = http.get(f"/v1/futures/{future_id}/result", params={"wait": 30000},
                 headers={"accept": wire.MSGPACK, **(headers or {})})
    assert r.status_code == 200, r.text
    return wire.unpackb(r.content)["outputs"][0]


def test_a_batch_chains_its_calls_and_refuses_each_bad_one_alone(http: httpx.Client) -> None:
    pid = _program(http)
    a = np.arange(4, dtype=np.float32)
    r = _calls(http, [
        {"program_id": pid, "args": [a]},
        {"program_id": pid, "args": [{"call": 0, "output": 0}]},
        {"program_id": pid, "args": [np.zeros(3, np.float32)]},  # the wrong shape
        {"program_id": pid, "args": [{"call": 2, "output": 0}]},  # takes the refused one's
        {"program_id": pid, "args": [{"call": 1, "output": 0}], "donate": [0]},
        {"program_id": pid, "args": [{"call": 9, "output": 0}]},  # no such call before it
        {"program_id": "no-such-program", "args": [a]},
    ])
    assert r.status_code == 200, r.text
    entries = r.json()["calls"]
    assert len(entries) == 7
    assert [e.get("error", {}).get("code") for e in entries] == [
        None, None, "signature_mismatch", "future_failed", None, "bad_request", "not_found"]
    assert "expected float32[4], got float32[3]" in entries[2]["error"]["message"]
    assert "call 2 of this batch was refused" in entries[3]["error"]["message"]
    assert "{'call': 0..4, 'output': k}" in entries[5]["error"]["message"]
    first = _calls(http, [{"program_id": pid, "args": [{"call": 0, "output": 0}]}]).json()["calls"]
    assert "the first call has none" in first[0]["error"]["message"], first
    np.testing.assert_array_equal(_value(http, entries[0]["future_id"]), a * 2 + 1)
    np.testing.assert_array_equal(_value(http, entries[4]["future_id"]), a * 8 + 7)
    # Call 4 donated call 1's output: it is released, as an execute's donation does.
    r = http.get(f"/v1/futures/{entries[1]['future_id']}/result", params={"wait": 30000})
    assert r.status_code in (404, 409, 410), r.text
    # Each started future is a future like any other: its avals are there.
    info = http.get(f"/v1/futures/{entries[0]['future_id']}").json()
    assert info["out_avals"] == [{"shape": [4], "dtype": "float32"}]


def test_a_batch_in_json_and_a_second_batch_on_the_first_s_futures(http: httpx.Client) -> None:
    pid = _program(http)
    first = _calls(http, [{"program_id": pid, "args": [np.ones(4, np.float32)]}],
                   as_json=True)
    assert first.status_code == 200, first.text
    [entry] = first.json()["calls"]
    second = _calls(http, [{"program_id": pid, "args": [{"future": entry["future_id"], "output": 0}]},
                           {"program_id": pid, "args": [{"call": 0, "output": 0}]}])
    assert second.status_code == 200, second.text
    np.testing.assert_array_equal(_value(http, second.json()["calls"][1]["future_id"]),
                                  np.full(4, 15.0, np.float32))


def test_a_batch_that_waits_carries_the_outputs_of_its_inline_calls(http: httpx.Client) -> None:
    pid = _program(http)
    a = np.arange(4, dtype=np.float32)
    for as_json in (False, True):
        calls = [{"program_id": pid, "args": [a]},
                 {"program_id": pid, "args": [{"call": 0, "output": 0}], "inline": True}]
        body = wire.dumps_json({"calls": calls}) if as_json else wire.packb({"calls": calls})
        ctype = wire.JSON if as_json else wire.MSGPACK
        r = http.post("/v1/calls", params={"wait": 30000}, content=body,
                      headers={"content-type": ctype, "accept": ctype})
        assert r.status_code == 200, r.text
        first, second = (wire.loads_json(r.content) if as_json else wire.unpackb(r.content))["calls"]
        assert "outputs" not in first  # not inline: fetched as any future
        assert second["status"] == "done"
        [out] = second["outputs"]
        np.testing.assert_array_equal(out, a * 4 + 3)
        # The future is kept: its outputs can still be fetched and passed on.
        np.testing.assert_array_equal(_value(http, second["future_id"]), a * 4 + 3)
        np.testing.assert_array_equal(_value(http, first["future_id"]), a * 2 + 1)
    # Without ?wait, inline asks nothing: the answer comes at once, without outputs.
    r = _calls(http, [{"program_id": pid, "args": [a], "inline": True}])
    assert "outputs" not in r.json()["calls"][0]


def test_an_inline_call_s_small_outputs_come_beside_its_big_ones(http: httpx.Client) -> None:
    """A training step's loss beside its model: the answer carries the outputs that
    came back with the run (``wire.carried_outputs``), the big one stays, and a fetch
    of both gives the small one from the server's copy and the big one from its
    runtime."""
    n = wire.INLINE_OUTPUTS_BYTES // 16 + 1  # four float32 a row: past the limit
    exp = export.export(jax.jit(lambda a: (jax.numpy.tile(a, (n, 1)), a.sum(), a[:3] + 1.0)))(
        jax.ShapeDtypeStruct((4,), np.float32))
    r = http.post("/v1/programs", content=bytes(exp.serialize()),
                  headers={"content-type": wire.OCTET_STREAM})
    assert r.status_code in (200, 201), r.text
    pid = r.json()["program_id"]
    a = np.arange(4, dtype=np.float32) / 4
    for as_json in (False, True):
        calls = [{"program_id": pid, "args": [a], "inline": True}]
        body = wire.dumps_json({"calls": calls}) if as_json else wire.packb({"calls": calls})
        ctype = wire.JSON if as_json else wire.MSGPACK
        r = http.post("/v1/calls", params={"wait": 30000}, content=body,
                      headers={"content-type": ctype, "accept": ctype})
        assert r.status_code == 200, r.text
        [entry] = (wire.loads_json(r.content) if as_json else wire.unpackb(r.content))["calls"]
        assert entry["status"] == "done"
        assert "outputs" not in entry  # not all of them are small
        assert entry["carried"]["outputs"] == [1, 2]
        total, head = entry["carried"]["values"]
        np.testing.assert_allclose(total, a.sum(), rtol=1e-5)
        np.testing.assert_array_equal(head, a[:3] + 1.0)
        r = http.get(f"/v1/futures/{entry['future_id']}/result", params={"outputs": "1,0,2"},
                     headers={"accept": wire.MSGPACK})
        assert r.status_code == 200, r.text
        total, big, head = wire.unpackb(r.content)["outputs"]
        np.testing.assert_allclose(total, a.sum(), rtol=1e-5)
        np.testing.assert_array_equal(big, np.tile(a, (n, 1)))
        np.testing.assert_array_equal(head, a[:3] + 1.0)
        # Released, the small output is gone from the server's copy too.
        r = http.post("/v1/futures/release",
                      json={"outputs": [{"future": entry["future_id"], "output": 1}]})
        assert r.status_code == 200, r.text
        r = http.get(f"/v1/futures/{entry['future_id']}/result", params={"outputs": "1"})
        assert r.status_code == 404, r.text
        r = http.get(f"/v1/futures/{entry['future_id']}/result", params={"outputs": "0"},
                     headers={"accept": wire.MSGPACK})
        np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], np.tile(a, (n, 1)))


def test_a_batch_releases_outputs_once_its_calls_started(http: httpx.Client) -> None:
    """``release`` lets go of outputs as ``POST /v1/futures/release`` does, after the
    batch's calls started: a call of the batch still reads an output it releases."""
    pid = _program(http)
    a = np.arange(4, dtype=np.float32)
    for as_json in (False, True):
        first = _calls(http, [{"program_id": pid, "args": [a]}]).json()["calls"][0]["future_id"]
        ref = {"future": first, "output": 0}
        r = _calls(http, [{"program_id": pid, "args": [ref]}], as_json=as_json, release=[
            ref, {"future": "no-such-future", "output": 0}])
        assert r.status_code == 200, r.text
        answer = r.json()
        assert (answer["released"], answer["unknown"]) == (1, 1)
        np.testing.assert_array_equal(_value(http, answer["calls"][0]["future_id"]), a * 4 + 3)
        r = http.get(f"/v1/futures/{first}/result", params={"wait": 30000})
        assert r.status_code == 404, r.text


def test_bad_batches_are_refused_whole(http: httpx.Client) -> None:
    pid = _program(http)
    assert _calls(http, []).json() == {"calls": [], "released": 0, "unknown": 0}
    for body in ({}, {"calls": "no"}, {"calls": [{"args": []}]},
                 {"calls": [{"program_id": pid, "args": [], "what": 1}]},
                 {"calls": [], "release": [{"future": "x"}]},
                 {"calls": [], "release": "no"},
                 {"calls": [{"program_id": pid, "args": []}] * 1025}):
        r = http.post("/v1/calls", content=wire.packb(body), headers={"content-type": wire.MSGPACK})
        assert r.status_code == 400 and r.json()["error"]["code"] == "bad_request", (body, r.text)
    r = http.post("/v1/calls", content=b"\xc1garbage", headers={"content-type": wire.MSGPACK})
    assert r.status_code == 400, r.text


def test_another_key_s_futures_are_out_of_reach(auth_server_url: str,
                                                auth_keys: tuple[str, ...]) -> None:
    alice, bob = ({"authorization": f"Bearer {k}"} for k in auth_keys[:2])
    with httpx.Client(base_url=auth_server_url, timeout=60) as http:
        assert http.post("/v1/calls", content=wire.packb({"calls": []}),
                         headers={"content-type": wire.MSGPACK}).status_code == 401
        pid = _program(http, alice)
        _program(http, bob)
        mine = _calls(http, [{"program_id": pid, "args": [np.ones(4, np.float32)]}],
                      headers=alice).json()["calls"][0]["future_id"]
        r = _calls(http, [{"program_id": pid, "args": [{"future": mine, "output": 0}]}],
                   headers=bob)
        assert r.status_code == 200, r.text
        assert r.json()["calls"][0]["error"]["code"] == "not_found"
        np.testing.assert_array_equal(_value(http, mine, alice), np.full(4, 3.0, np.float32))
