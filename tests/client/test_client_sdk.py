"""Client and AsyncClient: request shaping, answers, error mapping, configuration."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np
import pytest

from jitserve import client
from jitserve.client import (
    NOT_GIVEN,
    APIError,
    AsyncClient,
    Aval,
    BadRequest,
    Client,
    ConnectError,
    FutureCancelled,
    FutureExpired,
    FutureFailed,
    FuturePending,
    JitserveError,
    JitserveTimeout,
    NotFound,
    PayloadTooLarge,
    ProgramError,
    ProtocolError,
    RequestTimeout,
    ServerError,
    Timeout,
    TooManyRequests,
    TransportError,
    Unauthorized,
    wire,
)
from jitserve.client._base import platforms_of

pytestmark = pytest.mark.timeout(60)

URL = "http://jitserve.test"
PID = "ab" * 32
PROGRAM_DOC = {"program_id": PID, "format": "stablehlo",
               "in_avals": [{"shape": [None, 3], "dtype": "float32"}, {"shape": ["b"], "dtype": "int32"}],
               "out_avals": None, "in_tree": None, "out_tree": {"tuple": [None]},
               "platforms": ["cpu"]}


def mock(handler: Callable[[httpx.Request], httpx.Response], **kw: Any) -> Client:
    return Client(URL, transport=httpx.MockTransport(handler), **{"api_key": None, **kw})


def amock(handler: Callable[[httpx.Request], httpx.Response], **kw: Any) -> AsyncClient:
    return AsyncClient(URL, transport=httpx.MockTransport(handler), **{"api_key": None, **kw})


def reply(doc: Any, status: int = 200) -> Callable[[httpx.Request], httpx.Response]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(status, json=doc)

    handler.seen = seen  # type: ignore[attr-defined]
    return handler


# --------------------------------------------------------------------- requests


def test_headers_auth_and_user_agent() -> None:
    h = reply({"status": "ok"})
    with mock(h, api_key="s3cret", headers={"X-Trace": "1"}) as c:
        c.health()
    req = h.seen[0]  # type: ignore[attr-defined]
    assert req.headers["authorization"] == "Bearer s3cret"
    assert req.headers["x-trace"] == "1"
    assert req.headers["user-agent"].startswith("jitserve-client/")
    assert req.headers["accept"].startswith(wire.MSGPACK)
    assert req.url == f"{URL}/healthz"


def test_api_key_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JITSERVE_API_KEY", "from-env")
    assert Client(URL).api_key == "from-env"
    assert Client(URL, api_key=NOT_GIVEN).api_key == "from-env"
    assert Client(URL, api_key=None).api_key is None
    h = reply({"status": "ok"})
    with mock(h, api_key=None) as c:
        c.health()
    assert "authorization" not in h.seen[0].headers  # type: ignore[attr-defined]


def test_base_url_with_a_path_prefix() -> None:
    h = reply(PROGRAM_DOC)
    with Client(URL + "/prefix/", api_key=None, transport=httpx.MockTransport(h)) as c:
        c.get_program(PID)
    assert h.seen[0].url.path == f"/prefix/v1/programs/{PID}"  # type: ignore[attr-defined]


def test_ids_are_quoted_into_one_path_segment() -> None:
    h = reply({"future_id": "x", "status": "done"})
    with mock(h) as c:
        c.delete("../programs/x?y")
    assert h.seen[0].url.raw_path == b"/v1/futures/..%2Fprograms%2Fx%3Fy"  # type: ignore[attr-defined]


def test_upload() -> None:
    h = reply(PROGRAM_DOC, 201)
    with mock(h) as c:
        info = c.upload(b"\x00module", format="stablehlo")
    req = h.seen[0]  # type: ignore[attr-defined]
    assert (req.method, req.url.path, req.url.params["format"]) == ("POST", "/v1/programs", "stablehlo")
    assert req.headers["content-type"] == "application/octet-stream"
    assert req.content == b"\x00module"
    assert info.program_id == PID and info.platforms == ("cpu",)
    assert info.in_avals == (Aval((None, 3), "float32"), Aval(("b",), "int32"))
    assert info.out_avals is None and info.out_tree == {"tuple": [None]}


def test_upload_without_format_sends_no_param() -> None:
    h = reply(PROGRAM_DOC)
    with mock(h) as c:
        c.upload(bytearray(b"x"))
    assert "format" not in h.seen[0].url.params  # type: ignore[attr-defined]


def test_get_program_none_on_404() -> None:
    with mock(lambda r: httpx.Response(404, json={"error": {"code": "not_found", "message": "no"}})) as c:
        assert c.get_program(PID) is None
    with mock(reply(PROGRAM_DOC)) as c:
        assert c.get_program(PID).format == "stablehlo"  # type: ignore[union-attr]


@pytest.mark.parametrize("wire_format", ["msgpack", "json"])
def test_compile_body(wire_format: str) -> None:
    h = reply({"executable_id": "e" * 64, "tier": "disk", "compile_seconds": 0.25,
               "in_avals": [{"shape": [2, 3], "dtype": "float32"}],
               "out_avals": [{"shape": [2], "dtype": "float32", "weak_type": True}],
               "out_tree": None})
    with mock(h, wire_format=wire_format) as c:
        info = c.compile(PID, in_avals=[np.zeros((2, 3), np.float32)], static_key="k")
    req = h.seen[0]  # type: ignore[attr-defined]
    assert req.url.path == f"/v1/programs/{PID}/compile"
    body = (wire.loads_json if wire_format == "json" else wire.unpackb)(req.content)
    assert body == {"static_key": "k", "in_avals": [{"shape": [2, 3], "dtype": "float32"}]}
    assert info.tier == "disk" and info.compile_seconds == 0.25
    assert info.out_avals == (Aval((2,), "float32", weak_type=True),)


def test_compile_accepts_avals_in_many_forms() -> None:
    h = reply({"executable_id": "e", "tier": "memory", "compile_seconds": 0,
               "in_avals": [], "out_avals": []})
    with mock(h) as c:
        c.compile(PID, in_avals=[Aval((1,), "int8"), {"shape": [2], "dtype": "bool"}])
        c.compile(PID)
    first, second = (wire.unpackb(r.content) for r in h.seen)  # type: ignore[attr-defined]
    assert first["in_avals"] == [{"shape": [1], "dtype": "int8"}, {"shape": [2], "dtype": "bool"}]
    assert "in_avals" not in second


def accepted(fid: str = "f1", avals: Any = None) -> dict[str, Any]:
    return {"future_id": fid, "status": "pending", "executable_id": "e", "tier": "memory",
            "out_tree": None, "out_avals": avals or [{"shape": [2], "dtype": "float32"}]}


def test_execute_202_body_and_remote_arrays() -> None:
    h = reply(accepted(avals=[{"shape": [2], "dtype": "float32"}, {"shape": [], "dtype": "int4"}]), 202)
    with mock(h) as c:
        outs = c.execute(PID, [np.arange(2, dtype=np.float32), {"future": "f0", "output": 1}, 3.0],
                         static_key="s")
    req = h.seen[0]  # type: ignore[attr-defined]
    assert req.url.path == f"/v1/programs/{PID}/execute" and "wait" not in req.url.params
    assert req.headers["content-type"] == wire.MSGPACK
    body = wire.unpackb(req.content)
    assert body["static_key"] == "s"
    np.testing.assert_array_equal(body["args"][0], np.arange(2, dtype=np.float32))
    assert body["args"][1] == {"future": "f0", "output": 1}
    assert body["args"][2].shape == () and body["args"][2].dtype == np.float64
    assert [(o.future_id, o.index, o.shape, o.dtype.name) for o in outs] == [
        ("f1", 0, (2,), "float32"), ("f1", 1, (), "int4")]


def test_execute_remote_array_args_are_sent_as_references() -> None:
    h = reply(accepted(), 202)
    with mock(h) as c:
        (y,) = c.execute(PID, [np.zeros(2, np.float32)])
        c.execute(PID, [y])
    assert wire.unpackb(h.seen[1].content)["args"] == [{"future": "f1", "output": 0}]  # type: ignore[attr-defined]


def test_execute_with_wait_gets_outputs_inline() -> None:
    out = np.arange(4, dtype=np.int32).reshape(2, 2)
    calls: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        return httpx.Response(200, content=wire.packb({"future_id": "f9", "outputs": [out],
                                                       "out_tree": None}),
                              headers={"content-type": wire.MSGPACK})

    with mock(handler, timeout=Timeout(5, poll=2.0)) as c:
        (r,) = c.execute(PID, [], wait=10)
        assert calls[0].url.params["wait"] == "2000"  # capped at timeout.poll
        np.testing.assert_array_equal(r.result(), out)
        assert r.done() and (r.shape, r.dtype) == ((2, 2), np.int32)
    assert len(calls) == 1  # the value came with the execute answer


def test_wait_is_added_to_the_read_timeout() -> None:
    seen: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions["timeout"])
        return httpx.Response(202, json=accepted())

    with mock(handler, timeout=Timeout(7.0, connect=1.0, poll=30.0)) as c:
        c.execute(PID, [], wait=3.0)
        c.execute(PID, [])
    assert seen[0]["read"] == 10.0 and seen[0]["connect"] == 1.0
    assert seen[1]["read"] == 7.0


def test_future_info_and_long_poll_param() -> None:
    doc = {"future_id": "f1", "status": "failed", "out_avals": [],
           "error": {"code": "compile_failed", "message": "boom"},
           "timings": {"queued_s": 0.1, "compile_s": 1.0, "run_s": None},
           "created": 1.5, "expires_at": 99.0}
    h = reply(doc)
    with mock(h) as c:
        info = c.future("f1", wait=1.5)
    assert h.seen[0].url.params["wait"] == "1500"  # type: ignore[attr-defined]
    assert info.done and info.status == "failed" and info.error == doc["error"]
    assert info.timings["compile_s"] == 1.0 and info.expires_at == 99.0


def test_result_long_polls_until_done() -> None:
    out = np.ones(3, np.float32)
    answers = [httpx.Response(409, json={"error": {"code": "future_pending", "message": "later"}})] * 3
    answers.append(httpx.Response(200, content=wire.packb({"outputs": [out]}),
                                  headers={"content-type": wire.MSGPACK}))
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers[len(seen) - 1]

    with mock(handler, timeout=Timeout(5, poll=0.05)) as c:
        (value,) = c.result("f1")
    np.testing.assert_array_equal(value, out)
    assert [r.url.params["wait"] for r in seen] == ["50"] * 4
    assert all(r.url.path == "/v1/futures/f1/result" for r in seen)


def test_result_times_out_with_jitserve_timeout() -> None:
    pending = httpx.Response(409, json={"error": {"code": "future_pending", "message": "later"}})
    with mock(lambda r: pending, timeout=Timeout(5, poll=0.02)) as c:
        with pytest.raises(JitserveTimeout, match="not done after 0.1 s") as info:
            c.result("f1", wait=0.1)
    assert isinstance(info.value, TimeoutError) and info.value.request is not None
    assert isinstance(info.value.__cause__, FuturePending)


def test_result_wait_zero_asks_once_without_wait() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(409, json={"error": {"code": "future_pending", "message": "later"}})

    with mock(handler) as c, pytest.raises(JitserveTimeout):
        c.result("f1", wait=0)
    assert len(seen) == 1 and "wait" not in seen[0].url.params


def test_delete_devices_ready() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/readyz":
            return httpx.Response(503, json={"error": {"code": "internal", "message": "warming"}})
        if request.method == "DELETE":
            return httpx.Response(200, json={"future_id": "f1", "status": "cancelled"})
        return httpx.Response(200, json={"platform": "cpu", "devices": [{"id": 0}]})

    with mock(handler) as c:
        assert c.delete("f1") == "cancelled"
        assert c.devices()["platform"] == "cpu"
        assert c.ready() is False


def test_json_wire_format_accept_and_decoding() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=wire.dumps_json({"outputs": [np.eye(2, dtype=np.float32)]}),
                              headers={"content-type": "application/json; charset=utf-8"})

    with mock(handler, wire_format="json") as c:
        (value,) = c.result("f1")
    assert seen[0].headers["accept"] == wire.JSON
    np.testing.assert_array_equal(value, np.eye(2, dtype=np.float32))


def test_bad_wire_format() -> None:
    with pytest.raises(ValueError, match="wire_format"):
        Client(URL, wire_format="xml")  # type: ignore[arg-type]


# --------------------------------------------------------------------- errors

ERRORS = [
    (400, "bad_request", BadRequest),
    (400, "invalid_program", ProgramError),
    (400, "signature_mismatch", ProgramError),
    (422, "unsafe_program", ProgramError),
    (422, "compile_failed", ProgramError),
    (422, "compile_timeout", ProgramError),
    (422, "platform_mismatch", ProgramError),
    (413, "limit_exceeded", ProgramError),
    (401, "unauthorized", Unauthorized),
    (404, "not_found", NotFound),
    (413, "payload_too_large", PayloadTooLarge),
    (429, "too_many_requests", TooManyRequests),
    (409, "future_pending", FuturePending),
    (422, "future_failed", FutureFailed),
    (409, "future_cancelled", FutureCancelled),
    (410, "future_expired", FutureExpired),
    (500, "internal", ServerError),
    (503, "overloaded", ServerError),  # an unknown code: by status
    (415, "unsupported_media_type", BadRequest),
    (403, "forbidden", Unauthorized),
]


@pytest.mark.parametrize("status, code, cls", ERRORS)
def test_error_mapping(status: int, code: str, cls: type[APIError]) -> None:
    doc = {"error": {"code": code, "message": "what went wrong", "limit": 5}}
    with mock(reply(doc, status)) as c, pytest.raises(cls) as info:
        c.devices()
    e = info.value
    assert type(e) is cls and isinstance(e, (APIError, JitserveError))
    assert (e.status_code, e.code, e.message, e.details) == (status, code, "what went wrong", {"limit": 5})
    assert e.request is not None and e.request.url.path == "/v1/devices"
    assert e.response is not None and e.response.status_code == status
    assert str(e) == f"{status} {code}: what went wrong"


def test_too_many_requests_retry_after() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": {"code": "too_many_requests", "message": "busy"}},
                              headers={"Retry-After": "3"})

    with mock(handler) as c, pytest.raises(TooManyRequests) as info:
        c.health()
    assert info.value.retry_after == 3.0


def test_future_failed_carries_the_server_error() -> None:
    doc = {"error": {"code": "future_failed", "message": "NaN in output",
                     "cause": {"code": "internal", "message": "x"}}}
    with mock(reply(doc, 422)) as c, pytest.raises(FutureFailed) as info:
        c.result("f1")
    assert info.value.error == {"code": "future_failed", "message": "NaN in output",
                                "cause": {"code": "internal", "message": "x"}}


@pytest.mark.parametrize("status, body, cls", [
    (502, b"<html>bad gateway</html>", ServerError),
    (404, b"", NotFound),
    (418, b"teapot", BadRequest),
])
def test_errors_without_an_error_document(status: int, body: bytes, cls: type[APIError]) -> None:
    with mock(lambda r: httpx.Response(status, content=body, headers={"content-type": "text/html"})) as c:
        with pytest.raises(cls) as info:
            c.health()
    assert info.value.status_code == status
    assert info.value.code == ("internal" if status >= 500 else f"http_{status}")
    assert info.value.message


@pytest.mark.parametrize("exc, cls", [
    (httpx.ConnectError("refused"), ConnectError),
    (httpx.ConnectTimeout("slow"), RequestTimeout),
    (httpx.ReadTimeout("slow"), RequestTimeout),
    (httpx.RemoteProtocolError("reset"), TransportError),
])
def test_transport_errors(exc: Exception, cls: type[TransportError]) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    with mock(handler) as c, pytest.raises(cls) as info:
        c.health()
    assert type(info.value) is cls and info.value.request is not None
    assert info.value.__cause__ is exc
    if cls is RequestTimeout:
        assert isinstance(info.value, (JitserveTimeout, TimeoutError))


@pytest.mark.parametrize("content, ctype, match", [
    (b"\xc1", wire.MSGPACK, "undecodable answer"),
    (b"{", wire.JSON, "undecodable answer"),
    (b'{"future_id": 3}', wire.JSON, "future document"),
    (b'["not", "a", "map"]', wire.JSON, "expected a JSON object"),
])
def test_protocol_errors(content: bytes, ctype: str, match: str) -> None:
    with mock(lambda r: httpx.Response(200, content=content, headers={"content-type": ctype})) as c:
        with pytest.raises(ProtocolError, match=match) as info:
            c.future("f1")
    assert info.value.request is not None


def test_max_response_bytes() -> None:
    big = wire.packb({"outputs": [np.zeros(1000, np.uint8)]})
    with mock(lambda r: httpx.Response(200, content=big, headers={"content-type": wire.MSGPACK}),
              max_response_bytes=100) as c, pytest.raises(ProtocolError, match="over the limit"):
        c.result("f1")


def test_malformed_outputs_are_protocol_errors() -> None:
    with mock(reply({"outputs": [1, 2]})) as c, pytest.raises(ProtocolError, match="outputs"):
        c.result("f1")


# --------------------------------------------------------------------- configuration


def test_timeout_value_object() -> None:
    t = Timeout(10.0)
    assert (t.request, t.connect, t.poll) == (10.0, 10.0, 30.0)
    assert Timeout(10.0, connect=None).connect is None
    assert Timeout.of(3).request == 3 and Timeout.of(None).request is None
    assert Timeout.of(t) is t
    assert t.to_httpx(wait=5).read == 15.0
    assert Timeout(None).to_httpx(wait=5).read is None
    with pytest.raises(ValueError, match="poll"):
        Timeout(poll=0)
    assert Timeout().hold == 0.002 and Timeout(hold=0).hold == 0
    for hold in (-1.0, 31.0):
        with pytest.raises(ValueError, match="hold must be from 0 to poll"):
            Timeout(hold=hold)
    with pytest.raises(TypeError):
        Client(URL, "key")  # type: ignore[misc]  # configuration is keyword-only


def test_client_timeout_float() -> None:
    assert Client(URL, timeout=2.5).timeout == Timeout(2.5)


def test_repr_and_context_manager() -> None:
    with Client(URL + "/") as c:
        assert repr(c) == f"Client('{URL}')"
    assert c._http.is_closed


def test_not_given_is_falsy_and_named() -> None:
    assert not NOT_GIVEN and repr(NOT_GIVEN) == "NOT_GIVEN"


@pytest.mark.parametrize("doc, expected", [
    ({"platform": "cpu"}, ("cpu",)),
    ({"platform": "gpu", "platform_version": "cuda 12.4"}, ("cuda",)),
    ({"platform": "gpu", "platform_version": "rocm 6"}, ("rocm",)),
    ({"devices": [{"platform": "tpu"}, {"platform": "tpu"}]}, ("tpu",)),
    ([{"platform": "CPU"}], ("cpu",)),
    ({"devices": "nope"}, None),
    ({"backend": {"platform": "gpu", "platform_version": "PJRT C API\ncuda 12030"},
      "devices": [{"id": 0, "platform": "gpu", "device_kind": "NVIDIA H100"}]}, ("cuda",)),
    (None, None),
    ("text", None),
])
def test_platforms_of(doc: Any, expected: Any) -> None:
    assert platforms_of(doc) == expected


# --------------------------------------------------------------------- async twin


async def test_async_client_shapes_the_same_requests() -> None:
    h = reply(accepted(), 202)
    async with amock(h, api_key="k") as c:
        outs = await c.execute(PID, [np.zeros(2, np.float32)], wait=0.5)
        assert outs[0].shape == (2,)
    req = h.seen[0]  # type: ignore[attr-defined]
    assert req.headers["authorization"] == "Bearer k" and req.url.params["wait"] == "500"


async def test_async_error_mapping_and_transport_errors() -> None:
    async with amock(reply({"error": {"code": "not_found", "message": "gone"}}, 404)) as c:
        assert await c.get_program(PID) is None
        with pytest.raises(NotFound):
            await c.future("f1")

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    async with amock(refuse) as c:
        with pytest.raises(ConnectError):
            await c.health()


async def test_async_result_long_poll_and_timeout() -> None:
    pending = httpx.Response(409, json={"error": {"code": "future_pending", "message": "later"}})
    async with amock(lambda r: pending, timeout=Timeout(5, poll=0.02)) as c:
        with pytest.raises(JitserveTimeout):
            await c.result("f1", wait=0.1)


async def test_async_misc_routes() -> None:
    doc = {"future_id": "f1", "status": "done", "platform": "cpu", **PROGRAM_DOC}
    async with amock(reply(doc)) as c:
        assert (await c.upload(b"x")).program_id == PID
        assert await c.delete("f1") == "done"
        assert (await c.devices())["platform"] == "cpu"
        assert (await c.health())["status"] == "done"
        assert await c.ready() is True
        assert (await c.future("f1")).status == "done"


def test_package_exports_are_sorted_and_complete() -> None:
    assert client.__all__ == sorted(client.__all__)
    assert all(hasattr(client, name) for name in client.__all__)


def test_error_tree_docstring_names_every_error() -> None:
    from jitserve.client import errors

    for name in errors.__all__:
        obj = getattr(errors, name)
        if isinstance(obj, type):
            assert name in (errors.__doc__ or ""), name
            assert issubclass(obj, JitserveError)


def test_json_error_body_is_plain_json() -> None:
    # Servers answer errors in JSON even to msgpack clients; make sure we read both.
    body = json.dumps({"error": {"code": "bad_request", "message": "no"}}).encode()
    with mock(lambda r: httpx.Response(400, content=body, headers={"content-type": wire.JSON})) as c:
        with pytest.raises(BadRequest, match="400 bad_request: no"):
            c.health()
    packed = wire.packb({"error": {"code": "bad_request", "message": "mp"}})
    with mock(lambda r: httpx.Response(400, content=packed, headers={"content-type": wire.MSGPACK})) as c:
        with pytest.raises(BadRequest, match="mp"):
            c.health()


@pytest.mark.parametrize("module", ["jitserve.wire", "jitserve.wire._codec", "jitserve.wire._aval",
                                    "jitserve.client._models"])
def test_docstring_examples(module: str) -> None:
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.failed == 0 and result.attempted > 0


def test_an_async_client_refuses_a_second_event_loop_naming_the_fix() -> None:
    """httpx's connections and the sender's task belong to the loop the client first ran
    in; another loop (a second ``asyncio.run``) failed with 'Event loop is closed'."""
    c = amock(reply({"status": "ok"}))
    assert asyncio.run(c.health()) == {"status": "ok"}
    with pytest.raises(RuntimeError, match="first used in a closed event loop.*make an "
                                           "AsyncClient in each event loop"):
        asyncio.run(c.health())
