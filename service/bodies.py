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

import struct
from collections.abc import Iterator, Mapping
from typing import Any

import msgpack
import numpy as np
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from starlette.concurrency import run_in_threadpool

from client import wire
from service.errors import BadRequest, PayloadTooLarge, UnsupportedMediaType
from service.futures import Future
from service.metrics import Metrics

__all__ = ["BodyReader", "array_response", "outputs_response", "wants_json"]

# Big buffers go out in slices of this size: uvicorn copies each chunk it frames.
_SLICE = 1 << 20
_MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")


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
        if ctype == "application/json" or ctype.endswith("+json"):
            return "json"
        if ctype in ("", "application/octet-stream", *_MSGPACK_TYPES):
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
    return "application/json" in accept and not any(t in accept for t in _MSGPACK_TYPES)


def array_response(doc: Mapping[str, Any], as_json: bool, status_code: int = 200) -> Response:
    """An answer holding numpy arrays: JSON (nested lists) or streamed msgpack."""
    if as_json:
        return Response(wire.dumps_json(doc), status_code, media_type=wire.JSON)
    pieces = list(_msgpack_pieces(doc))
    length = sum(memoryview(p).nbytes for p in pieces)
    return StreamingResponse(_sliced(pieces), status_code, media_type=wire.MSGPACK,
                             headers={"Content-Length": str(length)})


async def outputs_response(fut: Future, metrics: Metrics, as_json: bool) -> Response:
    """The outputs of a done future as an answer; they stay on the device as well."""
    outputs = fut.outputs
    if outputs is None:
        raise BadRequest(f"future {fut.future_id} has no outputs")
    host = await run_in_threadpool(_to_host, outputs)
    metrics.transferred("out", sum(a.nbytes for a in host))
    return array_response({"future_id": fut.future_id, "outputs": host, "out_tree": fut.out_tree},
                          as_json)


def _to_host(outputs: list[Any]) -> list[np.ndarray]:
    # On CPU a view of the device buffer; on an accelerator a copy to the host.
    return [np.asarray(x) for x in outputs]


def _msgpack_pieces(obj: Any) -> Iterator[bytes | memoryview]:
    """msgpack ``obj`` as pieces; array data is yielded as views of the arrays."""
    packer = msgpack.Packer(use_bin_type=True, autoreset=True)
    yield from _pack(packer, obj)


def _pack(packer: msgpack.Packer, obj: Any) -> Iterator[bytes | memoryview]:
    if isinstance(obj, np.ndarray):
        obj = wire.encode_array(obj)
    if isinstance(obj, Mapping):
        yield packer.pack_map_header(len(obj))
        for key, value in obj.items():
            yield packer.pack(key)
            yield from _pack(packer, value)
    elif isinstance(obj, (list, tuple)):
        yield packer.pack_array_header(len(obj))
        for value in obj:
            yield from _pack(packer, value)
    elif isinstance(obj, memoryview):
        yield _bin_header(obj.nbytes)
        yield obj
    else:
        yield packer.pack(obj)


def _bin_header(n: int) -> bytes:
    """The msgpack ``bin 8/16/32`` header for ``n`` bytes (msgpack.Packer has no such call)."""
    if n < 1 << 8:
        return struct.pack(">BB", 0xC4, n)
    if n < 1 << 16:
        return struct.pack(">BH", 0xC5, n)
    if n < 1 << 32:
        return struct.pack(">BI", 0xC6, n)
    raise BadRequest(f"an array of {n:,} bytes is too large for msgpack (max 4 GiB)")


def _sliced(pieces: list[bytes | memoryview]) -> Iterator[bytes | memoryview]:
    """Join small pieces, cut big ones: few chunks, none bigger than ``_SLICE``."""
    small = bytearray()
    for piece in pieces:
        view = memoryview(piece).cast("B")
        if view.nbytes < _SLICE:
            small += view
            if len(small) >= _SLICE:
                yield bytes(small)
                small.clear()
            continue
        if small:
            yield bytes(small)
            small.clear()
        for start in range(0, view.nbytes, _SLICE):
            yield view[start:start + _SLICE]
    if small:
        yield bytes(small)
