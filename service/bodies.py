"""Request bodies in and array answers out, without holding more copies than needed.

Bodies are read in pieces, counted against ``max_body_bytes`` as they arrive
(a ``Content-Length`` over the limit is refused before reading a byte), and
decoded with the shared wire codec (``client.wire``): msgpack unless the
``Content-Type`` says JSON. Arrays decode as zero-copy views of the message.

Array answers are msgpack unless the caller ``Accept``s only JSON. A msgpack answer
is streamed: small msgpack pieces for the structure and, for each array, a ``bin``
header followed by slices of the array's own buffer, so a large result is never
copied into one big byte string.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from jitserve import wire
from jitserve.service.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType
from jitserve.service.futures import Future
from jitserve.service.metrics import Metrics

__all__ = ["BodyReader", "array_response", "outputs_response", "wants_json"]



class BodyReader:
    """Reads one request's body, bounded by ``max_bytes``."""

    def __init__(self, request: Request, max_bytes: int,
                 limit_name: str = "JITSERVE_MAX_BODY_BYTES") -> None:
        self.request = request
        self.max_bytes = max_bytes
        self.limit_name = limit_name

    async def read(self) -> bytearray:
        """The whole body; ``PayloadTooLarge`` as soon as it passes the limit."""
        declared = self._declared_length()
        if declared is not None:
            return await self._read_exact(declared)
        buf = bytearray()
        async for chunk in self.request.stream():
            if len(buf) + len(chunk) > self.max_bytes:
                raise self._too_large()
            buf += chunk
        return buf

    async def message(self) -> Any:
        """The body decoded as msgpack or JSON (by ``Content-Type``); ``None`` if empty."""
        kind = self._content_kind()
        body = await self.read()
        if not body:
            return None
        if kind == "json":
            return wire.loads_json(body, max_bytes=self.max_bytes)
        return wire.unpackb(body, max_bytes=self.max_bytes)

    def _declared_length(self) -> int | None:
        raw = self.request.headers.get("content-length")
        if raw is None:
            return None
        if not raw.isdigit():
            raise BadRequest(f"Content-Length must be a non-negative integer, got {raw!r:.40}")
        if int(raw) > self.max_bytes:
            raise self._too_large(int(raw))
        return int(raw)

    async def _read_exact(self, length: int) -> bytearray:
        # One buffer of the declared size: no regrowth copies for big bodies.
        buf = bytearray(length)
        view, pos = memoryview(buf), 0
        async for chunk in self.request.stream():
            if pos + len(chunk) > length:
                raise BadRequest(f"body is longer than its Content-Length of {length}")
            view[pos:pos + len(chunk)] = chunk
            pos += len(chunk)
        view.release()
        if pos != length:
            raise BadRequest(f"body ended after {pos} of {length} bytes")
        return buf

    def _content_kind(self) -> str:
        ctype = self.request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype == wire.JSON or ctype.endswith("+json"):
            return "json"
        if ctype in ("", wire.OCTET_STREAM, *wire.MSGPACK_TYPES):
            return "msgpack"
        raise UnsupportedMediaType(
            f"unsupported Content-Type {ctype!r}; send application/msgpack or application/json")

    def _too_large(self, size: int | None = None) -> PayloadTooLarge:
        got = f"{size:,} bytes" if size is not None else "more"
        return PayloadTooLarge(f"request body is {got}, over the limit of {self.max_bytes:,} bytes "
                               f"({self.limit_name})", limit=self.max_bytes)


def wants_json(request: Request) -> bool:
    """Whether the caller asked for JSON answers (``Accept: application/json``)."""
    accept = request.headers.get("accept", "").lower()
    return wire.JSON in accept and not any(t in accept for t in wire.MSGPACK_TYPES)


def array_response(doc: Mapping[str, Any], as_json: bool, status_code: int = 200) -> Response:
    """An answer holding numpy arrays: JSON (nested lists) or streamed msgpack."""
    if as_json:
        return Response(wire.dumps_json(doc), status_code, media_type=wire.JSON)
    body = wire.PackedBody(wire.pack_pieces(doc))
    if body.nbytes < wire.STREAM_BYTES:
        return Response(body.join(), status_code, media_type=wire.MSGPACK)
    # An async iterator: slicing views never blocks, so no thread hop per chunk.
    return StreamingResponse(aiter(body), status_code, media_type=wire.MSGPACK,
                             headers={"Content-Length": str(body.nbytes)})


async def outputs_response(fut: Future, metrics: Metrics, as_json: bool) -> Response:
    """The outputs of a done future as an answer; they stay on the device as well."""
    outputs = fut.outputs
    if outputs is None:
        raise BadRequest(f"future {fut.future_id} has no outputs")
    small = sum(x.nbytes for x in outputs) < wire.STREAM_BYTES
    # Small outputs come to the host in microseconds: a thread hop would cost more.
    host = _to_host(outputs) if small else await run_in_threadpool(_to_host, outputs)
    metrics.transferred("out", sum(a.nbytes for a in host))
    return array_response({"future_id": fut.future_id, "outputs": host, "out_tree": fut.out_tree},
                          as_json)


def _to_host(outputs: list[Any]) -> list[np.ndarray]:
    # On CPU a view of the device buffer; on an accelerator a copy to the host.
    return [np.asarray(x) for x in outputs]
