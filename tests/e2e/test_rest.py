"""The REST API against a real ``jitserve serve`` process, with raw httpx."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from typing import Any

import httpx
import jax
import msgpack
import numpy as np
import pytest
from e2e.conftest import api_loads_jax
from jax import export

from jitserve import wire

pytestmark = pytest.mark.timeout(180)

MP = {"content-type": wire.MSGPACK}
X = np.arange(6, dtype=np.float32).reshape(2, 3)


def _export(fn: Any, *shapes: tuple[int, ...]) -> bytes:
    specs = [jax.ShapeDtypeStruct(s, np.float32) for s in shapes]
    return bytes(export.export(jax.jit(fn))(*specs).serialize())


@pytest.fixture(scope="module")
def add_mul_bytes() -> bytes:
    """(x + y, 2x) on float32[2, 3], exported."""
    return _export(lambda x, y: (x + y, x * 2), (2, 3), (2, 3))


@pytest.fixture(scope="module")
def add_mul(server_url: str, add_mul_bytes: bytes) -> str:
    """Program id of ``add_mul_bytes``, uploaded once."""
    return _upload(server_url, add_mul_bytes)


@pytest.fixture(scope="module")
def triple(server_url: str) -> str:
    """Program id of 3x on float32[2, 3]."""
    return _upload(server_url, _export(lambda x: x * 3, (2, 3)))


def _upload(url: str, data: bytes, headers: dict[str, str] | None = None) -> str:
    r = httpx.post(f"{url}/v1/programs", content=data, timeout=60,
                   headers={"content-type": "application/octet-stream", **(headers or {})})
    assert r.status_code in (200, 201), r.text
    return r.json()["program_id"]


def _execute(http: httpx.Client, pid: str, args: list[Any], wait: int | None = None,
             **headers: str) -> httpx.Response:
    params = {} if wait is None else {"wait": wait}
    return http.post(f"/v1/programs/{pid}/execute", params=params,
                     content=wire.packb({"args": args}), headers={**MP, **headers})


def _metric(http: httpx.Client, sample: str) -> float:
    text = http.get("/metrics").text
    m = re.search(rf"^{re.escape(sample)} (\S+)$", text, re.MULTILINE)
    return float(m.group(1)) if m else 0.0


def test_health_ready_devices(http: httpx.Client) -> None:
    assert http.get("/healthz").json() == {"status": "ok"}
    assert http.get("/readyz").json()["status"] == "ready"
    backend = http.get("/v1/devices").json()["backend"]
    assert backend["platform"] == "cpu" and backend["jax_version"] == jax.__version__


def test_upload_twice_is_idempotent(http: httpx.Client, add_mul: str, add_mul_bytes: bytes) -> None:
    r = http.post("/v1/programs", content=add_mul_bytes,
                  headers={"content-type": "application/octet-stream"})
    assert r.status_code == 200 and r.json()["program_id"] == add_mul
    assert http.get(f"/v1/programs/{add_mul}").json()["format"] == "jax_export"


def test_execute_with_wait(http: httpx.Client, add_mul: str) -> None:
    r = _execute(http, add_mul, [X, X], wait=60_000)
    assert r.status_code == 200, r.text
    outs = wire.unpackb(r.content)["outputs"]
    np.testing.assert_array_equal(outs[0], X + X)
    np.testing.assert_array_equal(outs[1], X * 2)


def test_execute_with_wait_and_keep_false_forgets_the_future(http: httpx.Client,
                                                            add_mul: str) -> None:
    r = http.post(f"/v1/programs/{add_mul}/execute", params={"wait": 60_000, "keep": "false"},
                  content=wire.packb({"args": [X, X]}), headers=MP)
    assert r.status_code == 200, r.text
    answer = wire.unpackb(r.content)
    np.testing.assert_array_equal(answer["outputs"][1], X * 2)
    assert http.get(f"/v1/futures/{answer['future_id']}").status_code == 404
    kept = wire.unpackb(_execute(http, add_mul, [X, X], wait=60_000).content)["future_id"]
    assert http.get(f"/v1/futures/{kept}").json()["status"] == "done"
    r = http.post(f"/v1/programs/{add_mul}/execute", params={"keep": "maybe"},
                  content=wire.packb({"args": [X, X]}), headers=MP)
    assert r.status_code == 400 and "keep" in r.json()["error"]["message"]


def test_future_polling(http: httpx.Client, add_mul: str) -> None:
    r = _execute(http, add_mul, [X, X])
    assert r.status_code == 202, r.text
    fid = r.json()["future_id"]
    deadline = time.monotonic() + 30
    while (status := http.get(f"/v1/futures/{fid}", params={"wait": 5000}).json())["status"] \
            in ("pending", "running"):
        assert time.monotonic() < deadline
    assert status["status"] == "done"
    r = http.get(f"/v1/futures/{fid}/result")
    np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], X + X)
    assert http.delete(f"/v1/futures/{fid}").json()["status"] == "done"
    assert http.get(f"/v1/futures/{fid}").status_code == 404


def test_chaining_moves_no_array_bytes(http: httpx.Client, add_mul: str, triple: str) -> None:
    _execute(http, triple, [X], wait=60_000)  # compiled ahead, so only chaining is measured
    first = _execute(http, add_mul, [X, X])
    assert first.status_code == 202
    sent = _metric(http, 'jitserve_transfer_bytes_total{direction="in"}')
    got = _metric(http, 'jitserve_transfer_bytes_total{direction="out"}')
    ref = {"future": first.json()["future_id"], "output": 1}
    second = _execute(http, triple, [ref])
    third = _execute(http, triple, [{"future": second.json()["future_id"], "output": 0}])
    assert _metric(http, 'jitserve_transfer_bytes_total{direction="in"}') == sent
    assert _metric(http, 'jitserve_transfer_bytes_total{direction="out"}') == got
    r = http.get(f"/v1/futures/{third.json()['future_id']}/result", params={"wait": 30_000})
    np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], X * 2 * 3 * 3)
    assert _metric(http, 'jitserve_transfer_bytes_total{direction="out"}') == got + X.nbytes


def test_curl_style_json(server_url: str, add_mul: str) -> None:
    body = json.dumps({"args": [{"dtype": "float32", "shape": [2, 3], "data": X.tolist()}] * 2})
    r = httpx.post(f"{server_url}/v1/programs/{add_mul}/execute?wait=60000", content=body,
                   headers={"content-type": "application/json", "accept": "application/json"},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["outputs"][0] == {"dtype": "float32", "shape": [2, 3], "data": (X + X).tolist()}


def _arr(**over: Any) -> dict[str, Any]:
    return {"dtype": "float32", "shape": [2, 3], "data": X.tobytes(), **over}


def _mp(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


BAD = [
    ("malformed msgpack", b"\xc1\xc1\xc1", MP, 400, "bad_request"),
    ("malformed json", b"{not json", {"content-type": "application/json"}, 400, "bad_request"),
    ("wrong arg count", _mp({"args": [_arr()]}), MP, 400, "signature_mismatch"),
    ("wrong shape", _mp({"args": [_arr(), _arr(shape=[6], data=X.tobytes())]}), MP, 400,
     "signature_mismatch"),
    ("wrong dtype", _mp({"args": [_arr(), _arr(dtype="uint32")]}), MP, 400, "signature_mismatch"),
    ("negative dims", _mp({"args": [_arr(), _arr(shape=[-1, 3])]}), MP, 400, "bad_request"),
    ("absurd dims", _mp({"args": [_arr(), _arr(shape=[2**62, 2**62])]}), MP, 400, "bad_request"),
    ("unsupported dtype", _mp({"args": [_arr(), _arr(dtype="complex512")]}), MP, 400,
     "bad_request"),
    ("unknown future", _mp({"args": [_arr(), {"future": "x" * 32, "output": 0}]}), MP, 404,
     "not_found"),
    ("oversized body", b"\x00" * (300 * 1024), MP, 413, "payload_too_large"),
]


@pytest.mark.parametrize(("body", "headers", "status", "code"), [b[1:] for b in BAD],
                         ids=[b[0] for b in BAD])
def test_bad_input_is_a_4xx(server_url: str, add_mul: str, body: bytes,
                            headers: dict[str, str], status: int, code: str) -> None:
    with httpx.Client(base_url=server_url, timeout=60) as http:
        r = http.post(f"/v1/programs/{add_mul}/execute", content=body, headers=headers)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert err["code"] == code and len(err["message"]) > 10
    assert httpx.get(f"{server_url}/healthz").status_code == 200


@pytest.mark.parametrize(("method", "path", "code"), [
    ("GET", "/v1/programs/" + "f" * 64, "not_found"),
    ("GET", "/v1/futures/unknown", "not_found"),
    ("GET", "/v1/futures/unknown/result", "not_found"),
    ("DELETE", "/v1/futures/unknown", "not_found"),
])
def test_unknown_ids_are_404(http: httpx.Client, method: str, path: str, code: str) -> None:
    r = http.request(method, path)
    assert r.status_code == 404 and r.json()["error"]["code"] == code


def test_bad_program_upload(http: httpx.Client) -> None:
    r = http.post("/v1/programs", content=b"\x00garbage" * 10,
                  headers={"content-type": "application/octet-stream"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_program"
    assert http.get("/healthz").status_code == 200


def test_metrics_exposition(http: httpx.Client) -> None:
    text = http.get("/metrics").text
    assert 'jitserve_requests_total{route="/v1/programs/{program_id}/execute",status="200"}' in text
    assert "jitserve_compilations_total" in text and "jitserve_futures{" in text


def test_api_keys_guard_v1_and_futures(auth_server_url: str, auth_keys: tuple[str, ...]) -> None:
    alice, bob = ({"authorization": f"Bearer {k}"} for k in auth_keys)
    with httpx.Client(base_url=auth_server_url, timeout=60) as http:
        assert http.get("/v1/devices").status_code == 401
        assert http.get("/healthz").status_code == 200
        pid = _upload(auth_server_url, _export(lambda x: x * 3, (2, 3)), alice)
        fid = _execute(http, pid, [X], **alice).json()["future_id"]
        assert http.get(f"/v1/futures/{fid}", headers=bob).status_code == 404
        r = http.get(f"/v1/futures/{fid}/result", params={"wait": 30_000}, headers=alice)
        np.testing.assert_array_equal(wire.unpackb(r.content)["outputs"][0], X * 3)


def test_cli_help_and_bad_config() -> None:
    out = subprocess.run([sys.executable, "-m", "jitserve.service", "serve", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--cache-dir" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "jitserve.service", "serve"], capture_output=True,
                         text=True, timeout=60,
                         env={"JITSERVE_API_KEYS": "changeme", "PATH": "/usr/bin:/bin"})
    assert bad.returncode == 2 and "placeholder" in bad.stderr


def test_a_wrong_method_is_405_naming_every_method_of_the_path(http: httpx.Client) -> None:
    # GET and DELETE /v1/programs/{id} are two routes: Allow names both.
    r = http.put(f"/v1/programs/{'0' * 64}")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert {"GET", "DELETE"} <= set(r.headers["allow"].split(", ")), r.headers
    assert "PUT is not allowed here" in r.json()["error"]["message"]


def test_a_future_compiled_on_demand_names_its_executable_and_tier(http: httpx.Client) -> None:
    spec = jax.ShapeDtypeStruct((5,), np.float32)
    data = bytes(export.export(jax.jit(lambda x: x * 7 - 1))(spec).serialize())
    pid = http.post("/v1/programs", content=data,
                    headers={"content-type": wire.OCTET_STREAM}).json()["program_id"]
    accepted = _execute(http, pid, [np.ones(5, np.float32)]).json()
    assert accepted["status"] == "compiling" and accepted["executable_id"] == ""
    view = http.get(f"/v1/futures/{accepted['future_id']}").json()
    deadline = time.monotonic() + 60
    while view["status"] == "compiling":  # docs/api.md: the document has them once compiled
        assert time.monotonic() < deadline
        view = http.get(f"/v1/futures/{accepted['future_id']}", params={"wait": 5000}).json()
    assert re.fullmatch(r"[0-9a-f]{64}", view["executable_id"]), view
    assert view["tier"] == "compiled", view


def test_the_api_process_never_loads_jax(server_url: str, http: httpx.Client, add_mul: str,
                                         triple: str) -> None:
    """Principle 1: what touches a program's content runs in the runtimes. The API process
    relays bytes and records (``compiler.records``) and never so much as imports jax."""
    out = _execute(http, add_mul, [X, X], wait=60_000)
    assert out.status_code == 200, out.text
    ref = {"future": wire.unpackb(out.content)["future_id"], "output": 0}
    chained = _execute(http, triple, [ref], wait=60_000)
    assert chained.status_code == 200, chained.text
    np.testing.assert_array_equal(wire.unpackb(chained.content)["outputs"][0], (X + X) * 3)
    assert http.get("/v1/executables").status_code == 200
    bad = http.post("/v1/programs", content=b"not a program",
                    headers={"content-type": wire.OCTET_STREAM})
    assert bad.status_code == 400, bad.text  # decoded, and refused, in a runtime
    assert api_loads_jax(server_url) == []
