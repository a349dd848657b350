"""Request bodies in and array answers out, without holding more copies than needed.

Bodies are read in pieces, counted against ``max_body_bytes`` as they arrive
(a ``Content-Length`` over the limit is refused before reading a byte), and
decoded with the shared wire codec (``client.wire``): msgpack unless the
``Content-Type`` says JSON. Arrays decode as zero-copy views of the message.

The buffer grows with the bytes that arrived, never with the ``Content-Length``
a client claims: a header that declares 1 GiB and sends 10 bytes costs 10 bytes.
It doubles (capped at the declared length) by ``realloc``, which glibc does in
place at the top of the heap or by remapping a block of its own, so a real 256 MiB
body is read into one buffer, in the common case without a regrowth copy, as fast
as into one allocated up front (bench/service.py, P4). A body whose bytes stop
arriving for ``JITSERVE_BODY_TIMEOUT_S`` is a 400 that closes the connection; a
client that disconnects mid-body raises Starlette's ``ClientDisconnect``, which
``service.errors`` logs as such.

Array answers are msgpack unless the caller asks for JSON: an ``Accept`` of JSON
without msgpack, or a JSON request body and no msgpack ``Accept``. A msgpack answer
is streamed: small msgpack pieces for the structure and, for each array, a ``bin``
header followed by slices of the array's own buffer, so a large result is never
copied into one big byte string.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.requests import ClientDisconnect

from jitserve import wire

from ..calls.calls import Calls
from ..calls.futures import Future
from ..errors import (
    BadRequest,
    PayloadTooLarge,
    ServiceError,
    UnsupportedMediaType,
)
from ..metrics import Metrics
from . import jsonwire

__all__ = ["BodyReader", "BodyTimeout", "array_response", "outputs_response", "wants_json"]

log = logging.getLogger("jitserve.bodies")

# CPython's resize of a bytearray (a public C API function): a realloc to exactly
# the size asked, the new tail left unwritten. ``bytearray +=`` grows by 1/8 at a
# time, and a realloc that cannot grow in place (two big bodies arriving at once)
# copies and leaves a hole; doubling makes those moves few. A prototype of our
# own, so the shared ``ctypes.pythonapi`` function keeps its settings.
_resize = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_ssize_t)(
    ("PyByteArray_Resize", ctypes.pythonapi))
# The first allocation of a body whose size is not known yet.
_FIRST_BYTES = 64 << 10
# A body declared this small is taken whole when it comes in one message.
_SMALL_BYTES = 64 << 10


class BodyTimeout(BadRequest):
    """The body stopped arriving; the answer closes the connection, whose stream is unusable."""

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}


class BodyReader:
    """Reads one request's body, bounded by ``max_bytes`` and by ``timeout_s`` between pieces.

    Args:
      request: the request whose body this reads (once).
      max_bytes: the most bytes the body may have (413 beyond).
      limit_name: the setting behind ``max_bytes``, for the error message.
      timeout_s: the longest wait for the next piece of the body (400 ``BodyTimeout`` after).
      metrics: where stalled bodies are counted; ``None`` counts nothing.
    """

    def __init__(self, request: Request, max_bytes: int,
                 limit_name: str = "JITSERVE_MAX_BODY_BYTES", *, timeout_s: float = 30.0,
                 metrics: Metrics | None = None) -> None:
        self.request = request
        self.max_bytes = max_bytes
        self.limit_name = limit_name
        self.timeout_s = timeout_s
        self.metrics = metrics

    async def read(self) -> bytearray:
        """The whole body; ``PayloadTooLarge`` as soon as it passes the limit."""
        declared = self._declared_length()
        first = b""
        if declared is not None and declared <= _SMALL_BYTES:
            # A small body comes with the head, as a rule, in one message: taken as it
            # is, without the stream and the idle timer below, which cost more than
            # the rest of a cached call's reading (docs/performance.md).
            first, more = await self._first_piece(declared)
            if not more:
                if len(first) != declared:
                    raise BadRequest(f"body ended {_got(len(first), declared)}")
                return bytearray(first)
        limit = self.max_bytes if declared is None else declared
        buf, size = bytearray(), 0
        stream = self.request.stream()
        try:
            async with _idle_timeout(self.timeout_s) as progress:
                async for chunk in _after(first, stream):
                    progress()
                    end = size + len(chunk)
                    if end > limit:
                        raise self._over(declared)
                    if end > len(buf):  # twice what arrived, never more than the limit
                        _resize(buf, min(limit, max(end, 2 * len(buf), _FIRST_BYTES)))
                    buf[size:end] = chunk  # same length: a copy into place, no resize
                    size = end
        except TimeoutError:
            raise self._stalled(_got(size, declared)) from None
        except ClientDisconnect as e:
            raise ClientDisconnect(_got(size, declared)) from e
        finally:
            await stream.aclose()
        if declared is not None and size != declared:
            raise BadRequest(f"body ended {_got(size, declared)}")
        del buf[size:]
        return buf

    async def _first_piece(self, declared: int) -> tuple[bytes, bool]:
        """The body's first piece, and whether more follows.

        Its time limit is a timer that cancels the task, as ``asyncio.timeout``
        does, without that context manager's own work: a third of the reading of
        a small body that arrived with its head.
        """
        task = asyncio.current_task()
        assert task is not None
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            task.cancel()

        timer = asyncio.get_running_loop().call_later(self.timeout_s, expire)
        try:
            message = await self.request.receive()
        except asyncio.CancelledError:
            if expired and task.uncancel() == 0:  # ours, and nobody else's
                raise self._stalled(_got(0, declared)) from None
            raise
        finally:
            timer.cancel()
        if message["type"] == "http.disconnect":
            raise ClientDisconnect(_got(0, declared))
        body = message.get("body", b"")
        if len(body) > declared:
            raise self._over(declared)
        return body, message.get("more_body", False)

    async def message(self) -> Any:
        """The body decoded as msgpack or JSON (by ``Content-Type``); ``None`` if empty."""
        return (await self.raw_message())[1]

    async def raw_message(self) -> tuple[bytearray, Any]:
        """The body, and the body decoded as ``message`` decodes it."""
        kind = self._content_kind()
        body = await self.read()
        if not body:
            return body, None
        if kind == "json":
            return body, jsonwire.loads(body, max_bytes=self.max_bytes)
        return body, wire.unpackb(body, max_bytes=self.max_bytes)

    def _declared_length(self) -> int | None:
        raw = self.request.headers.get("content-length")
        if raw is None:
            return None
        if not raw.isdigit():
            raise BadRequest(f"Content-Length must be a non-negative integer, got {raw!r:.40}")
        if int(raw) > self.max_bytes:
            raise self._too_large(int(raw))
        return int(raw)

    def _over(self, declared: int | None) -> ServiceError:
        if declared is None:
            return self._too_large()
        return BadRequest(f"body is longer than its Content-Length of {declared}")

    def _stalled(self, got: str) -> BodyTimeout:
        req = self.request
        log.info("request body stalled: no bytes for %s s %s (JITSERVE_BODY_TIMEOUT_S): %s %s",
                 self.timeout_s, got, req.method, req.url.path)
        if self.metrics is not None:
            self.metrics.body_aborted("timeout")
        return BodyTimeout(f"no request body bytes arrived for {self.timeout_s:g} s {got} "
                           f"(JITSERVE_BODY_TIMEOUT_S); send the body without pauses",
                           timeout_s=self.timeout_s)

    def _content_kind(self) -> str:
        ctype = _media_type(self.request.headers.get("content-type", ""))
        if _is_json(ctype):
            return "json"
        if ctype in ("", wire.OCTET_STREAM, *wire.MSGPACK_TYPES):
            return "msgpack"
        raise UnsupportedMediaType(
            f"unsupported Content-Type {ctype!r}; send application/msgpack or application/json")

    def _too_large(self, size: int | None = None) -> PayloadTooLarge:
        got = f"{size:,} bytes" if size is not None else "more"
        return PayloadTooLarge(f"request body is {got}, over the limit of {self.max_bytes:,} bytes "
                               f"({self.limit_name})", limit=self.max_bytes)


@contextlib.asynccontextmanager
async def _idle_timeout(timeout_s: float) -> AsyncIterator[Callable[[], None]]:
    """``TimeoutError`` in the block once ``timeout_s`` pass without a call of ``progress()``.

    One timer per block, moved only when it fires: an ``asyncio.timeout`` around
    each piece costs about 5 us, 20 ms of a 256 MiB body's 64 KiB pieces.
    """
    loop = asyncio.get_running_loop()
    last = loop.time()

    def progress() -> None:
        nonlocal last
        last = loop.time()

    timer: asyncio.TimerHandle

    async with asyncio.timeout(None) as deadline:
        def check() -> None:
            nonlocal timer
            idle = loop.time() - last
            if idle >= timeout_s:
                deadline.reschedule(loop.time())  # expire now: the block is cancelled
            else:
                timer = loop.call_later(timeout_s - idle, check)

        timer = loop.call_later(timeout_s, check)
        try:
            yield progress
        finally:
            timer.cancel()


async def _after(first: bytes, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """``first``, if any, then ``stream``'s pieces."""
    if first:
        yield first
    async for chunk in stream:
        yield chunk


def _got(received: int, declared: int | None) -> str:
    of = "" if declared is None else f" of {declared:,}"
    return f"after {received:,}{of} bytes"


def wants_json(request: Request) -> bool:
    """Whether the caller wants JSON answers: JSON in gives JSON out unless ``Accept`` differs.

    An ``Accept`` naming msgpack wins; one naming JSON asks for JSON; otherwise a
    request whose body is JSON (``Content-Type``) gets JSON, and any other msgpack.
    """
    headers = request.headers
    accept, content_type = headers.get("accept", ""), headers.get("content-type", "")
    if len(accept) + len(content_type) <= _KEPT_BYTES:  # clients repeat theirs
        return _known_wants_json(accept, content_type)
    return _wants_json(accept, content_type)


_KEPT_BYTES = 128


@functools.lru_cache(maxsize=256)
def _known_wants_json(accept: str, content_type: str) -> bool:
    return _wants_json(accept, content_type)


def _wants_json(accept: str, content_type: str) -> bool:
    accept = accept.lower()
    if any(t in accept for t in wire.MSGPACK_TYPES):
        return False
    return wire.JSON in accept or _is_json(_media_type(content_type))


def _media_type(header: str) -> str:
    return header.split(";")[0].strip().lower()


def _is_json(media_type: str) -> bool:
    return media_type == wire.JSON or media_type.endswith("+json")


def array_response(doc: Mapping[str, Any], as_json: bool, status_code: int = 200, *,
                   nbytes: int | None = None) -> Response:
    """An answer holding numpy arrays: JSON (nested lists) or msgpack, streamed when big.

    ``nbytes``: the arrays' bytes in all, when the caller knows them; under
    ``wire.STREAM_BYTES`` the body is packed in one call of the C packer, which
    touches a tenth of the Python code that cutting it into pieces does.
    """
    if as_json:
        return Response(jsonwire.dumps(doc), status_code, media_type=wire.JSON)
    if nbytes is not None and nbytes < wire.STREAM_BYTES:
        return Response(wire.packb(doc), status_code, media_type=wire.MSGPACK)
    body = wire.PackedBody(wire.pack_pieces(doc))
    if body.nbytes < wire.STREAM_BYTES:
        return Response(body.join(), status_code, media_type=wire.MSGPACK)
    # An async iterator: slicing views never blocks, so no thread hop per chunk.
    return StreamingResponse(aiter(body), status_code, media_type=wire.MSGPACK,
                             headers={"Content-Length": str(body.nbytes)})


async def outputs_response(fut: Future, calls: Calls, as_json: bool,
                           which: list[int] | None = None) -> Response:
    """The outputs of a done future (``which``: those only) as an answer
    (``Calls.outputs``); they stay on their runtime as well."""
    host = await calls.outputs(fut, which)
    nbytes = sum(a.nbytes for a in host)
    return array_response({"future_id": fut.future_id, "outputs": host, "out_tree": fut.out_tree},
                          as_json, nbytes=nbytes)
