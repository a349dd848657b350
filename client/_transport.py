"""The default HTTP transports: httpx's, reading the socket in pieces of ``READ_BYTES``.

httpcore reads a response 64 KiB at a time, and every piece goes through h11's
parser, a few context managers and httpx's stream: about 40 us of Python per
piece, which caps a big answer near 0.5 GB/s on one core (bench/service.py, P4,
where the server shares the machine). Reading up to ``READ_BYTES`` per system
call makes the pieces as big as the socket has ready, and the answer about twice
as fast. h11 takes data of any size, and each read still returns only what the
socket holds, so nothing waits for a full piece. Reads widen only while they
come back full (``_Widening``): a small answer is read 64 KiB at a time, as
httpcore reads it, without allocating a big buffer per read.

Both streams keep small writes back until the next write or read (``_hold``),
so that a request's head and a small body reach the server in one segment: one
wake-up of the server instead of two, 30-50 us of its CPU per call
(docs/performance.md).

The async stream also answers httpcore's ``is_readable`` question itself. The
pool asks it of every idle connection on every request (has the server closed
it?), and anyio's answer builds a dict of its socket's attributes each time: at
64 calls in flight that was a fifth of the client's CPU. The answer is the same
``poll`` of the same socket, which is looked up once.

httpx has no argument for httpcore's network backend, so the pool is built here
with httpx's own defaults, except that every connection the pool may open may
also stay open between requests (at 64 calls in flight, httpx's 20 kept-alive
connections meant closing and opening connections on every burst), and set on
the transport; a transport the caller passes is used as given. httpx honours proxy
environment variables only for a client without a transport, so where any is set
the client keeps httpx's own (``None``).
"""

from __future__ import annotations

import select
import socket
import ssl
import time
import urllib.request
from typing import Any, TypeVar

import httpcore
import httpx

__all__ = ["HOLD_BYTES", "READ_BYTES", "async_transport", "sync_transport"]

#: The most bytes one read of the socket asks for.
READ_BYTES = 1 << 20


class _Widening:
    """The size of the next read: doubles while reads come back full, up to ``READ_BYTES``,
    and falls back to what httpcore asks once one brings less than that (the answer
    has ended, or the socket is drained), so small answers are read as httpcore reads them."""

    def __init__(self) -> None:
        self._next = 0

    def size(self, max_bytes: int) -> int:
        self._next = max(self._next, max_bytes)
        return self._next

    def got(self, asked: int, data: bytes, max_bytes: int) -> bytes:
        if len(data) == asked:
            self._next = min(2 * asked, READ_BYTES)
        elif len(data) < max_bytes:
            self._next = max_bytes
        return data


#: Writes up to this size wait for the next write or read (``_hold``).
HOLD_BYTES = 64 << 10


def _hold(held: bytes, buffer: bytes) -> tuple[list[bytes], bytes]:
    """What to send now, and what to keep back, for a write of ``buffer`` after the
    bytes ``held`` back so far.

    httpcore writes a request's head, then its body, then reads the answer. Sent
    as two writes, a small request reaches the server in two segments, which
    wakes it twice. Small writes are kept back until the next write or read, so
    that the head and a small body go out together; a big body goes out on its own
    (joining it to the head would copy it).
    """
    if len(held) + len(buffer) <= HOLD_BYTES:
        return [], held + buffer
    if len(buffer) <= HOLD_BYTES:
        return [held + buffer], b""
    return [held, buffer] if held else [buffer], b""


class _WideStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream
        self._widening = _Widening()
        self._held = b""

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._held:
            held, self._held = self._held, b""
            self._stream.write(held, timeout)
        asked = self._widening.size(max_bytes)
        return self._widening.got(asked, self._stream.read(asked, timeout), max_bytes)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        sends, self._held = _hold(self._held, buffer)
        for data in sends:
            self._stream.write(data, timeout)

    def close(self) -> None:
        self._stream.close()

    def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                  timeout: float | None = None) -> httpcore.NetworkStream:
        return self._stream.start_tls(ssl_context, server_hostname, timeout)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _WideBackend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()

    def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                    local_address: str | None = None, socket_options: Any = None) -> _WideStream:
        return _WideStream(self._backend.connect_tcp(host, port, timeout, local_address,
                                                     socket_options))

    def connect_unix_socket(self, path: str, timeout: float | None = None,
                            socket_options: Any = None) -> _WideStream:
        return _WideStream(self._backend.connect_unix_socket(path, timeout, socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class _AsyncWideStream(httpcore.AsyncNetworkStream):
    def __init__(self, stream: httpcore.AsyncNetworkStream) -> None:
        self._stream = stream
        self._widening = _Widening()
        self._held = b""
        self._socket: socket.socket | None = stream.get_extra_info("socket")

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._held:
            held, self._held = self._held, b""
            await self._stream.write(held, timeout)
        asked = self._widening.size(max_bytes)
        return self._widening.got(asked, await self._stream.read(asked, timeout), max_bytes)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        sends, self._held = _hold(self._held, buffer)
        for data in sends:
            await self._stream.write(data, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        return await self._stream.start_tls(ssl_context, server_hostname, timeout)

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable" and self._socket is not None:
            return _readable(self._socket)
        return self._stream.get_extra_info(info)


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has data or an end to read now (httpcore's ``is_socket_readable``)."""
    if sock.fileno() == -1:
        return True
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    return bool(poll.poll(0))


class _AsyncWideBackend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.AnyIOBackend()

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Any = None) -> _AsyncWideStream:
        return _AsyncWideStream(await self._backend.connect_tcp(host, port, timeout, local_address,
                                                                socket_options))

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Any = None) -> _AsyncWideStream:
        return _AsyncWideStream(await self._backend.connect_unix_socket(path, timeout,
                                                                        socket_options))

    async def sleep(self, seconds: float) -> None:
        await self._backend.sleep(seconds)


class _OnePass:
    """httpcore's assignment of requests to connections, in one pass over the pool.

    httpcore's own (1.0) walks the pool again for every connection and for every
    queued request, and polls every idle connection's socket (has the server closed
    it?) on every pass, twice per request: at 64 calls in flight, half the client's
    CPU. It also counts every connection as an idle one, so past its keep-alive
    limit it closes each connection as soon as it goes idle. This takes the first
    free connection for a request, polls it then, hands it to one request at a time
    (HTTP/1.1: each carries one request; HTTP/2 is off in these pools), and sweeps
    the pool for closed, expired and surplus idle connections at most every
    ``SWEEP_S``, counting the idle ones.
    """

    SWEEP_S = 0.1
    _next_sweep = 0.0
    _connections: list[Any]
    _requests: list[Any]
    _max_connections: int
    _max_keepalive_connections: int
    create_connection: Any  # the pool's own

    def _assign_requests_to_connections(self) -> list[Any]:
        closing: list[Any] = []
        now = time.monotonic()
        if now >= self._next_sweep:
            self._next_sweep = now + self.SWEEP_S
            closing = self._sweep()
        queued = [r for r in self._requests if r.is_queued()]
        if not queued:
            return closing
        # A connection handed to a request that has not started on it yet still
        # looks available: handing it out again made the request retry
        # (``ConnectionNotAvailable``), a few times per request at 64 in flight.
        taken = {id(r.connection) for r in self._requests if r.connection is not None}
        for request in queued:
            origin = request.request.url.origin
            connection = self._reusable(origin, taken, closing)
            if connection is None:
                if len(self._connections) >= self._max_connections:
                    idle = next((c for c in self._connections
                                 if id(c) not in taken and c.is_idle()), None)
                    if idle is None:
                        continue  # stays queued until a connection frees up
                    self._connections.remove(idle)  # make room: an idle one, to elsewhere
                    closing.append(idle)
                connection = self.create_connection(origin)
                self._connections.append(connection)
            taken.add(id(connection))
            request.assign_to_connection(connection)
        return closing

    def _reusable(self, origin: Any, taken: set[int], closing: list[Any]) -> Any:
        """The first free connection that can carry a request to ``origin`` and has
        not expired; expired ones it meets are closed."""
        for connection in list(self._connections):
            if (id(connection) in taken or not connection.is_available()
                    or not connection.can_handle_request(origin)):
                continue
            if connection.has_expired():
                self._connections.remove(connection)
                closing.append(connection)
                continue
            return connection
        return None

    def _sweep(self) -> list[Any]:
        """Drop closed connections; close expired ones and idle ones past the keep-alive
        limit."""
        closing, kept = [], []
        idle = sum(1 for c in self._connections if c.is_idle())
        for connection in self._connections:
            if connection.is_closed():
                continue
            surplus = connection.is_idle() and idle > self._max_keepalive_connections
            if surplus or connection.has_expired():
                idle -= connection.is_idle()
                closing.append(connection)
            else:
                kept.append(connection)
        self._connections[:] = kept
        return closing


class _Pool(_OnePass, httpcore.ConnectionPool):
    pass


class _AsyncPool(_OnePass, httpcore.AsyncConnectionPool):
    pass


def _pool_options() -> dict[str, Any]:
    """httpx's defaults for a transport without a proxy (``httpx.HTTPTransport()``), but
    with every connection kept alive."""
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
    return {"ssl_context": httpx.create_ssl_context(), "max_connections": limits.max_connections,
            "max_keepalive_connections": limits.max_keepalive_connections,
            "keepalive_expiry": limits.keepalive_expiry, "http1": True, "http2": False}


def _env_proxies() -> bool:
    return any(k in ("http", "https", "all") for k in urllib.request.getproxies())


class _Cookies(httpx.Cookies):
    """A client's cookies, offered an answer only when it sets one.

    httpx wraps every answer and its request in ``urllib`` look-alikes to offer
    them to its cookie jar, a tenth of the client's CPU on a small SDK call
    (docs/performance.md). jitserve sets no cookies; a proxy in front of it may,
    and those still reach the jar. (httpx2 does the same: pydantic/httpx2#1107.)
    """

    def extract_cookies(self, response: httpx.Response) -> None:
        if "set-cookie" in response.headers:
            super().extract_cookies(response)


_C = TypeVar("_C", httpx.Client, httpx.AsyncClient)


def lean_cookies(client: _C) -> _C:
    """``client``, its cookies read only from answers that set some (``_Cookies``)."""
    client._cookies = _Cookies(client.cookies)
    return client


def sync_transport() -> httpx.HTTPTransport | None:
    """httpx's default transport, its reads widened; ``None`` where proxies are configured."""
    if _env_proxies():
        return None
    transport = httpx.HTTPTransport()
    transport._pool = _Pool(network_backend=_WideBackend(), **_pool_options())
    return transport


def async_transport() -> httpx.AsyncHTTPTransport | None:
    """The asyncio twin of ``sync_transport``."""
    if _env_proxies():
        return None
    transport = httpx.AsyncHTTPTransport()
    transport._pool = _AsyncPool(network_backend=_AsyncWideBackend(), **_pool_options())
    return transport
