"""Messages and arrays between the API process and its runtimes.

A message is one msgpack map, sent with ``multiprocessing.connection.Connection``'s
length-prefixed framing over a pipe (``Pipe``). Arrays travel beside it:

- under ``INLINE_MAX_BYTES`` (1 MiB), inline, as the message's own bytes: a
  pipe write of that size costs less than mapping a segment;
- above it, in a shared-memory segment (``Segment``, a file in ``/dev/shm``):
  one side copies the arrays in once, and the other reads them in place (numpy
  views on its mapping), so a 256 MiB array crosses with one copy instead of
  the four a pipe would cost.

Segments are the API process's: it makes them, names them in its requests (the
inputs of a run; the place a fetch's outputs go), and keeps them for reuse
(``SegmentCache``), because the kernel takes longer to hand out a fresh
segment's pages than to copy into them (0.3 s against 0.03 s per 256 MiB where
measured). A runtime only maps the segments it is given. Names are checked
against their pattern before a file is opened, and the segments of a pool are
removed when it stops. A pool's process that is killed first (SIGKILL, the OOM
killer) cannot remove them: a lock file marks each pool's segments as in use while
it lives, and the next pool made on the host removes those of pools whose process
is gone (``new_prefix``).
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import secrets
import struct
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from jitserve import wire
from jitserve.compiler._worker import Pipe

from ..memory import SharedMemoryFull

__all__ = ["INLINE_MAX_BYTES", "Pipe", "SHARED_FROM_BYTES", "Segment", "SegmentCache",
           "SegmentMaps", "SharedMemoryFull", "frame", "frame_size", "header", "layout", "pack",
           "pack_arrays", "shared_memory_bytes", "unpack", "unpack_arrays", "write_arrays"]

INLINE_MAX_BYTES = 1 << 20
# A run's inputs from this size up go by shared memory even under INLINE_MAX_BYTES
# (``pack_arrays(..., inline_max=SHARED_FROM_BYTES)``): a training step's batch of
# 200 KB cost the API process more to write into the pipe than the rest of its call.
SHARED_FROM_BYTES = 64 << 10
_ALIGN = 64
_MIN_SEGMENT = 4 << 20
SHM_DIR = Path("/dev/shm") if os.path.isdir("/dev/shm") else Path(os.environ.get("TMPDIR", "/tmp"))
_NAME = re.compile(r"jitserve-[0-9a-f]{8}-[0-9a-f]{16}")
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def pack(message: Mapping[str, Any]) -> bytes:
    """``message`` (a ``protocol`` message: a ``str`` enum packs as its string) as msgpack."""
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> Any:
    """What ``frame`` holds: a message is a map, which its reader checks (``protocol``)."""
    return msgpack.unpackb(frame, raw=False, strict_map_key=False)


# A frame, as ``multiprocessing.connection`` (``Pipe``) writes one: a big-endian int32
# length, or -1 and then an int64 one for 2 GiB and more, then the bytes.
_SIZE = struct.Struct("!i")
_BIG_SIZE = struct.Struct("!Q")


def header(n: int) -> bytes:
    """The header ``Pipe.send_bytes`` puts before ``n`` bytes."""
    return _SIZE.pack(n) if n <= 0x7FFFFFFF else _SIZE.pack(-1) + _BIG_SIZE.pack(n)


def frame(data: bytes) -> bytes:
    """``data`` framed as ``Pipe.send_bytes`` frames it, for writers of their own."""
    return header(len(data)) + data


def frame_size(buffer: bytes | bytearray, start: int) -> tuple[int | None, int]:
    """The size of the frame at ``start`` and of its header; ``(None, 0)`` until the
    header is whole."""
    if len(buffer) - start < 4:
        return None, 0
    (size,) = _SIZE.unpack_from(buffer, start)
    if size != -1:
        return size, 4
    if len(buffer) - start < 12:
        return None, 0
    return _BIG_SIZE.unpack_from(buffer, start + 4)[0], 12


class Segment:
    """A shared-memory file and its creator's mapping."""

    def __init__(self, name: str, mapping: mmap.mmap) -> None:
        self.name = name
        self.map = mapping
        self.size = len(mapping)

    @classmethod
    def create(cls, prefix: str, size: int) -> Segment:
        """A new segment named ``<prefix>-<random>``; ``prefix`` is ``jitserve-<8 hex>``."""
        name = f"{prefix}-{secrets.token_hex(8)}"
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(size, 1))
            _reserve(fd, max(size, 1))
            mapping = mmap.mmap(fd, max(size, 1), flags=mmap.MAP_SHARED | _POPULATE)
        except BaseException:
            os.unlink(SHM_DIR / name)
            raise
        finally:
            os.close(fd)
        return cls(name, mapping)

    @staticmethod
    def open(name: str) -> mmap.mmap:
        """Map the segment ``name`` (made by the other process), its pages mapped at once."""
        if not _NAME.fullmatch(name):
            raise ValueError(f"not a jitserve segment name: {name!r:.80}")
        fd = os.open(SHM_DIR / name, os.O_RDWR)
        try:
            return mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED | _POPULATE)
        finally:
            os.close(fd)

    def destroy(self) -> None:
        """Unlink the file; the mapping goes when nothing uses it any more."""
        unlink(self.name)


class SegmentCache:
    """The API process's segments, kept for reuse up to ``max_bytes`` in all.

    ``take`` gives a free segment of at least the size asked (at most four times
    it), or a new one; ``give_back`` keeps it for the next message, or unlinks it
    past the bound. A segment is given back once both sides are done with it: for
    a run's inputs, when the run has answered; for a fetch's outputs, when the
    last array read from it is gone (``lease``).
    """

    def __init__(self, prefix: str, max_bytes: int = 1 << 30) -> None:
        self.prefix = prefix
        self.max_bytes = max_bytes
        self._free: list[Segment] = []
        self._lock = threading.Lock()

    def take(self, size: int) -> Segment:
        # Under INLINE_MAX_BYTES (a run's inputs of SHARED_FROM_BYTES up) a segment is as
        # small as it can be: a loop running ahead has dozens of them in use at once.
        floor = _MIN_SEGMENT if size >= INLINE_MAX_BYTES else SHARED_FROM_BYTES
        with self._lock:
            fits = [s for s in self._free if size <= s.size <= 4 * max(size, floor)]
            if fits:
                best = min(fits, key=lambda s: s.size)
                self._free.remove(best)
                return best
        return Segment.create(self.prefix, max(floor, 1 << (size - 1).bit_length()))

    def give_back(self, segment: Segment) -> None:
        with self._lock:
            if sum(s.size for s in self._free) + segment.size <= self.max_bytes:
                self._free.append(segment)
                return
        segment.destroy()

    def lease(self, segment: Segment) -> np.ndarray:
        """A byte view of ``segment``'s mapping, which gives the segment back once it is
        gone (with every array viewing it), so a response can stream from it.

        A view, not a mapping of its own: mapping 256 MiB again cost 30-40 ms a fetch
        (its page tables filled again) where measured (bench/service.py, P4).
        """
        view = np.frombuffer(segment.map, np.uint8)
        weakref.finalize(view, self.give_back, segment)
        return view

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for segment in free:
            segment.destroy()


class SegmentMaps(dict[str, Any]):
    """A runtime's mappings of the API process's segments, by name, kept for the next
    message that names them (an ``unpack_arrays`` ``maps``): the API process reuses
    its segments, and mapping one again costs its page tables each time. It keeps
    the last ``count`` of at most ``max_size`` bytes each; a bigger one is mapped
    for its message only. One that the API process has unlinked stays mapped (its
    memory held) until newer ones push it out."""

    def __init__(self, count: int = 64, max_size: int = _MIN_SEGMENT) -> None:
        super().__init__()
        self._count = count
        self._max_size = max_size
        self._lock = threading.Lock()  # a runtime's run threads share it

    def __setitem__(self, name: str, mapping: Any) -> None:
        if len(mapping) > self._max_size:
            return
        with self._lock:
            while len(self) >= self._count:
                self.pop(next(iter(self)), None)  # the oldest
            super().__setitem__(name, mapping)


def shared_memory_bytes() -> int:
    """The size of the filesystem segments are made in (``SHM_DIR``)."""
    stat = os.statvfs(SHM_DIR)
    return stat.f_blocks * stat.f_frsize


def _reserve(fd: int, size: int) -> None:
    """Give the segment its pages now, or fail: a mapping of a file past what its
    filesystem holds kills the process that writes it (SIGBUS), and a container's
    ``/dev/shm`` is 64 MiB unless it is given more."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # a filesystem without it: as before
            return
        if e.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        stat = os.statvfs(SHM_DIR)
        raise SharedMemoryFull(
            f"no room for {size:,} bytes of shared memory in {SHM_DIR} ({stat.f_bavail * stat.f_frsize:,}"
            f" of {stat.f_blocks * stat.f_frsize:,} bytes free), which big arrays cross by: "
            "give the server more (docker run --shm-size, compose shm_size, a Memory "
            "emptyDir on /dev/shm in Kubernetes; docs/deploy.md)") from None


def unlink(name: str) -> None:
    try:
        os.unlink(SHM_DIR / name)
    except FileNotFoundError:
        pass


# The lock files of this process's pools (``new_prefix``), by prefix: flocked while open.
_HELD: dict[str, int] = {}
# A lock file younger than this may be one its pool has made and not locked yet.
_LOCK_GRACE_S = 10.0


def new_prefix() -> str:
    """The segment-name prefix of one new pool (``remove_all`` cleans up after it).

    Its lock file, ``<prefix>.lock``, stays flocked while the pool lives; the kernel
    drops the lock when the process ends, however it ends. First, the segments of
    pools whose lock is free (their process ended without ``remove_all``) are removed.
    """
    _remove_orphans()
    while True:
        prefix = f"jitserve-{secrets.token_hex(4)}"
        try:
            fd = os.open(SHM_DIR / f"{prefix}.lock", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            continue
        fcntl.flock(fd, fcntl.LOCK_EX)
        _HELD[prefix] = fd
        return prefix


def remove_all(prefix: str) -> None:
    """Unlink every segment that still carries ``prefix``, and its lock file."""
    for path in SHM_DIR.glob(f"{prefix}-*"):
        unlink(path.name)
    fd = _HELD.pop(prefix, None)
    if fd is not None:
        unlink(f"{prefix}.lock")
        os.close(fd)


def _remove_orphans() -> None:
    """Remove the segments, and lock files, of pools whose lock no process holds."""
    for lock in SHM_DIR.glob("jitserve-*.lock"):
        prefix = lock.name.removesuffix(".lock")
        if prefix in _HELD or not re.fullmatch(r"jitserve-[0-9a-f]{8}", prefix):
            continue
        try:
            if time.time() - lock.stat().st_mtime < _LOCK_GRACE_S:
                continue
            fd = os.open(lock, os.O_RDWR)
        except OSError:  # gone meanwhile, or not ours to open
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its pool lives
            os.close(fd)
            continue
        try:
            for path in SHM_DIR.glob(f"{prefix}-*"):
                unlink(path.name)
            unlink(lock.name)
        finally:
            os.close(fd)


def layout(nbytes: Sequence[int], inline_max: int = INLINE_MAX_BYTES
           ) -> tuple[list[int | None], int]:
    """Offsets in one segment of the arrays of ``nbytes`` that do not go inline (those
    of ``inline_max`` bytes and more; ``None`` for the others), and the segment's
    size (0: no segment)."""
    offsets: list[int | None] = []
    total = 0
    for n in nbytes:
        if n >= inline_max:
            offsets.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        else:
            offsets.append(None)
    return offsets, total


def write_arrays(arrays: Sequence[np.ndarray], offsets: Sequence[int | None],
                 target: Any, name: str | None) -> list[dict[str, Any]]:
    """Descriptions of ``arrays``: those with an offset copied into ``target`` (a
    mapping of segment ``name``), the others inline."""
    out = []
    for a, offset in zip(arrays, offsets):
        desc: dict[str, Any] = {"dtype": wire.dtype_name(a.dtype), "shape": list(a.shape)}
        if offset is not None:
            view = np.ndarray(a.shape, a.dtype, buffer=target, offset=offset)
            np.copyto(view, a, casting="no")
            desc["shm"], desc["offset"] = name, offset
        else:  # its bytes as they are, copied once, by msgpack into the message
            desc["data"] = np.ascontiguousarray(a).view(np.uint8).reshape(-1).data
        out.append(desc)
    return out


def pack_arrays(arrays: Sequence[np.ndarray], cache: SegmentCache | None,
                inline_max: int = INLINE_MAX_BYTES) -> tuple[list[dict[str, Any]], Segment | None]:
    """Descriptions of ``arrays`` for a message, and the segment (from ``cache``) that
    holds those of ``inline_max`` bytes and more; give it back when the other side is
    done with it. Without a cache every array goes inline."""
    offsets, size = layout([a.nbytes for a in arrays], inline_max)
    if cache is None or size == 0:
        return write_arrays(arrays, [None] * len(arrays), None, None), None
    segment = cache.take(size)
    return write_arrays(arrays, offsets, segment.map, segment.name), segment


def unpack_arrays(descs: Sequence[dict[str, Any]],
                  maps: dict[str, Any] | None = None) -> list[np.ndarray]:
    """The arrays a message describes: views on their segment's mapping (from ``maps``
    by name, else mapped here), or on its inline bytes."""
    maps = {} if maps is None else maps
    out = []
    for d in descs:
        dtype = wire.dtype_from_name(d["dtype"])
        shape = tuple(int(n) for n in d["shape"])
        if "shm" in d:
            name = d["shm"]
            mapping = maps.get(name)
            if mapping is None:
                mapping = maps[name] = Segment.open(name)
            out.append(np.ndarray(shape, dtype, buffer=mapping, offset=int(d["offset"])))
        else:
            out.append(np.frombuffer(d["data"], dtype).reshape(shape))
    return out
