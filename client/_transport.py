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

httpx has no argument for httpcore's network backend, so the pool is built here
with httpx's own defaults and set on the transport; a transport the caller passes
is used as given. httpx honours proxy environment variables only for a client
without a transport, so where any is set the client keeps httpx's own (``None``).
"""

from __future__ import annotations

import ssl
import urllib.request
from typing import Any

import httpcore
import httpx

__all__ = ["READ_BYTES", "async_transport", "sync_transport"]

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


class _WideStream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream) -> None:
        self._stream = stream
        self._widening = _Widening()

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        asked = self._widening.size(max_bytes)
        return self._widening.got(asked, self._stream.read(asked, timeout), max_bytes)

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self._stream.write(buffer, timeout)

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

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        asked = self._widening.size(max_bytes)
        return self._widening.got(asked, await self._stream.read(asked, timeout), max_bytes)

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        await self._stream.write(buffer, timeout)

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        return await self._stream.start_tls(ssl_context, server_hostname, timeout)

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


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


def _pool_options() -> dict[str, Any]:
    """httpx's defaults for a transport without a proxy (``httpx.HTTPTransport()``)."""
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=20)
    return {"ssl_context": httpx.create_ssl_context(), "max_connections": limits.max_connections,
            "max_keepalive_connections": limits.max_keepalive_connections,
            "keepalive_expiry": limits.keepalive_expiry, "http1": True, "http2": False}


def _env_proxies() -> bool:
    return any(k in ("http", "https", "all") for k in urllib.request.getproxies())


def sync_transport() -> httpx.HTTPTransport | None:
    """httpx's default transport, its reads widened; ``None`` where proxies are configured."""
    if _env_proxies():
        return None
    transport = httpx.HTTPTransport()
    transport._pool = httpcore.ConnectionPool(network_backend=_WideBackend(), **_pool_options())
    return transport


def async_transport() -> httpx.AsyncHTTPTransport | None:
    """The asyncio twin of ``sync_transport``."""
    if _env_proxies():
        return None
    transport = httpx.AsyncHTTPTransport()
    transport._pool = httpcore.AsyncConnectionPool(network_backend=_AsyncWideBackend(),
                                                   **_pool_options())
    return transport
