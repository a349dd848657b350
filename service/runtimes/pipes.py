"""The API process's ends of a runtime's pipes: ``LoopReader`` reads its replies,
``PipeWriter`` writes its requests.

Both speak ``frames``' framing (``multiprocessing.connection``'s: a length, then
the bytes; ``frames.Pipe`` on the runtime's side), and neither ever blocks the
event loop that serves callers: the reader reads what the pipe holds when the
loop says it is readable, and the writer leaves what a full pipe does not take
to a thread of its own (docs/runtimes.md). What the messages say is
``protocol``'s; supervision, and what a reply settles, are ``pool``'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import threading
from collections.abc import Callable
from typing import Any, TypeAlias

from . import frames

__all__ = ["Dispatch", "LoopReader", "PipeWriter"]

_READ_BYTES = 1 << 20

# What a reader hands each reply to, with the loop that read it (``None``: a thread).
Dispatch: TypeAlias = Callable[[dict[str, Any], asyncio.AbstractEventLoop | None], None]


class LoopReader:
    """Reads one runtime's answers, framed as ``multiprocessing`` frames them
    (``frames.Pipe``), and hands each to ``dispatch`` with the loop that read it
    (``None`` from a thread). ``attach`` reads on an event loop; ``read_rest`` in the
    calling thread (a pool without a loop, or the rest after its loop closed). At
    the end of the pipe (or on an error) it stops reading and sets ``ended``; only
    then may the pipe be closed. ``garbled``: it stopped at a frame that was no
    message: not msgpack, or not a map (``protocol``; a runtime runs strangers' code,
    so no frame of its is trusted to be one).
    """

    def __init__(self, fd: int, dispatch: Dispatch) -> None:
        self.fd = fd
        self.ended = threading.Event()
        self.garbled = False
        self._dispatch = dispatch
        self._buffer = bytearray()
        self._loop: asyncio.AbstractEventLoop | None = None

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start reading on ``loop`` (call it on that loop)."""
        self._loop = loop
        os.set_blocking(self.fd, False)
        loop.add_reader(self.fd, self._readable)

    def read_rest(self) -> None:
        os.set_blocking(self.fd, True)
        self._loop = None
        while not self.ended.is_set():
            try:
                data = os.read(self.fd, _READ_BYTES)
            except OSError:
                data = b""
            if not data or not self._feed(data):
                self.ended.set()

    def _readable(self) -> None:
        try:
            data = os.read(self.fd, _READ_BYTES)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data or not self._feed(data):
            assert self._loop is not None
            self._loop.remove_reader(self.fd)
            self.ended.set()

    def _feed(self, data: bytes) -> bool:
        """Dispatch the whole frames ``data`` completes; ``False`` on one that is no message."""
        buffer = self._buffer
        if buffer:
            buffer += data
            size, header = frames.frame_size(buffer, 0)
            if size is not None and len(buffer) < header + size:
                return True  # a big frame, not whole yet: copied once it is
            data = bytes(buffer)
            buffer.clear()
        start = 0
        while True:
            size, header = frames.frame_size(data, start)
            if size is None or len(data) < start + header + size:
                break
            begin = start + header
            start = begin + size
            try:
                message = frames.unpack(data[begin:start])
            except ValueError:
                message = None
            if not isinstance(message, dict):
                self.garbled = True
                return False
            self._dispatch(message, self._loop)
        if start < len(data):
            buffer += memoryview(data)[start:]
        return True


class PipeWriter:
    """Writes frames to a runtime's request pipe, never blocking the caller.

    While all of a runtime's threads are busy (compiles of new programs, say) it
    reads nothing, and a write that did not fit used to block the event loop that
    made it: every request of the API process waited for those compiles
    (docs/runtimes.md). Now what does not fit waits here, in order, and a thread
    of this writer's own sends it as the pipe takes it. The thread starts at the
    first write that does not fit and then waits for the next, until ``close``:
    a loop that runs ahead fills the pipe every few calls, and starting a thread
    each time cost the event loop a tenth of its time on such a loop.
    """

    def __init__(self, fd: int, name: str) -> None:
        self._fd = fd
        self._name = name
        os.set_blocking(fd, False)
        self._lock = threading.Lock()
        self._more = threading.Condition(self._lock)  # something waits, or closed
        self._pending = bytearray()
        self._closed = False
        self._thread: threading.Thread | None = None

    def write(self, data: bytes) -> None:
        """Send ``data``, framed, after what waits; ``BrokenPipeError`` once closed."""
        head = frames.header(len(data))
        with self._lock:
            if self._closed:
                raise BrokenPipeError(f"{self._name}: the pipe is closed")
            if self._pending:
                self._pending += head
                self._pending += data
            else:
                try:  # header and message in one call, neither copied
                    n = os.writev(self._fd, (head, data))
                except BlockingIOError:
                    n = 0
                if n == len(head) + len(data):
                    return
                if n < len(head):
                    self._pending += head[n:]
                    n = len(head)
                self._pending += memoryview(data)[n - len(head):]
            if self._thread is None:
                self._thread = threading.Thread(target=self._drain, name=self._name, daemon=True)
                self._thread.start()
            else:
                self._more.notify()

    def _drain(self) -> None:
        while True:
            with self._lock:
                while not self._pending and not self._closed:
                    self._more.wait()
                if self._closed:
                    return
            with contextlib.suppress(OSError, ValueError):  # closed meanwhile: seen below
                select.select([], [self._fd], [], 1.0)
            with self._lock:
                if self._closed:
                    return
                try:
                    del self._pending[:os.write(self._fd, self._pending)]
                except BlockingIOError:
                    continue
                except OSError:  # the process is gone: its supervisor fails its calls
                    self._pending.clear()

    def close(self) -> None:
        """Drop what waits; once this returns the descriptor is not written again."""
        with self._lock:
            self._closed = True
            self._pending.clear()
            self._more.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
