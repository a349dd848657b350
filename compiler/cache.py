"""Cache tiers, one mechanism for every kind of blob: executables and programs.

A ``TieredStore`` keeps one kind of blob (``EXECUTABLES``, ``PROGRAMS``): decoded
values in memory (``MemoryCache``, LRU bounded by count and bytes), bytes in L2
tiers behind one small interface (``Tier``): ``DiskTier`` is the embedded default;
the Redis tier (``compiler.redis``) plugs in the same way. It reads through the
tiers, fills the faster ones on a hit, and writes to all on a put; a tier failure
is a warning and a miss, never a failed request.

Executable entries are framed by ``encode_entry``: a magic, a format version, an
HMAC-SHA256 with the server's ``CacheSecret`` over the entry's cache key and its
body, then the zstd-compressed metadata and executable. The MAC binds an entry
to its key: whoever can write a tier but does not hold the secret can neither
forge an entry nor move a valid one under another key (docs/redis.md, "Trust
boundary").
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import secrets
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import zstandard

from jitserve.compiler.disk import DiskBudget
from jitserve.wire import TierName

__all__ = [
    "BlobKind",
    "CacheSecret",
    "CacheUnavailable",
    "CorruptEntry",
    "DiskTier",
    "ENTRY_VERSION",
    "EXECUTABLES",
    "Entry",
    "ForeignEntry",
    "MemoryCache",
    "PROGRAMS",
    "SharedTier",
    "Tier",
    "TieredStore",
    "atomic_write",
    "decode_entry",
    "encode_entry",
]

logger = logging.getLogger("jitserve.compiler.cache")

_MAGIC = b"JSXE"
# Entry framing version. A server reads its own version only: entries of another
# version are misses (dropped, then overwritten by the recompile), never errors.
# 2026-11-21: 1, first version: a sha256 of the body.
# 2026-11-23: 2, an HMAC-SHA256 with the cache secret over the magic, the version,
#   the cache key and the body replaces the sha256 (``CacheSecret``), so that an
#   entry is bound to its key and only holders of the secret can make one.
ENTRY_VERSION = 2
_HEADER = struct.Struct("<4sH32s")  # magic, version, MAC
_SECRET_FILE = "cache-secret"  # in the cache directory; 64 hex digits
_MAX_ENTRY_BYTES = 4 << 30
_TEMP_PREFIX = ".tmp-"

V = TypeVar("V")


class CorruptEntry(Exception):
    """An L2 entry that fails its checks; the caller drops it (and recompiles, or re-reads)."""


class ForeignEntry(Exception):
    """A sound L2 entry made for other processes than this one (an executable for more
    devices than it has): a miss here, kept for those it serves."""


class CacheUnavailable(Exception):
    """A shared tier cannot answer a question that has no local answer (its catalog).

    The lookups never raise it: for them a tier that is down is a miss.
    """


@dataclasses.dataclass(frozen=True)
class BlobKind:
    """A kind of blob the tiers keep, and its name in each of them.

    Attributes:
      name: the kind; also the disk tier's folder under the cache directory.
      key: its record kind in Redis (``<prefix><key>:<id>``).
    """

    name: str
    key: str


EXECUTABLES = BlobKind("executables", "exe")
PROGRAMS = BlobKind("programs", "prog")


@dataclasses.dataclass(frozen=True)
class Entry:
    """A serialized executable and what must hold for it to be loaded.

    Attributes:
      executable: bytes from the backend's ``serialize_executable``. Executables
        are code: only load entries that ``decode_entry`` accepted, signed with
        this deployment's ``CacheSecret`` for the key they are loaded under.
      meta: JSON-able record: key, avals, out_tree, compile seconds, versions,
        platform and device kind, created time.
    """

    executable: bytes = dataclasses.field(repr=False)
    meta: dict[str, Any]


class Tier(Protocol):
    """An L2 tier: bytes by key. Implementations may raise; callers treat that as a miss."""

    @property
    def name(self) -> str: ...

    def get(self, key: str) -> bytes | None: ...

    def put(self, key: str, data: bytes) -> None: ...

    def delete(self, key: str) -> None: ...

    def contains(self, key: str) -> bool: ...


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


@dataclasses.dataclass(frozen=True)
class CacheSecret:
    """The server secret that signs executable entries (HMAC-SHA256); its repr hides the value.

    Every process that shares a tier must hold the same secret: an entry signed
    with another one is refused (and dropped) like a damaged one.

    Attributes:
      value: the key of the MAC. Never logged, never in an error.
      source: where it came from, for the logs (``configured``, ``kept in <file>``,
        ``per-process``).

    Example::

        secret = CacheSecret.from_value(os.environ["JITSERVE_CACHE_SECRET"])
        secret = CacheSecret.in_directory(Path("/var/cache/jitserve"))  # made once, then reused
    """

    value: bytes = dataclasses.field(repr=False)
    source: str = "configured"

    def __post_init__(self) -> None:
        # How long it must be is the settings' policy (service.settings); empty is never right.
        if not self.value:
            raise ValueError("a cache secret cannot be empty")

    @classmethod
    def from_value(cls, value: str | bytes, source: str = "configured") -> CacheSecret:
        """A secret from configuration (a ``str`` is taken as its UTF-8 bytes)."""
        return cls(value.encode() if isinstance(value, str) else bytes(value), source)

    @classmethod
    def per_process(cls) -> CacheSecret:
        """A random secret of this process alone: for tiers no other process reads."""
        return cls(secrets.token_bytes(32), "per-process")

    @classmethod
    def in_directory(cls, directory: Path) -> CacheSecret:
        """The secret kept in ``directory/cache-secret``, made (random, mode 0600) if absent.

        Made with ``atomic_write(exclusive=True)``: of processes starting at once,
        one file wins and all of them read it, so they agree. Reused on every
        restart, which keeps the disk tier's entries valid.
        """
        path = Path(directory) / _SECRET_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            atomic_write(path, secrets.token_hex(32).encode() + b"\n", exclusive=True)
            logger.info("made a new cache secret in %s", path)
        except FileExistsError:
            _private(path)
        text = path.read_bytes().strip()
        if len(text) < 32:
            raise ValueError(f"cache secret file {path} is damaged ({len(text)} bytes, not what "
                             "jitserve writes); delete it to make a new one (entries become misses)")
        return cls(text, f"kept in {path}")

    def mac(self, *parts: bytes | memoryview) -> bytes:
        """HMAC-SHA256 of the concatenated ``parts`` (the caller frames them unambiguously)."""
        h = hmac.new(self.value, digestmod=hashlib.sha256)
        for part in parts:
            h.update(part)
        return h.digest()


def _private(path: Path) -> None:
    """Make the secret file ``path`` readable by its owner alone, saying so if it was not."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        logger.warning("cache secret file %s had mode %o; set it to 600 (if others read it, "
                       "delete it to make a new secret)", path, mode)
        path.chmod(0o600)


def _entry_mac(secret: CacheSecret, key: str, body: bytes | memoryview) -> bytes:
    """The MAC of entry ``body`` stored under ``key``: what binds the entry to its key."""
    name = key.encode()
    return secret.mac(_MAGIC, struct.pack("<HI", ENTRY_VERSION, len(name)), name, body)


def encode_entry(key: str, entry: Entry, secret: CacheSecret) -> bytes:
    """The bytes the tiers keep for ``entry`` under ``key``, signed with ``secret``."""
    meta = json.dumps(entry.meta, sort_keys=True).encode()
    body = zstandard.ZstdCompressor(level=3).compress(
        struct.pack("<I", len(meta)) + meta + entry.executable)
    return _HEADER.pack(_MAGIC, ENTRY_VERSION, _entry_mac(secret, key, body)) + body


def decode_entry(key: str, data: bytes, secret: CacheSecret,
                 expect: dict[str, Any] | None = None) -> Entry:
    """Check and decode the entry ``data`` read under ``key``; ``CorruptEntry`` if it fails.

    The MAC is checked before anything is decompressed: an entry tampered with,
    moved from another key, or signed with another secret is refused. ``expect``
    are meta fields that must match exactly (versions, platform, device kind).
    """
    if len(data) < _HEADER.size:
        raise CorruptEntry(f"entry is {len(data)} bytes, shorter than its header")
    magic, version, mac = _HEADER.unpack_from(data)
    if magic != _MAGIC or version != ENTRY_VERSION:
        raise CorruptEntry(f"entry has magic {magic!r} version {version}, "
                           f"expected {_MAGIC!r} version {ENTRY_VERSION}")
    body = memoryview(data)[_HEADER.size:]
    if not hmac.compare_digest(_entry_mac(secret, key, body), mac):
        raise CorruptEntry("entry MAC does not match its key and body (damaged, tampered with, "
                           "stored under another key, or signed with another cache secret)")
    try:
        raw = zstandard.ZstdDecompressor().decompress(body, max_output_size=_MAX_ENTRY_BYTES)
        (meta_len,) = struct.unpack_from("<I", raw)
        meta = json.loads(raw[4:4 + meta_len])
    except (zstandard.ZstdError, struct.error, ValueError) as e:
        raise CorruptEntry(f"entry body does not decode: {e}") from None
    for field, want in (expect or {}).items():
        if meta.get(field) != want:
            raise CorruptEntry(f"entry {field} is {meta.get(field)!r}, expected {want!r}")
    return Entry(raw[4 + meta_len:], meta)


def atomic_write(path: Path, data: bytes, *, exclusive: bool = False) -> None:
    """Write ``data`` to ``path``: readers see the old file or the whole new one, even after a crash.

    A temporary file in the same directory (mode 0600) is written and fsynced,
    renamed over ``path``, then the directory is fsynced so that the rename
    itself is durable. On failure the temporary file is removed and ``path`` is
    untouched. With ``exclusive``, an existing ``path`` is kept and
    ``FileExistsError`` raised: the temporary is hard-linked, never renamed, so
    of concurrent writers exactly one wins.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_TEMP_PREFIX)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if exclusive:
            os.link(tmp, path)
            os.unlink(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def _fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskTier:
    """Blobs of one kind in a directory, ``<root>/<kind>/<key[:2]>/<key>``: the embedded L2.

    Writes are ``atomic_write``: a reader sees a whole blob or none, even if the
    writer dies. With a ``budget`` (``compiler.disk.DiskBudget``, one per
    directory, shared by its kinds) the directory is bounded: a hit marks the
    blob used, a put that goes over the bound evicts the least recently used.
    """

    name = TierName.DISK

    def __init__(self, root: Path, kind: BlobKind, budget: DiskBudget | None = None) -> None:
        self.kind = kind
        self.budget = budget
        self.root = Path(root) / kind.name
        self.root.mkdir(parents=True, exist_ok=True)
        self._sweep_temporaries()

    def path(self, key: str) -> Path:
        if len(key) != 64 or not all(c in "0123456789abcdef" for c in key):
            raise ValueError(f"not a cache key: {key!r:.80}")
        return self.root / key[:2] / key

    def get(self, key: str) -> bytes | None:
        path = self.path(key)
        try:
            with path.open("rb") as f:
                last_used = os.fstat(f.fileno()).st_mtime
                data = f.read()
        except FileNotFoundError:  # never written, or evicted
            return None
        if self.budget is not None:
            self.budget.used(path, last_used)
        return data

    def put(self, key: str, data: bytes) -> None:
        path = self.path(key)
        path.parent.mkdir(exist_ok=True)
        atomic_write(path, data)
        if self.budget is not None:
            self.budget.added(len(data))

    def delete(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def contains(self, key: str) -> bool:
        return self.path(key).is_file()

    def _sweep_temporaries(self, older_than_s: float = 3600.0) -> None:
        # Left behind only by a process killed mid-write.
        cutoff = time.time() - older_than_s
        for tmp in self.root.glob(f"*/{_TEMP_PREFIX}*"):
            try:
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
            except OSError:
                pass


class MemoryCache(Generic[V]):
    """A thread-safe LRU bounded by entry count and by total bytes, under any hashable keys."""

    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._items: collections.OrderedDict[Hashable, tuple[V, int]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: Hashable, value: V, nbytes: int) -> None:
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

    def pop(self, key: Hashable) -> V | None:
        """Remove ``key``; its value, or ``None`` if it was not kept."""
        with self._lock:
            item = self._items.pop(key, None)
            if item is None:
                return None
            self._bytes -= item[1]
            return item[0]

    def items(self) -> list[tuple[Hashable, V]]:
        """A snapshot of the keys and values, least recently used first."""
        with self._lock:
            return [(key, value) for key, (value, _) in self._items.items()]

    def values(self) -> list[V]:
        """A snapshot of the values, least recently used first (not touching the order)."""
        with self._lock:
            return [value for value, _ in self._items.values()]

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        return self._bytes


class TieredStore(Generic[V]):
    """Blobs of one kind through every tier: values in memory, bytes in the L2 tiers.

    ``get`` reads through the memory cache, then each L2 tier, fastest first; the
    first tier whose bytes ``load`` accepts answers, and the faster tiers get the
    same bytes (so a restart of this host hits its disk, not the network). ``put``
    writes every tier. A tier that fails is a warning and a miss, never an error.

    Args:
      kind: what the blobs are (for the logs).
      tiers: the L2 tiers, fastest first.
      memory: the cache of loaded values (L1).
      load: the value of a tier's bytes for a key. It raises ``CorruptEntry`` for
        damaged bytes, which the tier then drops; it returns ``None`` for sound
        bytes this process cannot use now (kept; the next tier is asked). The
        bytes are untrusted: ``load`` checks them as it would an upload.
      size: the bytes a value holds, for the memory cache's bound.

    Example::

        store = TieredStore(PROGRAMS, [DiskTier(root, PROGRAMS)], MemoryCache(256, 1 << 30),
                            load=parse, size=len)
        store.put(key, data, value)
        value, tier = store.get(key) or (None, None)
    """

    def __init__(self, kind: BlobKind, tiers: Sequence[Tier], memory: MemoryCache[V],
                 load: Callable[[str, bytes], V | None], size: Callable[[V], int]) -> None:
        self.kind = kind
        self.tiers = tuple(tiers)
        self.memory = memory
        self._load, self._size = load, size

    def cached(self, key: str) -> V | None:
        """The value from memory alone, or ``None``: never blocks on a tier."""
        return self.memory.get(key)

    def get(self, key: str) -> tuple[V, str] | None:
        """The value of ``key`` and the name of the tier that had it; ``None`` on a miss."""
        value = self.memory.get(key)
        if value is not None:
            return value, TierName.MEMORY
        for i, tier in enumerate(self.tiers):
            found = self._read(tier, key)
            if found is not None:
                value, data = found
                self.remember(key, value)
                self._write(key, data, self.tiers[:i])  # fill the faster tiers, same bytes
                return value, tier.name
        return None

    def put(self, key: str, data: bytes, value: V | None = None) -> None:
        """Write ``data`` to every tier, and keep ``value`` (its loaded form) in memory."""
        if value is not None:
            self.remember(key, value)
        self._write(key, data, self.tiers)

    def fill(self, key: str, data: bytes) -> None:
        """Write ``data`` to the tiers that lack ``key`` (e.g. one that was down at the put)."""
        self._write(key, data, [tier for tier in self.tiers if not self._contains(tier, key)])

    def remember(self, key: str, value: V) -> None:
        """Keep ``value`` in memory only."""
        self.memory.put(key, value, self._size(value))

    def delete(self, key: str) -> list[str]:
        """Drop ``key`` from memory and every tier; the names of those that held it.

        A tier that fails is a warning, as in a lookup (and not named).
        """
        held = [TierName.MEMORY.value] if self.memory.pop(key) is not None else []
        for tier in self.tiers:
            if self._contains(tier, key):
                held.append(str(tier.name))
            self._delete(tier, key)
        return held

    def _read(self, tier: Tier, key: str) -> tuple[V, bytes] | None:
        """The value of ``key`` in ``tier`` and its bytes; ``None`` on a miss."""
        try:
            data = tier.get(key)
            value = None if data is None else self._load(key, data)
        except ForeignEntry as e:
            logger.info("%s %s entry %s is not for this process: %s", tier.name, self.kind.name,
                        key, e)
            return None
        except CorruptEntry as e:
            logger.warning("dropping corrupt %s %s entry %s: %s", tier.name, self.kind.name, key, e)
            self._delete(tier, key)
            return None
        except Exception as e:  # a tier failure is a miss, never a failed request
            logger.warning("%s tier failed reading %s %s: %r", tier.name, self.kind.name, key, e)
            self._delete(tier, key)
            return None
        return None if value is None or data is None else (value, data)

    def _write(self, key: str, data: bytes, tiers: Sequence[Tier]) -> None:
        for tier in tiers:
            try:
                tier.put(key, data)
            except Exception as e:
                logger.warning("%s tier failed writing %s %s: %r", tier.name, self.kind.name, key, e)

    def _contains(self, tier: Tier, key: str) -> bool:
        try:
            return tier.contains(key)
        except Exception as e:
            logger.warning("%s tier failed looking for %s %s: %r", tier.name, self.kind.name, key, e)
            return False

    def _delete(self, tier: Tier, key: str) -> None:
        try:
            tier.delete(key)
        except Exception as e:
            logger.warning("%s tier failed deleting %s %s: %r", tier.name, self.kind.name, key, e)
