"""Messages and arrays between the API process and its runtimes.

A message is one msgpack map, sent with ``multiprocessing.connection.Connection``'s
length-prefixed framing over a pipe (``Pipe``). Arrays travel beside it:

- under ``INLINE_MAX_BYTES`` (1 MiB), inline, as the message's own bytes: a
  pipe write of that size costs less than creating and mapping a segment;
- above it, in one shared-memory segment per message (``Segment``, a file in
  ``/dev/shm``): the sender copies the arrays in once, and the receiver reads
  them in place (numpy views on its mapping), so a 256 MiB array crosses with
  one copy instead of the four a pipe would cost.

The side that creates a segment names it; the other maps it and unlinks it
once it is mapped (the mapping outlives the name), so a segment never outlives
the two processes by more than one message. Names are checked against the
pattern both sides use before a file is opened: a runtime is untrusted, and
must not steer the API process to any other file.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from jitserve import wire
from jitserve.compiler._worker import Pipe

__all__ = ["INLINE_MAX_BYTES", "INLINE_OUTPUTS_BYTES", "Pipe", "Segment", "pack", "pack_arrays", "unpack",
           "unpack_arrays"]

INLINE_MAX_BYTES = 1 << 20
# A run's outputs up to this size come back with its answer, so that fetching
# them costs no second round trip.
INLINE_OUTPUTS_BYTES = 64 << 10
_ALIGN = 64
SHM_DIR = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(os.environ.get("TMPDIR", "/tmp"))
_NAME = re.compile(r"jitserve-[0-9a-f]{8}-[0-9a-f]{16}")


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> dict[str, Any]:
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


class Segment:
    """A shared-memory file of ``size`` bytes, mapped read-write by its creator."""

    def __init__(self, name: str, mapping: mmap.mmap) -> None:
        self.name = name
        self.map = mapping

    @classmethod
    def create(cls, prefix: str, size: int) -> Segment:
        """A new segment named ``<prefix>-<random>``; ``prefix`` is ``jitserve-<8 hex>``."""
        name = f"{prefix}-{secrets.token_hex(8)}"
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(size, 1))
            mapping = mmap.mmap(fd, max(size, 1))
        except BaseException:
            os.unlink(SHM_DIR / name)
            raise
        finally:
            os.close(fd)
        return cls(name, mapping)

    @staticmethod
    def open(name: str) -> mmap.mmap:
        """Map the segment ``name`` and unlink it (the mapping stays valid)."""
        if not _NAME.fullmatch(name):
            raise ValueError(f"not a jitserve segment name: {name!r:.80}")
        path = SHM_DIR / name
        fd = os.open(path, os.O_RDWR)
        try:
            return mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
            unlink(name)


def unlink(name: str) -> None:
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        pass


def unlink_checked(name: str) -> None:
    """``unlink`` a name a runtime gave, if it is a segment's name at all."""
    if _NAME.fullmatch(name):
        unlink(name)


def new_prefix() -> str:
    """The segment-name prefix of one process (``remove_all`` cleans up after it)."""
    return f"jitserve-{secrets.token_hex(4)}"


def remove_all(prefix: str) -> None:
    """Unlink every segment that still carries ``prefix`` (a process that died mid-message)."""
    for path in SHM_DIR.glob(f"{prefix}-*"):
        unlink(path.name)


def pack_arrays(arrays: Sequence[np.ndarray], prefix: str) -> tuple[list[dict[str, Any]],
                                                                    Segment | None]:
    """Descriptions of ``arrays`` for a message, and the segment that holds the big ones."""
    big = [a for a in arrays if a.nbytes >= INLINE_MAX_BYTES]
    segment = None
    offsets: dict[int, int] = {}
    if big:
        total = 0
        for a in big:
            offsets[id(a)] = total
            total += -(-a.nbytes // _ALIGN) * _ALIGN
        segment = Segment.create(prefix, total)
    out = []
    for a in arrays:
        desc: dict[str, Any] = {"dtype": wire.dtype_name(a.dtype), "shape": list(a.shape)}
        if id(a) in offsets and segment is not None:
            start = offsets[id(a)]
            view = np.ndarray(a.shape, a.dtype, buffer=segment.map, offset=start)
            np.copyto(view, a, casting="no")
            desc["shm"], desc["offset"] = segment.name, start
        else:
            desc["data"] = np.ascontiguousarray(a).tobytes()
        out.append(desc)
    return out, segment


def unpack_arrays(descs: Sequence[dict[str, Any]]) -> list[np.ndarray]:
    """The arrays a message describes: views on its segment, or on its inline bytes."""
    maps: dict[str, mmap.mmap] = {}
    out = []
    for d in descs:
        dtype = wire.dtype_from_name(d["dtype"])
        shape = tuple(int(n) for n in d["shape"])
        if "shm" in d:
            name = d["shm"]
            if name not in maps:
                maps[name] = Segment.open(name)
            out.append(np.ndarray(shape, dtype, buffer=maps[name], offset=int(d["offset"])))
        else:
            out.append(np.frombuffer(d["data"], dtype).reshape(shape))
    return out
