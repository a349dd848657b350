"""Bad input of every kind is a 4xx that names the problem, and never hurts the server."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgpack
import numpy as np
import pytest

from jitserve import wire
from jitserve.service.app import create_app
from jitserve.service.settings import Settings

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
    ("compile option not allowed", mp({"args": [arr(), arr()],
                                       "compiler_options": {"xla_dump_to": "/tmp"}}),
     wire.MSGPACK, 400, "invalid_program", "compile option 'xla_dump_to' is not allowed"),
    ("compile option of a list", mp({"args": [arr(), arr()],
                                     "compiler_options": {"xla_cpu_ftz": [1]}}),
     wire.MSGPACK, 400, "bad_request", "compiler_options.xla_cpu_ftz"),
    ("compile options not a map", mp({"args": [arr(), arr()], "compiler_options": [1]}),
     wire.MSGPACK, 400, "bad_request", "compiler_options"),
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


@pytest.mark.parametrize(("donate", "status", "words"), [
    ([2], 400, "donate names inputs [2]; the program takes 2"),
    ([-1], 400, "donate names inputs [-1]"),
    (["x"], 400, "donate.0"),
    ([1, 1, 0], 200, ""),
])
async def test_compile_checks_the_inputs_it_donates(api, donate, status, words) -> None:
    """A compile for donating calls (``RemoteLowered.compile``) names inputs of the program."""
    pid = await api.upload("add_mul")
    r = await api.http.post(f"/v1/programs/{pid}/compile", content=mp({"donate": donate}),
                            headers=MP)
    assert r.status_code == status, r.text
    assert words in r.text


@pytest.mark.parametrize(("options", "status", "words"), [
    ({"xla_gpu_cuda_data_dir": "/"}, 400, "compile option 'xla_gpu_cuda_data_dir' is not allowed"),
    ({"xla_cpu_enable_fast_math": "maybe"}, 422, "'maybe' is not a valid bool"),  # XLA's word
    ({"xla_cpu_ftz": 1.5}, 422, "'1.5' is not a valid bool"),
    ({"optimization_level": "O9"}, 400, "'optimization_level' takes an integer (the level)"),
    ({"exec_time_optimization_effort": "x"}, 400, "'exec_time_optimization_effort' takes a number"),
    ({"xla_backend_optimization_level": -5, "memory_fitting_effort": float("nan")}, 200, "tier"),
    ({"xla_cpu_enable_fast_math": True}, 200, '"tier":"compiled"'),
])
async def test_compile_checks_its_compiler_options(api, options, status, words) -> None:
    """Only allowed XLA options reach the compile; XLA checks their values (a value it
    refuses fails the compile, ``compile_failed`` with its message)."""
    pid = await api.upload("add_mul")
    r = await api.http.post(f"/v1/programs/{pid}/compile",
                            content=mp({"compiler_options": options}), headers=MP)
    assert r.status_code == status, r.text
    assert words in r.text
    assert (await api.http.get("/healthz")).status_code == 200


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
    r = await api.http.get("/v9/nothing")  # (/v2 is the inference protocol, docs/v2.md)
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


async def test_unexpected_errors_are_500_json(api, monkeypatch) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(api.app.services.futures, "counts", broken)
    r = await api.http.get("/metrics")
    assert r.status_code == 500
    assert r.json() == {"error": {"code": "internal", "message": "internal server error"}}
    assert (await api.http.get("/healthz")).status_code == 200


# -- configured limits ---------------------------------------------------------------------


def _jaxpr_chain(n: int) -> bytes:
    """A JSON jaxpr document of ``n`` negations in a row."""
    eqns = [{"primitive": "neg", "invars": [f"v{i}"], "outvars": [f"v{i + 1}"]} for i in range(n)]
    return json.dumps({"format": wire.JAXPR_FORMAT_NAME, "version": wire.JAXPR_FORMAT_VERSION,
                       "jaxpr": {"invars": [{"var": "v0", "aval": {"shape": [2], "dtype": "float32"}}],
                                 "eqns": eqns, "outvars": [f"v{n}"]}}).encode()


def test_jaxpr_limits_are_read_from_the_environment(monkeypatch) -> None:
    monkeypatch.setenv("JITSERVE_JAXPR_MAX_EQNS", "7")
    monkeypatch.setenv("JITSERVE_MAX_PROGRAM_BYTES", "12345")
    limits = Settings(env="test").compiler_limits()
    assert limits.jaxpr.max_eqns == 7
    assert limits.jaxpr.max_document_bytes == limits.max_program_bytes == 12345
    assert limits.jaxpr.max_depth == Settings.model_fields["jaxpr_max_depth"].default


async def test_a_jaxpr_over_the_configured_equation_limit_is_refused(tmp_path: Path) -> None:
    # The app makes its own compiler here: the settings must reach the decoder.
    app = create_app(Settings(env="test", cache_dir=tmp_path, disk_cache=False, jaxpr_max_eqns=3))
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=transport, base_url="http://jitserve") as http:
            ok = await http.post("/v1/programs", content=_jaxpr_chain(3),
                                 headers={"content-type": wire.OCTET_STREAM})
            assert ok.status_code in (200, 201), ok.text
            r = await http.post("/v1/programs", content=_jaxpr_chain(4),
                                headers={"content-type": wire.OCTET_STREAM})
    assert r.status_code == wire.ErrorCode.LIMIT_EXCEEDED.status, r.text
    assert r.json()["error"]["code"] == "limit_exceeded"
    assert "more than 3 equations" in r.json()["error"]["message"]
