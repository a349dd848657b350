"""Cache tiers for compiled executables.

L1 keeps loaded executables in this process (``MemoryCache``, LRU bounded by count
and bytes). L2 tiers keep serialized executables as opaque bytes behind one small
interface (``Tier``): ``DiskTier`` is the embedded default; a Redis tier plugs in
the same way. Entries are framed by ``encode_entry``: a magic, a format version, a
sha256 of the body, then the zstd-compressed metadata and executable. A tier
failure is a warning and a miss, never a failed request.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import struct
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import zstandard

from jitserve.wire import TierName

__all__ = [
    "CorruptEntry",
    "DiskTier",
    "ENTRY_VERSION",
    "Entry",
    "MemoryCache",
    "SharedTier",
    "Tier",
    "decode_entry",
    "encode_entry",
]

logger = logging.getLogger("jitserve.compiler.cache")

_MAGIC = b"JSXE"
# Entry framing version. 2026-11-21: 1, first version. Entries of another
# version are misses (and get overwritten), never errors.
ENTRY_VERSION = 1
_HEADER = struct.Struct("<4sH32s")
_MAX_ENTRY_BYTES = 4 << 30


class CorruptEntry(Exception):
    """An L2 entry that fails its checks; the caller drops it and recompiles."""


@dataclasses.dataclass(frozen=True)
class Entry:
    """A serialized executable and what must hold for it to be loaded.

    Attributes:
      executable: bytes from the backend's ``serialize_executable``. Executables
        are code: only load entries from tiers this server trusts.
      meta: JSON-able record: key, avals, out_tree, compile seconds, versions,
        platform and device kind, created time.
    """

    executable: bytes = dataclasses.field(repr=False)
    meta: dict[str, Any]


class Tier(Protocol):
    """An L2 tier: bytes by key. Implementations may raise; callers treat that as a miss."""

    name: str

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, data: bytes) -> None: ...

    def delete(self, key: str) -> None: ...


@runtime_checkable
class SharedTier(Tier, Protocol):
    """An L2 tier shared by several processes, which can elect one compiler per key.

    ``compile_lock(key)`` enters once every tier has missed: it yields ``True``
    when this process should compile (it holds the lock, or cannot get one and
    must not wait longer), or ``False`` when another process stored the entry
    meanwhile, so the caller reads the tiers again. It must not raise for the
    tier's own failures: those mean "compile here".
    """

    def compile_lock(self, key: str) -> contextlib.AbstractContextManager[bool]: ...


def encode_entry(entry: Entry) -> bytes:
    meta = json.dumps(entry.meta, sort_keys=True).encode()
    body = zstandard.ZstdCompressor(level=3).compress(
        struct.pack("<I", len(meta)) + meta + entry.executable)
    return _HEADER.pack(_MAGIC, ENTRY_VERSION, hashlib.sha256(body).digest()) + body


def decode_entry(data: bytes, expect: dict[str, Any]) -> Entry:
    """Check and decode an entry; ``expect`` are meta fields that must match exactly."""
    if len(data) < _HEADER.size:
        raise CorruptEntry(f"entry is {len(data)} bytes, shorter than its header")
    magic, version, digest = _HEADER.unpack_from(data)
    if magic != _MAGIC or version != ENTRY_VERSION:
        raise CorruptEntry(f"entry has magic {magic!r} version {version}")
    body = memoryview(data)[_HEADER.size:]
    if hashlib.sha256(body).digest() != digest:
        raise CorruptEntry("entry checksum does not match its body")
    try:
        raw = zstandard.ZstdDecompressor().decompress(body, max_output_size=_MAX_ENTRY_BYTES)
        (meta_len,) = struct.unpack_from("<I", raw)
        meta = json.loads(raw[4:4 + meta_len])
    except (zstandard.ZstdError, struct.error, ValueError) as e:
        raise CorruptEntry(f"entry body does not decode: {e}") from None
    for field, want in expect.items():
        if meta.get(field) != want:
            raise CorruptEntry(f"entry {field} is {meta.get(field)!r}, expected {want!r}")
    return Entry(raw[4 + meta_len:], meta)


class DiskTier:
    """Serialized executables in a directory: the embedded default L2.

    Writes go to a temporary file in the same directory, then ``os.replace``:
    a reader sees a whole entry or none, even if the writer dies.
    """

    name = TierName.DISK

    def __init__(self, root: Path) -> None:
        self.root = Path(root) / "executables"
        self.root.mkdir(parents=True, exist_ok=True)
        self._sweep_temporaries()

    def path(self, key: str) -> Path:
        if len(key) != 64 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"not a cache key: {key!r:.80}")
        return self.root / key[:2] / key

    def get(self, key: str) -> bytes | None:
        try:
            return self.path(key).read_bytes()
        except FileNotFoundError:
            return None

    def put(self, key: str, data: bytes) -> None:
        path = self.path(key)
        path.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def _sweep_temporaries(self, older_than_s: float = 3600.0) -> None:
        # Left behind only by a process killed mid-write.
        cutoff = time.time() - older_than_s
        for tmp in self.root.glob("*/.tmp-*"):
            try:
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
            except OSError:
                pass


V = TypeVar("V")


class MemoryCache(Generic[V]):
    """A thread-safe LRU bounded by entry count and by total bytes."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: collections.OrderedDict[str, tuple[V, int]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: str) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: str, value: V, nbytes: int) -> None:
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._items[key] = (value, nbytes)
            self._bytes += nbytes
            while self._items and (len(self._items) > self.max_entries
                                   or self._bytes > self.max_bytes):
                _, (_, evicted) = self._items.popitem(last=False)
                self._bytes -= evicted

    def values(self) -> list[V]:
        """A snapshot of the values, least recently used first (not touching the order)."""
        with self._lock:
            return [value for value, _ in self._items.values()]

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes
