"""Big request bodies are streamed from the arrays' buffers, with a Content-Length."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from jitserve import wire
from jitserve.client import AsyncClient, Client

PROGRAM = "a" * 64


def _capture(seen: list[httpx.Request]) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        request.read()
        seen.append(request)
        return httpx.Response(202, json={"future_id": "f" * 32, "out_avals": [], "out_tree": None})

    return httpx.MockTransport(handler)


def _check(request: httpx.Request, x: np.ndarray) -> None:
    assert request.headers["content-length"] == str(len(request.content))
    assert "transfer-encoding" not in request.headers
    assert request.content == wire.packb({"args": [x]})


@pytest.mark.parametrize("nbytes", [1 << 10, 3 << 20])
def test_sync_body_bytes_and_length(nbytes: int) -> None:
    x = np.arange(nbytes // 4, dtype=np.float32)
    seen: list[httpx.Request] = []
    with Client("http://test", transport=_capture(seen)) as c:
        c.execute(PROGRAM, [x])
    _check(seen[-1], x)


async def test_async_body_streams_too() -> None:
    x = np.arange(3 << 18, dtype=np.float32)
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(202, json={"future_id": "f" * 32, "out_avals": [], "out_tree": None})

    async def ahandler(request: httpx.Request) -> httpx.Response:
        await request.aread()
        return handler(request)

    async with AsyncClient("http://test", transport=httpx.MockTransport(ahandler)) as c:
        await c.execute(PROGRAM, [x])
    _check(seen[-1], x)


def test_packed_body_is_packb() -> None:
    doc = {"outputs": [np.ones((1000, 1000)), np.zeros(3, np.int8)], "out_tree": None}
    body = wire.PackedBody(wire.pack_pieces(doc))
    assert b"".join(bytes(c) for c in body) == wire.packb(doc) == body.join()
    assert body.nbytes == len(body.join())


def test_a_batch_of_calls_packs_as_packb() -> None:
    # Dicts and lists of scalars are packed whole (one call of msgpack's packer each);
    # the bytes must stay packb's, whatever mix of values surrounds them.
    import collections

    refs = [{"future": f"{i:032x}", "output": i} for i in range(25)]
    doc = {"calls": [{"program_id": "p" * 64, "args": [*refs, np.ones((64, 784), np.float32),
                                                       {"call": 0, "output": 1}],
                      "donate": [0, 1], "inline": True},
                     {"program_id": "q", "args": [np.int32(3), (1, 2.5), [True, None, "s"]],
                      "ordered": collections.OrderedDict(b=[np.zeros(2)]), "nested": [[1], {}]}]}
    body = wire.PackedBody(wire.pack_pieces(doc))
    assert b"".join(bytes(c) for c in body) == wire.packb(doc) == body.join()


def test_future_references_are_told_apart() -> None:
    import collections

    assert wire.is_future_ref({"future": "f", "output": 0})
    assert wire.is_future_ref(collections.OrderedDict(future="f", output=2))
    for other in ({"future": "f", "output": True}, {"future": "f", "output": 0, "x": 1},
                  {"future": 1, "output": 0}, {"call": 0, "output": 0}, {"future": "f"},
                  np.zeros(2), ["future", "output"], "future", 3, None):
        assert not wire.is_future_ref(other), other


def _result_transport(doc: dict) -> httpx.MockTransport:
    body = wire.packb(doc)

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": wire.MSGPACK})

    return httpx.MockTransport(handler)


@pytest.mark.parametrize("nbytes", [1 << 10, 3 << 20])
def test_big_answer_is_read_into_one_buffer(nbytes: int) -> None:
    x = np.arange(nbytes // 8, dtype=np.float64)
    with Client("http://test", transport=_result_transport({"outputs": [x]})) as c:
        (got,) = c.result("f" * 32)
    np.testing.assert_array_equal(got, x)


async def test_big_answer_async() -> None:
    x = np.arange(3 << 17, dtype=np.float64)
    async with AsyncClient("http://test", transport=_result_transport({"outputs": [x]})) as c:
        (got,) = await c.result("f" * 32)
    np.testing.assert_array_equal(got, x)
