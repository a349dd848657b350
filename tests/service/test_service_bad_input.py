"""Bad input of every kind is a 4xx that names the problem, and never hurts the server."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgpack
import numpy as np
import pytest

from jitserve import wire

pytestmark = pytest.mark.timeout(120)

MP = {"content-type": wire.MSGPACK}
X = np.zeros((2, 3), np.float32)


def arr(**over: Any) -> dict[str, Any]:
    """A wire array map of X with some fields replaced."""
    return {"dtype": "float32", "shape": [2, 3], "data": X.tobytes(), **over}


def mp(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# (name, raw body, content-type, expected status, expected code, words in the message)
CASES = [
    ("malformed msgpack", b"\xc1\xff\x00", wire.MSGPACK, 400, "bad_request", "msgpack"),
    ("truncated msgpack", mp({"args": [arr()]})[:-10], wire.MSGPACK, 400, "bad_request", ""),
    ("malformed json", b'{"args": [', "application/json", 400, "bad_request", "JSON"),
    ("empty body", b"", wire.MSGPACK, 400, "bad_request", "body"),
    ("not a map", mp([1, 2]), wire.MSGPACK, 400, "bad_request", "execute request"),
    ("no args", mp({"argz": []}), wire.MSGPACK, 400, "bad_request", "args"),
    ("args not a list", mp({"args": 3}), wire.MSGPACK, 400, "bad_request", "args"),
    ("bad static_key", mp({"args": [arr(), arr()], "static_key": 5}), wire.MSGPACK, 400,
     "bad_request", "static_key"),
    ("arg of wrong type", mp({"args": [arr(), "hello"]}), wire.MSGPACK, 400, "bad_request",
     "args[1]"),
    ("too few args", mp({"args": [arr()]}), wire.MSGPACK, 400, "signature_mismatch", "2 inputs"),
    ("too many args", mp({"args": [arr()] * 3}), wire.MSGPACK, 400, "signature_mismatch", ""),
    ("wrong shape", mp({"args": [arr(), arr(shape=[3, 2])]}), wire.MSGPACK, 400,
     "signature_mismatch", "input 1"),
    ("wrong dtype", mp({"args": [arr(), arr(dtype="int32")]}), wire.MSGPACK, 400,
     "signature_mismatch", "int32"),
    ("unsupported dtype", mp({"args": [arr(), arr(dtype="float33")]}), wire.MSGPACK, 400,
     "bad_request", "float33"),
    ("dtype not a string", mp({"args": [arr(), arr(dtype=7)]}), wire.MSGPACK, 400,
     "bad_request", "dtype"),
    ("negative dim", mp({"args": [arr(), arr(shape=[-2, -3])]}), wire.MSGPACK, 400,
     "bad_request", "negative"),
    ("absurd dims", mp({"args": [arr(), arr(shape=[2**40, 2**40])]}), wire.MSGPACK, 400,
     "bad_request", "limit"),
    ("data size mismatch", mp({"args": [arr(), arr(data=b"\x00" * 5)]}), wire.MSGPACK, 400,
     "bad_request", "bytes"),
    ("extra array key", mp({"args": [arr(), arr(extra=1)]}), wire.MSGPACK, 400,
     "bad_request", "unexpected"),
    ("unknown future", mp({"args": [arr(), {"future": "nope", "output": 0}]}), wire.MSGPACK,
     404, "not_found", "nope"),
    ("ref output not int", mp({"args": [arr(), {"future": "x", "output": "0"}]}), wire.MSGPACK,
     400, "bad_request", "args[1]"),
    ("ragged json lists", b'{"args": [{"dtype": "float32", "shape": [2, 3], "data": [[1]]}]}',
     "application/json", 400, "bad_request", "shape"),
    ("unsupported content type", b"args=1", "application/x-www-form-urlencoded", 415,
     "unsupported_media_type", "Content-Type"),
]


@pytest.mark.parametrize(("body", "ctype", "status", "code", "words"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
async def test_bad_execute_bodies(api, body, ctype, status, code, words) -> None:
    pid = await api.upload("add_mul")
    r = await api.http.post(f"/v1/programs/{pid}/execute", content=body,
                            headers={"content-type": ctype})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code
    assert words in err["message"] and err["message"]
    assert (await api.http.get("/healthz")).status_code == 200


async def test_future_ref_output_out_of_range(api) -> None:
    add_mul, triple = await api.upload("add_mul"), await api.upload("triple")
    fid = (await api.execute(add_mul, [X, X])).json()["future_id"]
    r = await api.execute(triple, [{"future": fid, "output": 2}])
    assert r.status_code == 400
    assert "has 2 outputs" in r.json()["error"]["message"]


@pytest.mark.parametrize("path", ["/v1/programs/{pid}/execute", "/v1/programs/{pid}/compile"])
async def test_unknown_program_is_404(api, path) -> None:
    r = await api.http.post(path.format(pid="ab" * 32), content=mp({"args": []}), headers=MP)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/futures/nope"), ("GET", "/v1/futures/nope/result"),
    ("DELETE", "/v1/futures/nope"),
])
async def test_unknown_future_is_404(api, method, path) -> None:
    r = await api.http.request(method, path)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("wait", ["-1", "abc", "1e99"])
async def test_bad_wait_is_400(api, wait) -> None:
    r = await api.http.get("/v1/futures/nope", params={"wait": wait})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "bad_request" and "wait" in r.json()["error"]["message"]


async def test_body_over_the_limit_by_content_length_is_413(make_api) -> None:
    async with make_api(max_body_bytes=4096) as api:
        pid = await api.upload("add_mul")
        r = await api.http.post(f"/v1/programs/{pid}/execute", content=b"\x00" * 8192, headers=MP)
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "payload_too_large"


async def test_streamed_body_over_the_limit_is_413(make_api) -> None:
    chunks_sent = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal chunks_sent
        for _ in range(1000):
            chunks_sent += 1
            yield b"\x00" * 512

    async with make_api(max_body_bytes=4096) as api:
        pid = await api.upload("add_mul")
        r = await api.http.post(f"/v1/programs/{pid}/execute", content=endless(), headers=MP)
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "payload_too_large"
        assert chunks_sent < 20  # refused while streaming, not after reading it all


async def test_method_not_allowed_and_unknown_routes_are_json(api) -> None:
    r = await api.http.put("/v1/programs")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = await api.http.get("/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


async def test_unexpected_errors_are_500_json(api, monkeypatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(api.app.state.futures, "counts", broken)
    r = await api.http.get("/metrics")
    assert r.status_code == 500
    assert r.json() == {"error": {"code": "internal", "message": "internal server error"}}
    assert (await api.http.get("/healthz")).status_code == 200
