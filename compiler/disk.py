"""The disk tier's directory: what it holds, its byte bound, least-recently-used eviction.

Blobs live at ``<cache_dir>/<kind>/<key[:2]>/<key>`` (``compiler.cache.DiskTier``).
A blob's mtime is its last use: ``atomic_write`` sets it, and a hit moves it
forward (at most once per ``touch_interval_s``, so hot entries cost no write per
hit). Eviction unlinks the oldest blobs first. That is safe beside readers and
other processes: a reader that opened the file keeps its bytes, one that comes
after misses (and recompiles); writers never leave half a file (``atomic_write``).

Standard library only, and nothing here imports jax: the ``jitserve cache``
command uses it on a directory that a server may be using at the same time.

Example::

    budget = DiskBudget(Path("/var/cache/jitserve"), max_bytes=10 << 30)
    budget.added(len(blob))          # after a put: evicts if the directory is over
    prune(Path("/var/cache/jitserve"), max_bytes=1 << 30)   # what `jitserve cache prune` does
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["BLOB_KINDS", "DEFAULT_CACHE_DIR", "DEFAULT_MAX_BYTES", "DiskBudget", "DiskEntry",
           "evict", "prune", "remove", "scan"]

logger = logging.getLogger("jitserve.compiler.disk")

# The kinds' folders (``compiler.cache.BlobKind.name``): the blobs a bound covers.
BLOB_KINDS = ("executables", "programs")
DEFAULT_MAX_BYTES = 10 << 30
# JITSERVE_CACHE_DIR's default (``service.settings``; ``jitserve cache`` reads it without them).
DEFAULT_CACHE_DIR = Path("~/.cache/jitserve")
_HEX = frozenset("0123456789abcdef")


@dataclasses.dataclass(frozen=True)
class DiskEntry:
    """One blob on disk, as a scan saw it.

    Attributes:
      kind: its folder (``executables``, ``programs``).
      key: its cache key (64 hex digits).
      path: the file.
      size: bytes on disk.
      last_used: its mtime (seconds since the epoch): written, or last hit.
    """

    kind: str
    key: str
    path: Path
    size: int
    last_used: float


def _is_key(name: str) -> bool:
    return len(name) == 64 and set(name) <= _HEX


def _walk(folder: Path) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as it:
            yield from it
    except (FileNotFoundError, NotADirectoryError):
        return


def scan(cache_dir: Path, kinds: Sequence[str] = BLOB_KINDS) -> list[DiskEntry]:
    """Every blob of ``kinds`` under ``cache_dir``, least recently used first.

    Temporaries of writes in progress are skipped; files that vanish while the
    scan runs (another process evicted them) are left out.
    """
    entries = []
    for kind in kinds:
        for prefix in _walk(Path(cache_dir) / kind):
            for item in _walk(Path(prefix.path)):
                if not _is_key(item.name):
                    continue
                try:
                    st = item.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                entries.append(DiskEntry(kind, item.name, Path(item.path), st.st_size, st.st_mtime))
    entries.sort(key=lambda e: e.last_used)
    return entries


def remove(entry: DiskEntry, *, if_unused: bool = True) -> bool:
    """Unlink ``entry``'s file; whether it was removed.

    With ``if_unused``, a file used (hit or rewritten) since the scan is kept:
    eviction should not drop what just became recent.
    """
    try:
        if if_unused and entry.path.stat().st_mtime != entry.last_used:
            return False
        entry.path.unlink()
    except FileNotFoundError:
        return False
    return True


def evict(entries: Sequence[DiskEntry], max_bytes: int) -> tuple[int, int]:
    """Remove ``entries`` (least recently used first) until they total at most ``max_bytes``.

    Returns the bytes that remain and the number of files removed.
    """
    total = sum(e.size for e in entries)
    removed = 0
    for entry in entries:
        if total <= max_bytes:
            break
        if remove(entry):
            removed += 1
            total -= entry.size
    return total, removed


def prune(cache_dir: Path, max_bytes: int, kinds: Sequence[str] = BLOB_KINDS) -> tuple[int, int]:
    """Evict the least recently used blobs of ``cache_dir`` until at most ``max_bytes`` remain."""
    return evict(scan(cache_dir, kinds), max_bytes)


class DiskBudget:
    """The byte bound of one cache directory's blobs, shared by its ``DiskTier``s.

    The running total starts from one scan and grows with each put. Past
    ``max_bytes`` a fresh scan (which also counts other processes' writes)
    evicts the least recently used blobs down to ``low_water`` of the bound, so
    a full directory is scanned once per many puts, not on each.

    Args:
      cache_dir: the directory (``CompilerConfig.cache_dir``).
      max_bytes: the bound.
      touch_interval_s: a hit moves a blob's mtime forward at most this often.
      low_water: the fraction of ``max_bytes`` an eviction brings the total down to.
    """

    def __init__(self, cache_dir: Path, max_bytes: int = DEFAULT_MAX_BYTES, *,
                 touch_interval_s: float = 60.0, low_water: float = 0.9) -> None:
        if max_bytes <= 0:
            raise ValueError(f"a disk cache bound must be positive, got {max_bytes} bytes")
        self.cache_dir, self.max_bytes = Path(cache_dir), max_bytes
        self.touch_interval_s, self.low_water = touch_interval_s, low_water
        self._lock = threading.Lock()
        self.total = sum(e.size for e in scan(self.cache_dir))
        self.evictions = 0

    def added(self, nbytes: int) -> None:
        """Count a blob just written; evict if the directory is now over its bound."""
        with self._lock:
            self.total += nbytes
            if self.total > self.max_bytes:
                self._shrink()

    def used(self, path: Path, last_used: float) -> None:
        """Mark a hit on ``path`` (whose mtime was ``last_used``) unless it was marked lately."""
        now = time.time()
        if now - last_used < self.touch_interval_s:
            return
        try:
            os.utime(path, (now, now))
        except OSError:  # evicted meanwhile, or a read-only disk: recency is best effort
            pass

    def _shrink(self) -> None:
        target = int(self.max_bytes * self.low_water)
        self.total, removed = evict(scan(self.cache_dir), target)
        self.evictions += removed
        logger.info("disk cache over %d bytes: evicted %d least recently used blobs, %d bytes "
                    "remain", self.max_bytes, removed, self.total)
