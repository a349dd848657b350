"""A msgpack reader that hands big ``bin`` values out as views of the message.

msgpack's own decoder copies every ``bin`` into a ``bytes`` of its own: for a
message that carries a 256 MiB array that is a second 256 MiB, in fresh pages
(on the machines measured, touching fresh pages cost more than the copy:
0.2-0.4 s per 256 MiB, bench/service.py P4). This reader walks the message's
structure in Python and returns each ``bin`` of at least ``VIEW_BYTES`` as a
read-only ``memoryview`` of the message, so arrays decode as views of the buffer
the body was read into.

It is only worth it, and only used, for big messages made of few objects. It
visits at most ``budget`` objects; past that, or on anything it does not expect
(extension types, malformed or truncated input, non-string map keys), it gives
up (``None``) and the caller decodes with msgpack's C decoder, which also words
the error of a malformed message.
"""

from __future__ import annotations

import struct
from typing import Any

__all__ = ["VIEW_BYTES", "unpack_views"]

#: ``bin`` values of at least this many bytes become views; smaller ones ``bytes``.
VIEW_BYTES = 64 << 10

_FIXED = {  # type byte -> (struct format, size) of fixed-size scalars
    0xCA: (">f", 4), 0xCB: (">d", 8),
    0xCC: (">B", 1), 0xCD: (">H", 2), 0xCE: (">I", 4), 0xCF: (">Q", 8),
    0xD0: (">b", 1), 0xD1: (">h", 2), 0xD2: (">i", 4), 0xD3: (">q", 8),
}
_LENGTH = {  # type byte -> (kind, struct format of the length, its size)
    0xC4: ("bin", ">B", 1), 0xC5: ("bin", ">H", 2), 0xC6: ("bin", ">I", 4),
    0xD9: ("str", ">B", 1), 0xDA: ("str", ">H", 2), 0xDB: ("str", ">I", 4),
    0xDC: ("array", ">H", 2), 0xDD: ("array", ">I", 4),
    0xDE: ("map", ">H", 2), 0xDF: ("map", ">I", 4),
}
_CONSTANTS = {0xC0: None, 0xC2: False, 0xC3: True}


class _GiveUp(Exception):
    """Not a message this reader decodes; msgpack's decoder takes over."""


def unpack_views(data: memoryview, *, max_str_len: int, max_depth: int,
                 budget: int = 4096) -> Any:
    """``data`` (a 1-d byte ``memoryview``) decoded, big bins as views; ``None`` to give up.

    ``None`` also when the message is ``nil``: the caller decodes it again, cheaply.
    """
    reader = _Reader(data.toreadonly(), max_str_len, max_depth, budget)
    try:
        obj = reader.value(0)
    except (_GiveUp, struct.error, UnicodeDecodeError, IndexError):
        return None
    return obj if reader.pos == len(data) else None


class _Reader:
    def __init__(self, data: memoryview, max_str_len: int, max_depth: int, budget: int) -> None:
        self.data, self.pos, self.left = data, 0, budget
        self.max_str_len, self.max_depth = max_str_len, max_depth

    def _take(self, n: int) -> memoryview:
        start, end = self.pos, self.pos + n
        if end > len(self.data):
            raise _GiveUp
        self.pos = end
        return self.data[start:end]

    def value(self, depth: int) -> Any:
        self.left -= 1
        if self.left < 0 or depth > self.max_depth:
            raise _GiveUp
        b = self.data[self.pos]
        self.pos += 1
        if b <= 0x7F or b >= 0xE0:  # positive and negative fixint
            return b if b <= 0x7F else b - 0x100
        if b <= 0x8F:
            return self._map(b & 0x0F, depth)
        if b <= 0x9F:
            return [self.value(depth + 1) for _ in range(b & 0x0F)]
        if b <= 0xBF:
            return self._str(b & 0x1F)
        if b in _CONSTANTS:
            return _CONSTANTS[b]
        if b in _FIXED:
            fmt, size = _FIXED[b]
            return struct.unpack(fmt, self._take(size))[0]
        if b not in _LENGTH:  # 0xC1, extension types: msgpack's decoder says what is wrong
            raise _GiveUp
        kind, fmt, size = _LENGTH[b]
        n = struct.unpack(fmt, self._take(size))[0]
        if kind == "bin":
            view = self._take(n)
            return view if n >= VIEW_BYTES else bytes(view)
        if kind == "str":
            return self._str(n)
        if kind == "array":
            return [self.value(depth + 1) for _ in range(n)]
        return self._map(n, depth)

    def _str(self, n: int) -> str:
        if n > self.max_str_len:
            raise _GiveUp
        return str(self._take(n), "utf-8")

    def _map(self, n: int, depth: int) -> dict[Any, Any]:
        out = {}
        for _ in range(n):
            key = self.value(depth + 1)
            if not isinstance(key, (str, bytes)):  # msgpack's strict_map_key
                raise _GiveUp
            out[key] = self.value(depth + 1)
        return out
