"""JSON in gives JSON out, and a refused upload says what was wrong in the caller's terms."""

from __future__ import annotations

import pytest

from jitserve import wire

pytestmark = pytest.mark.timeout(120)

X = {"dtype": "float32", "shape": [2, 3], "data": [[1, 2, 3], [4, 5, 6]]}


@pytest.mark.parametrize(("accept", "json_out"), [
    (None, True), ("*/*", True), ("application/json", True),
    ("application/msgpack", False), ("application/msgpack, application/json", False),
])
async def test_json_in_gives_json_out_unless_accept_says_otherwise(api, accept, json_out) -> None:
    pid = await api.upload("add_mul")
    headers = {"Accept": accept} if accept else {}
    r = await api.http.post(f"/v1/programs/{pid}/execute?wait=30000",
                            json={"args": [X, X]}, headers=headers)
    assert r.status_code == 200, r.text
    if json_out:
        assert r.headers["content-type"] == wire.JSON
        assert r.json()["outputs"][0]["data"] == [[2, 4, 6], [8, 10, 12]]
    else:
        assert r.headers["content-type"] == wire.MSGPACK


@pytest.mark.parametrize(("body", "fmt"), [
    (b"garbage that is no program at all " * 8, None),
    (b"garbage that is no program at all " * 8, "jax_export"),
    (b"\x00\x01\x02\x03" * 64, None),
    (b"module { this is not mlir }", "stablehlo"),
    (b'{"not": "a jaxpr"}', "jaxpr"),
])
async def test_bad_program_message_names_no_internals(api, body, fmt) -> None:
    params = {"format": fmt} if fmt else {}
    r = await api.http.post("/v1/programs", content=body, params=params,
                            headers={"Content-Type": wire.OCTET_STREAM})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_program"
    message = error["message"]
    for internal in ("unpack_from", "buffer of at least", "Traceback", "struct.error",
                     "flatbuffer", "Error:", "0x"):
        assert internal not in message, message
    assert any(word in message for word in ("jax_export", "StableHLO", "stablehlo", "jaxpr"))
