"""Bounds on a request head that uvicorn lacks: a deadline and a size.

uvicorn (0.54) closes a keep-alive connection left idle after a response
(``timeout_keep_alive``), but arms that timer only once a response is complete,
and cancels it on every byte received. A fresh connection, or one whose next
request head trickles in a byte at a time, has no timer at all: thirty
connections sending one header byte per second stayed open for good. Its default
parser, httptools (llhttp), also puts no bound on a head's size (h11 has
``h11_max_incomplete_event_size``, which ``jitserve serve`` sets too).

``guarded_protocol`` subclasses uvicorn's own HTTP protocol (httptools, or h11
where httptools is missing) with ``HeadGuard``: a deadline armed when a
connection opens, and again at the first byte of each later request head,
cancelled when the head is complete (uvicorn then starts the request's cycle).
A head that misses the deadline or passes ``max_head_bytes`` gets a 400 JSON
error and the connection is closed; a connection that never sent a byte is
closed without an answer. Both are logged and counted
(``jitserve_connections_closed_total{reason}``). Bodies have their own
inactivity timeout, in the application (``service.bodies``).

The guard sees nothing of a request once its head is complete, and nothing of
the body bytes a client still sends after its answer (uvicorn reads and drops
those); it only uses the protocol attributes both uvicorn protocols share
(``transport``, ``loop``, ``client``, ``cycle``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable
from typing import Any, ClassVar

__all__ = ["HeadGuard", "HeadLimits", "QuietAccessLog", "guarded_protocol"]

log = logging.getLogger("jitserve.connections")


@dataclasses.dataclass(frozen=True)
class HeadLimits:
    """What a request head may cost.

    Attributes:
      timeout_s: from a connection's opening (or the first byte of a later request
        head) to the end of the head (``JITSERVE_HEADER_TIMEOUT_S``).
      max_bytes: the most bytes of one head: request line and headers
        (``JITSERVE_MAX_HEAD_BYTES``).
      on_close: called with the reason (``header_timeout``, ``header_too_large``)
        of each connection the guard closes: the metrics.
    """

    timeout_s: float
    max_bytes: int
    on_close: Callable[[str], None] | None = None


class HeadGuard:
    """Mixin before one of uvicorn's HTTP protocols: closes connections whose head is slow or big."""

    limits: ClassVar[HeadLimits]
    # Set by uvicorn's protocol classes.
    transport: asyncio.Transport
    loop: asyncio.AbstractEventLoop
    client: tuple[str, int] | None
    cycle: Any

    _head_timer: asyncio.TimerHandle | None = None
    _head_bytes = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._start_head()

    def data_received(self, data: bytes) -> None:
        # The first bytes of the next request head. As a rule they hold all of it:
        # the deadline is armed only if they do not (a timer per request costs more
        # than the rest of the guard).
        starting = self._head_timer is None and self._awaiting_head()
        counting = starting or self._head_timer is not None
        before = self.cycle
        super().data_received(data)  # type: ignore[misc]
        if not counting:
            return
        if self.cycle is not before:  # the head was complete: uvicorn started its request
            self._end_head()
            return
        if starting and not self.transport.is_closing():
            self._start_head()
        self._head_bytes += len(data)
        if self._head_bytes > self.limits.max_bytes and not self.transport.is_closing():
            self._refuse("header_too_large", f"the request head is over "
                         f"{self.limits.max_bytes:,} bytes (JITSERVE_MAX_HEAD_BYTES)")

    def connection_lost(self, exc: Exception | None) -> None:
        self._end_head()
        super().connection_lost(exc)  # type: ignore[misc]

    def _awaiting_head(self) -> bool:
        # Not while a request runs, nor while a client still sends a body that was
        # already answered (uvicorn drops those bytes).
        cycle = self.cycle
        return cycle is None or (cycle.response_complete and not cycle.more_body)

    def _start_head(self) -> None:
        self._end_head()
        self._head_bytes = 0
        self._head_timer = self.loop.call_later(self.limits.timeout_s, self._head_expired)

    def _end_head(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_expired(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if self._head_bytes == 0:  # opened and never used: nothing to answer
            self._count("header_timeout")
            self.transport.close()
            return
        self._refuse("header_timeout", f"the request head did not arrive whole within "
                     f"{self.limits.timeout_s:g} s (JITSERVE_HEADER_TIMEOUT_S)")

    def _refuse(self, reason: str, message: str) -> None:
        self._end_head()
        peer = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        log.info("closed the connection of %s after %d bytes of a request head: %s",
                 peer, self._head_bytes, message)
        self._count(reason)
        self.transport.write(_error_response(message))
        self.transport.close()  # sends what is buffered first

    def _count(self, reason: str) -> None:
        if self.limits.on_close is not None:
            self.limits.on_close(reason)


def _error_response(message: str) -> bytes:
    body = json.dumps({"error": {"code": "bad_request", "message": message}}).encode()
    head = ("HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode("ascii") + body


class QuietAccessLog:
    """Mixin before one of uvicorn's HTTP protocols: no access line is made that the
    ``uvicorn.access`` logger would drop.

    uvicorn works out an access line's arguments (the client's address, the path
    and query quoted again) for every answer, before the logger looks at its
    level; at ``--log-level warning`` every line is dropped, and making them cost
    1-2% of a cached call. The level is read once, when a connection opens.
    """

    access_log: bool
    access_logger: logging.Logger

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.access_log = self.access_log and self.access_logger.isEnabledFor(logging.INFO)


def guarded_protocol(limits: HeadLimits,
                     base: type[asyncio.Protocol] | None = None) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (``base``, default its own choice) with ``HeadGuard``
    (and ``QuietAccessLog``).

    Example::

        protocol = guarded_protocol(HeadLimits(timeout_s=10, max_bytes=64 << 10))
        uvicorn.run(app, http=protocol, ws="none")
    """
    if base is None:
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        base = AutoHTTPProtocol
    return type(f"Guarded{base.__name__}", (HeadGuard, QuietAccessLog, base), {"limits": limits})
