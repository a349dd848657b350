"""The client of the forwarding hop (service/cluster/peers.py), over real loopback connections.

The replicas themselves use it in tests/e2e/test_replicas_e2e.py. Here a real
uvicorn server checks what a peer normally does (keep-alive, big bodies both
ways, streamed answers), and a bare asyncio server misbehaves on purpose: it
closes mid-answer, answers garbage, stays silent, or closes after each answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import uvicorn

from jitserve.service.cluster.peers import _HIGH_BYTES, PeerClient, PeerError

pytestmark = pytest.mark.timeout(120)

MiB = 1 << 20


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """``/echo`` answers the body's length and sha256; ``/big?n=`` streams n MiB."""
    if scope["type"] != "http":
        return
    digest, size = hashlib.sha256(), 0
    while True:
        message = await receive()
        digest.update(message.get("body", b""))
        size += len(message.get("body", b""))
        if not message.get("more_body"):
            break
    if scope["path"] == "/big":
        n = int(scope["query_string"].decode().removeprefix("n="))
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"x-size", str(n * MiB).encode())]})
        for k in range(n):
            await send({"type": "http.response.body", "body": bytes([k % 251]) * MiB,
                        "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    answer = f"{size} {digest.hexdigest()} {scope['query_string'].decode()}".encode()
    headers = {k.decode(): v.decode() for k, v in scope["headers"]}
    await send({"type": "http.response.start", "status": 201,
                "headers": [(b"content-type", b"text/plain"),
                            (b"x-seen-token", headers.get("x-token", "").encode())]})
    await send({"type": "http.response.body", "body": answer})


@pytest.fixture
async def uvicorn_peer() -> AsyncIterator[tuple[str, uvicorn.Server]]:
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(_app, host="127.0.0.1", port=port,
                                           log_level="warning", http="httptools"))
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    yield f"http://127.0.0.1:{port}", server
    server.should_exit = True
    await task


@contextlib.asynccontextmanager
async def _raw_peer(handle: Callable[[asyncio.StreamReader, asyncio.StreamWriter],
                                     Awaitable[None]]) -> AsyncIterator[str]:
    """A bare TCP server whose connections ``handle`` serves, however it likes."""
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            with contextlib.suppress(ConnectionError):
                await handle(reader, writer)
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield f"http://127.0.0.1:{port}"


async def _request_head(reader: asyncio.StreamReader) -> bytes:
    return await reader.readuntil(b"\r\n\r\n")


async def test_requests_reuse_one_connection_and_carry_their_bodies(
        uvicorn_peer: tuple[str, uvicorn.Server]) -> None:
    url, server = uvicorn_peer
    client = PeerClient(idle_s=5)
    try:
        for body in (b"", b"abc", bytes(range(256)) * 1000):
            answer = await client.request("POST", url, "/echo?a=1&b=%26",
                                          {"x-token": "t0k"}, body, read_s=10)
            assert answer.status == 201
            assert answer.headers["content-type"] == "text/plain"
            assert answer.headers["x-seen-token"] == "t0k"
            size, digest, query = (await answer.read()).decode().split(" ")
            answer.release()
            assert (int(size), digest) == (len(body), hashlib.sha256(body).hexdigest())
            assert query == "a=1&b=%26"
        await asyncio.sleep(0.1)  # a connection closed would be gone by now
        assert len(server.server_state.connections) == 1
    finally:
        await client.close()


async def test_big_bodies_go_and_come_whole(uvicorn_peer: tuple[str, uvicorn.Server]) -> None:
    url, _ = uvicorn_peer
    client = PeerClient(idle_s=5)
    try:
        body = bytes(range(256)) * (128 * 1024)  # 32 MiB, more than the transport buffers
        answer = await client.request("POST", url, "/echo", {}, body, read_s=30)
        assert (await answer.read()).split(b" ")[:2] == [
            str(len(body)).encode(), hashlib.sha256(body).hexdigest().encode()]
        answer.release()
        # A streamed answer read slowly: reading pauses, nothing is lost.
        answer = await client.request("GET", url, "/big?n=24", {}, None, read_s=30)
        await asyncio.sleep(0.5)  # not reading: the peer could have sent it all by now
        assert answer._connection._buffered <= _HIGH_BYTES + 2 * MiB  # it waits in its socket
        got = hashlib.sha256()
        async for chunk in answer.chunks():
            got.update(chunk)
            await asyncio.sleep(0)
        answer.release()
        want = hashlib.sha256(b"".join(bytes([k % 251]) * MiB for k in range(24)))
        assert got.hexdigest() == want.hexdigest()
    finally:
        await client.close()


async def test_an_idle_connection_is_not_used_after_idle_s(
        uvicorn_peer: tuple[str, uvicorn.Server]) -> None:
    url, server = uvicorn_peer
    client = PeerClient(idle_s=0.2)
    try:
        for pause in (0.0, 0.4):
            await asyncio.sleep(pause)
            answer = await client.request("GET", url, "/echo", {}, None, read_s=5)
            await answer.read()
            answer.release()
        await asyncio.sleep(0.1)
        assert len(server.server_state.connections) == 1  # the first one was closed
    finally:
        await client.close()


@pytest.mark.parametrize(("reply", "body"), [
    (b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part", None),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok", b"ok"),
], ids=["closed-mid-answer", "connection-close"])
async def test_a_connection_the_peer_closes_is_not_used_again(reply: bytes,
                                                              body: bytes | None) -> None:
    connections = 0

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await _request_head(reader)
        writer.write(reply)  # and close
        await writer.drain()

    async with _raw_peer(handle) as url:
        client = PeerClient(idle_s=5)
        for _ in range(2):
            answer = await client.request("GET", url, "/", {}, None, read_s=5)
            assert answer.status == 200
            if body is None:
                with pytest.raises(PeerError, match="closed the connection"):
                    await answer.read()
            else:
                assert await answer.read() == body
            answer.release()
        assert connections == 2
        with pytest.raises(ValueError, match="line break"):
            await client.request("GET", url, "/", {"x-a": "b\r\nx-evil: 1"}, None, read_s=5)
        await client.close()


@pytest.mark.parametrize("reply", [b"garbage\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Length: x\r\n\r\n"])
async def test_a_malformed_answer_is_an_error(reply: bytes) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_head(reader)
        writer.write(reply)
        await writer.drain()
        await reader.read()  # until the client gives up on it

    async with _raw_peer(handle) as url:
        client = PeerClient(idle_s=5)
        with pytest.raises(PeerError, match="malformed"):
            await client.request("GET", url, "/", {}, None, read_s=5)
        await client.close()


async def test_a_silent_peer_times_out_and_a_closed_port_is_refused() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _request_head(reader)
        await reader.read()  # silent, until the client gives up

    async with _raw_peer(handle) as url:
        client = PeerClient(idle_s=5)
        with pytest.raises(TimeoutError):
            await client.request("GET", url, "/", {}, None, read_s=0.2)
        await client.close()
    with pytest.raises(PeerError, match="cannot connect"):
        await PeerClient(idle_s=5).request("GET", f"http://127.0.0.1:{_free_port()}", "/",
                                           {}, None, read_s=1)
