"""HTTP/1.1 to the other replicas: the forwarding hop of ``service.cluster``.

A call that lands on a replica other than the one holding its inputs is sent on
to that one and its answer relayed back, on the serving loop, once per such call.
aiohttp's general client (cookies, redirects, proxies, tracing, per-read timers)
cost 0.6-0.7 ms of that loop per forwarded call; this one does what the hop needs
and nothing else (docs/performance.md):

- keep-alive connections to a few fixed peers, one request at a time on each,
  closed after ``idle_s`` unused (less than the peers' keep-alive timeout, so no
  request goes out on a connection the peer is closing);
- request bodies with a ``Content-Length``, written with the transport's flow
  control;
- answers parsed by httptools (the parser the server itself runs on), read whole
  or streamed, with reading paused while more than ``_HIGH_BYTES`` wait unread.

Anything that goes wrong on the wire (refused, reset, closed early, a malformed
answer) is a ``PeerError``; a peer that stays silent for a time limit, a
``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import ssl
import time
import urllib.parse
from collections.abc import AsyncIterator

import httptools

__all__ = ["PeerClient", "PeerError", "PeerResponse"]

# Reading pauses while this much of an answer waits unread, and resumes below _LOW_BYTES.
_HIGH_BYTES = 4 << 20
_LOW_BYTES = 1 << 20


class PeerError(OSError):
    """The peer did not answer properly: refused, reset, closed early, or malformed."""


class PeerResponse:
    """An answer from a peer: ``status`` and ``headers`` (lower-case names) once
    its head came; its body through ``read`` or ``chunks``; then ``release``."""

    def __init__(self, connection: _Connection, read_s: float) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self._connection = connection
        self._read_s = read_s

    async def read(self) -> bytes:
        """The whole body."""
        connection, parts = self._connection, []
        while (chunk := await connection.next_chunk(self._read_s)) is not None:
            parts.append(chunk)
        return b"".join(parts)

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body, piece by piece as it arrives."""
        connection = self._connection
        while True:
            chunk = await connection.next_chunk(self._read_s)
            if chunk is None:
                return
            yield chunk

    def release(self) -> None:
        """Done with the answer: its connection is kept for the next request if the
        answer was read to its end and the peer keeps it alive, else closed."""
        self._connection.release()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to a peer, carrying one request at a time."""

    def __init__(self, client: PeerClient, key: tuple[str, int, bool]) -> None:
        self.key = key
        self.idle_since = 0.0
        self._client = client
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._response: PeerResponse | None = None
        self._head: asyncio.Future[None] | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._complete = False
        self._keep_alive = False  # what the answer's head said
        self._error: BaseException | None = None
        self._wakeup: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._paused = False

    @property
    def usable(self) -> bool:
        return self._transport is not None and not self._transport.is_closing()

    # -- the request ---------------------------------------------------------------

    async def send(self, head: bytes, body: bytes | None, read_s: float) -> PeerResponse:
        """Write a request; its answer once the answer's head came."""
        if self._transport is None:
            raise PeerError("the connection closed before the request went out")
        loop = asyncio.get_running_loop()
        self._response = response = PeerResponse(self, read_s)
        self._head = loop.create_future()
        self._chunks.clear()
        self._buffered, self._complete, self._error = 0, False, None
        if body and len(body) > 65536:
            self._transport.writelines((head, body))
        else:
            self._transport.write(head + body if body else head)
        if self._writable is not None:  # a big body: wait until the kernel took it
            await self._writable
        async with asyncio.timeout(read_s):
            await self._head
        return response

    async def next_chunk(self, read_s: float) -> bytes | None:
        """The next piece of the body; ``None`` at its end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._complete:
                return None
            self._wakeup = asyncio.get_running_loop().create_future()
            try:
                async with asyncio.timeout(read_s):
                    await self._wakeup
            finally:
                self._wakeup = None
        chunk = self._chunks.popleft()
        self._buffered -= len(chunk)
        if self._paused and self._buffered < _LOW_BYTES and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return chunk

    def release(self) -> None:
        if self._response is None:
            return
        self._response = None
        if self._complete and self._error is None and self.usable and self._keep_alive:
            self._client.keep(self)
        else:
            self.close()

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    # -- asyncio.Protocol ----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        if self._response is None:  # nothing asked: a peer does not talk first
            self._fail(PeerError("the peer sent bytes nobody asked for"))
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(PeerError(f"malformed answer from the peer: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        self._client.forget(self)
        if not self._complete:
            self._fail(PeerError(f"the peer closed the connection before its answer ended"
                                 f"{f': {exc}' if exc else ''}"))
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    # -- httptools callbacks -------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._response is not None:
            self._response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._keep_alive = self._parser.should_keep_alive()
        if self._response is not None:
            self._response.status = self._parser.get_status_code()
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        if self._buffered > _HIGH_BYTES and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self._complete = True
        self._wake()

    def _fail(self, error: PeerError) -> None:
        if self._error is None:
            self._error = error
        if self._head is not None and not self._head.done():
            self._head.set_exception(error)
        self._wake()
        self.close()

    def _wake(self) -> None:
        if self._wakeup is not None and not self._wakeup.done():
            self._wakeup.set_result(None)


class PeerClient:
    """Requests to other replicas, over the connections it keeps.

    Args:
      idle_s: how long a connection may stay unused before it is closed.
      connect_s: the longest wait for a new connection.
    """

    def __init__(self, idle_s: float, connect_s: float = 2.0) -> None:
        self._idle_s = idle_s
        self._connect_s = connect_s
        self._idle: dict[tuple[str, int, bool], list[_Connection]] = {}
        self._open: set[_Connection] = set()
        self._tls: ssl.SSLContext | None = None

    async def request(self, method: str, base: str, target: str, headers: dict[str, str],
                      body: bytes | None, read_s: float) -> PeerResponse:
        """Send ``method target`` to the peer at ``base`` (``http://host:port``); its
        answer once its head came. ``target`` is the request line's, percent-encoded;
        ``read_s`` the longest wait for the head, and then between pieces of the body."""
        key, authority = _address(base)
        lines = [f"{method} {target} HTTP/1.1\r\nHost: {authority}\r\n"
                 f"Content-Length: {len(body) if body else 0}\r\n"]
        for name, value in headers.items():
            if "\r" in value or "\n" in value:
                raise ValueError(f"header {name} has a line break")
            lines.append(f"{name}: {value}\r\n")
        lines.append("\r\n")
        head = "".join(lines).encode("latin-1")
        connection = self._take(key) or await self._connect(key)
        try:
            return await connection.send(head, body, read_s)
        except BaseException:
            connection.close()
            raise

    def keep(self, connection: _Connection) -> None:
        """Take back a connection whose answer was read: it serves the next request."""
        connection.idle_since = time.monotonic()
        self._idle.setdefault(connection.key, []).append(connection)

    def forget(self, connection: _Connection) -> None:
        """A closed connection: never handed out again."""
        self._open.discard(connection)
        idle = self._idle.get(connection.key)
        if idle and connection in idle:
            idle.remove(connection)

    async def close(self) -> None:
        """Close every connection."""
        for connection in list(self._open):
            connection.close()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports close

    def _take(self, key: tuple[str, int, bool]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()
            if connection.usable and now - connection.idle_since < self._idle_s:
                return connection
            connection.close()
        return None

    async def _connect(self, key: tuple[str, int, bool]) -> _Connection:
        host, port, tls = key
        if tls and self._tls is None:
            self._tls = ssl.create_default_context()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self, key), host, port,
                    ssl=self._tls if tls else None)
        except OSError as e:
            raise PeerError(f"cannot connect to {host}:{port}: {e}") from e
        self._open.add(connection)
        return connection


@functools.lru_cache(maxsize=256)
def _address(base: str) -> tuple[tuple[str, int, bool], str]:
    """``((host, port, tls), authority)`` of a peer's base URL."""
    parts = urllib.parse.urlsplit(base)
    tls = parts.scheme == "https"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"a peer's URL is http(s)://host[:port], not {base!r}")
    return (parts.hostname, parts.port or (443 if tls else 80), tls), parts.netloc
