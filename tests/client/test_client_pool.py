"""The SDK's connection pools (client/_transport.py) against a real HTTP/1.1 server.

The server is the standard library's threading HTTP server on loopback, keeping
connections alive, so the pools open, reuse and lose real sockets.
"""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from jitserve.client._transport import async_transport, sync_transport

pytestmark = pytest.mark.timeout(60)


@dataclass
class Server:
    url: str
    connections: int = 0
    in_flight: int = 0
    most_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    # When set, each answer waits until this many requests are in (all at once).
    together: threading.Barrier | None = None
    open: set[socket.socket] = field(default_factory=set)  # the connections it holds
    closed: int = 0

    def close_idle(self) -> None:
        """Close every connection, as a server does to kept-alive ones at its idle timeout
        (call it with no request in flight). Closed by the test, not by a timer, so
        that no request races a close on a slow machine."""
        with self.lock:
            held = list(self.open)
        for sock in held:
            try:
                sock.shutdown(socket.SHUT_RDWR)  # its handler reads the end and finishes
            except OSError:
                pass
        deadline = time.monotonic() + 30
        while self.closed < self.connections and time.monotonic() < deadline:
            time.sleep(0.01)
        assert self.closed == self.connections


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    """Answers every POST after 20 ms (or once ``together`` requests are in); keeps
    connections open until ``close_idle``."""
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                 "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    state = Server("")

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        timeout = 60  # a handler never outlives a test by much

        def setup(self) -> None:
            super().setup()
            with state.lock:
                state.connections += 1
                state.open.add(self.connection)

        def finish(self) -> None:
            try:
                super().finish()
            finally:
                with state.lock:
                    state.open.discard(self.connection)
                    state.closed += 1

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if self.headers.get("transfer-encoding") == "chunked":
                body = b""
                while size := int(self.rfile.readline().strip(), 16):
                    body += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
            else:
                body = self.rfile.read(int(self.headers["content-length"]))
            with state.lock:
                state.in_flight += 1
                state.most_in_flight = max(state.most_in_flight, state.in_flight)
            if state.together is not None:
                state.together.wait(timeout=20)
            else:
                time.sleep(0.02)
            with state.lock:
                state.in_flight -= 1
            self.send_response(200)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    class Httpd(http.server.ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 128  # 64 connections may arrive at once

    httpd = Httpd(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield state
    httpd.shutdown()
    httpd.server_close()


async def _burst(client: httpx.AsyncClient, url: str, n: int) -> None:
    async def one(i: int) -> None:
        r = await client.post(url, content=str(i).encode())
        assert r.status_code == 200 and r.content == str(i).encode()

    await asyncio.gather(*(one(i) for i in range(n)))


async def test_64_in_flight_share_connections_across_bursts(server: Server) -> None:
    server.together = threading.Barrier(64)  # 64 requests at once, on 64 connections
    transport = async_transport()
    assert transport is not None
    async with httpx.AsyncClient(transport=transport) as client:
        await _burst(client, server.url, 64)
        opened = server.connections
        assert server.most_in_flight == 64 and opened == 64
        for _ in range(3):
            await _burst(client, server.url, 64)
    # httpcore 1.0's pool closed each connection past 20 as it went idle, so every
    # burst opened most of its connections again
    assert server.connections - opened <= 8


async def test_requests_never_wait_on_a_connection_another_request_holds(
        server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    transport = async_transport()
    assert transport is not None
    pool = transport._pool
    sends = 0
    original = type(pool).handle_async_request

    async def counted(self, request):  # noqa: ANN001, ANN202
        nonlocal sends
        sends += 1
        return await original(self, request)

    connection_cls = None
    async with httpx.AsyncClient(transport=transport) as client:
        await _burst(client, server.url, 8)  # some connections to reuse
        connection_cls = type(pool.connections[0])
        attempts = 0
        original_attempt = connection_cls.handle_async_request

        async def attempt(self, request):  # noqa: ANN001, ANN202
            nonlocal attempts
            attempts += 1
            return await original_attempt(self, request)

        monkeypatch.setattr(connection_cls, "handle_async_request", attempt)
        monkeypatch.setattr(type(pool), "handle_async_request", counted)
        server.together = threading.Barrier(64)
        await _burst(client, server.url, 64)
    assert sends == 64
    assert attempts == 64  # one attempt each: no ConnectionNotAvailable and retry


async def test_a_connection_the_server_closed_is_not_reused(server: Server) -> None:
    transport = async_transport()
    assert transport is not None
    async with httpx.AsyncClient(transport=transport) as client:
        await _burst(client, server.url, 4)
        opened = server.connections
        server.close_idle()
        await _burst(client, server.url, 4)
        assert server.connections > opened  # new connections, and no failed request


def test_sync_pool_reuses_and_recovers(server: Server) -> None:
    transport = sync_transport()
    assert transport is not None
    with httpx.Client(transport=transport) as client:
        for i in range(5):
            assert client.post(server.url, content=b"x%d" % i).content == b"x%d" % i
        assert server.connections == 1
        server.close_idle()
        assert client.post(server.url, content=b"again").content == b"again"
        assert server.connections == 2


@pytest.mark.parametrize("size", [0, 10, 64 << 10, (64 << 10) + 1, 3 << 20])
def test_bodies_of_every_size_arrive_whole(server: Server, size: int) -> None:
    transport = sync_transport()
    assert transport is not None
    body = bytes(range(256)) * (size // 256) + b"z" * (size % 256)
    with httpx.Client(transport=transport) as client:
        for _ in range(3):
            assert client.post(server.url, content=body).content == body


async def test_async_bodies_and_chunked_uploads_arrive_whole(server: Server) -> None:
    transport = async_transport()
    assert transport is not None

    async def pieces():  # noqa: ANN202 - a chunked body: many small writes
        for i in range(50):
            yield b"%03d," % i

    async with httpx.AsyncClient(transport=transport) as client:
        r = await client.post(server.url, content=b"small")
        assert r.content == b"small"
        r = await client.post(server.url, content=pieces())
        assert r.content == b"".join(b"%03d," % i for i in range(50))
