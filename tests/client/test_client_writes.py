"""A request's head and a small body leave in one write (client/_transport.py).

httpcore writes the head, then the body, then reads the answer; the SDK's
streams keep small writes back until the next write or read, so a small request
reaches the server in one segment, and a big body is sent as it is, never copied
onto its head. The SDK's e2e tests run every call through these streams.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpcore

from jitserve.client._transport import HOLD_BYTES, _AsyncWideStream, _WideStream


class _Recorder(httpcore.NetworkStream):
    """The socket side of a stream: records each write, answers reads with b"ok"."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.writes.append(buffer)

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return b"ok"

    def get_extra_info(self, info: str) -> Any:
        return None


class _AsyncRecorder(httpcore.AsyncNetworkStream):
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.writes.append(buffer)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return b"ok"

    def get_extra_info(self, info: str) -> Any:
        return None


HEAD = b"POST /v1/x HTTP/1.1\r\nContent-Length: 4096\r\n\r\n"


def test_head_and_small_body_go_out_together_at_the_read() -> None:
    inner = _Recorder()
    stream = _WideStream(inner)
    stream.write(HEAD)
    stream.write(b"b" * 4096)
    assert inner.writes == []  # kept until the answer is read
    assert stream.read(65536) == b"ok"
    assert inner.writes == [HEAD + b"b" * 4096]
    stream.write(HEAD)  # the next request starts empty
    stream.read(65536)
    assert inner.writes[1:] == [HEAD]


def test_a_big_body_goes_out_as_it_is() -> None:
    inner = _Recorder()
    stream = _WideStream(inner)
    big = b"x" * (HOLD_BYTES + 1)
    stream.write(HEAD)
    stream.write(big)
    assert inner.writes == [HEAD, big] and inner.writes[1] is big  # not copied
    stream.write(b"tail")  # a small piece after it waits for the read
    stream.read(65536)
    assert inner.writes[2:] == [b"tail"]


def test_small_pieces_join_up_to_the_bound_then_go_with_the_next() -> None:
    inner = _Recorder()
    stream = _WideStream(inner)
    piece = b"p" * (HOLD_BYTES // 2)
    stream.write(piece)
    stream.write(piece)  # exactly the bound: still held
    assert inner.writes == []
    stream.write(b"q")  # over it: what was held goes, with this
    assert inner.writes == [piece + piece + b"q"]
    stream.read(65536)
    assert inner.writes == [piece + piece + b"q"]  # nothing was left held


def test_the_async_stream_holds_the_same_way() -> None:
    async def run() -> list[bytes]:
        inner = _AsyncRecorder()
        stream = _AsyncWideStream(inner)
        await stream.write(HEAD)
        await stream.write(b"b" * 100)
        assert inner.writes == []
        assert await stream.read(65536) == b"ok"
        return inner.writes

    assert asyncio.run(run()) == [HEAD + b"b" * 100]
