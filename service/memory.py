"""Keep some freed memory in the process heap for reuse, and never more than a bound.

glibc hands every block above its mmap threshold (at most 32 MiB by default)
straight back to the kernel when freed. A server that receives and returns
arrays of hundreds of MiB then pays for fresh pages on every request: on the
machines this was measured on, touching 256 MiB of fresh pages cost 0.15 s,
reusing pages 0.006 s (bench/service.py, P4). ``retain_freed_memory`` raises
the thresholds so that such blocks stay in the heap for the next request.

Raised without a bound (as this module once did, to 2 GiB), the heap kept
whatever a burst had freed: three requests that each declared a 1 GiB body
left the server 3 GiB bigger for good. So the bound is explicit (``max_bytes``,
``JITSERVE_RETAIN_FREED_MAX_BYTES``, 1 GiB by default: a 256 MiB round trip frees
about 512 MiB in the heap, its body and msgpack's copy of the array), in three places:

- ``M_MMAP_THRESHOLD = max_bytes``: a block of ``max_bytes`` or more is mapped
  on its own and unmapped when freed; it is never kept.
- ``M_TRIM_THRESHOLD = max_bytes``: when the free space at the top of the heap
  passes ``max_bytes``, ``free`` gives it back (glibc then keeps only its small
  top pad, not ``max_bytes``).
- ``HeapTrimmer``: the two thresholds only see the top of the main heap. Free
  blocks below a live one (fragmentation), and the heaps of other threads'
  arenas, are not trimmed by ``free``. A daemon thread reads glibc's count of
  free heap bytes (``mallinfo2``, all arenas) every ``interval_s`` seconds and,
  when it is over ``max_bytes``, calls ``malloc_trim(0)``, which returns every
  free page of every arena to the kernel. Free bytes can therefore pass the
  bound for at most one interval.

Where there is no glibc (musl, macOS), none of this applies: freed memory goes
back as the platform's allocator decides, and the server still works.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import threading
from typing import Any

__all__ = ["MIN_BOUND", "HeapTrimmer", "SharedMemoryFull", "freeze_startup_objects",
           "limit_arenas", "retain_freed_memory", "trim"]

logger = logging.getLogger("jitserve.memory")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_ARENA_MAX = -8
_INT_MAX = 2**31 - 1  # mallopt takes an int
# glibc's own ceiling of its dynamic mmap threshold: a smaller bound would keep
# less than glibc does by default, at the price of a system call per block.
MIN_BOUND = 32 << 20


class SharedMemoryFull(MemoryError):
    """No room in the shared-memory filesystem (``/dev/shm``) for a segment that would
    carry arrays between the API process and a runtime (``runtimes.frames``)."""


class _MallInfo2(ctypes.Structure):
    # struct mallinfo2 (glibc >= 2.33): every field a size_t.
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc_function(name: str) -> Any:
    """``name`` from the C library, or ``None`` where there is no such function."""
    path = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(path), name) if path else None
    except (OSError, AttributeError):
        return None


def freeze_startup_objects() -> None:
    """Leave what the process made to start (modules, and the server's app, routes and
    services, or a runtime's jax, backend and compiler) out of the garbage
    collector's full collections, which would otherwise walk all of it, again and
    again, while it serves. ``jitserve serve`` calls it once started, a runtime
    before it says it is ready.

    A started server holds about 160,000 objects that the collector tracks, and
    nearly all of them live as long as it does. The requests it serves make and drop
    containers all the time, which sets off a full collection every few thousand
    calls; each one walked those objects for about 0.1 s of the event loop's time,
    found nothing to free, and held every request up meanwhile. Frozen, they are
    skipped; what requests make is collected as before. What was garbage at start is
    collected first, so nothing that could be freed is frozen.
    """
    gc.collect()
    gc.freeze()


def retain_freed_memory(max_bytes: int) -> bool:
    """Keep freed blocks under ``max_bytes`` in the heap, trimming its top past ``max_bytes``.

    ``max_bytes`` is taken as at least ``MIN_BOUND`` (32 MiB) and at most 2 GiB (an
    int). Returns ``False`` where there is no glibc ``mallopt`` (nothing changes then).
    Start a ``HeapTrimmer`` with the same bound to cover the rest of the heap.
    """
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        logger.info("no glibc mallopt here: freed memory goes back to the OS as usual")
        return False
    bound = min(max(max_bytes, MIN_BOUND), _INT_MAX)
    ok = mallopt(_M_MMAP_THRESHOLD, bound) == 1 and mallopt(_M_TRIM_THRESHOLD, bound) == 1
    if not ok:
        logger.warning("mallopt refused the thresholds: freed memory goes back to the OS")
    return ok


def limit_arenas(count: int) -> bool:
    """Let glibc make at most ``count`` malloc arenas (``M_ARENA_MAX``); ``False`` where
    there is no glibc ``mallopt``. Call it before the process starts its threads.

    Each arena reserves 64 MiB of address space, and glibc makes up to eight per core
    as threads contend for the heap: in a fresh CPU runtime (jax and XLA's threads)
    that was 0.9 GB of its 1.7 GB of address space, reserved and never used, which a
    cap on the address space (``RLIMIT_AS``) counts as used. With four arenas, the
    runtime starts in 0.9 GB, and the cap is left to programs.
    """
    mallopt = _libc_function("mallopt")
    return mallopt is not None and mallopt(_M_ARENA_MAX, max(1, count)) == 1


def trim() -> bool:
    """Give every free page of every arena back to the kernel now (``malloc_trim(0)``:
    well under a millisecond where measured); ``False`` without glibc.

    For a process that has just freed transient copies of something it keeps (a
    runtime after decoding a program: the blocks freed around the one it kept
    stayed in its heap, about two copies of every program, bench/uploads.py).
    """
    malloc_trim = _libc_function("malloc_trim")
    if malloc_trim is None:
        return False
    malloc_trim(0)
    return True


class HeapTrimmer:
    """A daemon thread that trims the heap whenever it holds over ``max_bytes`` free.

    Args:
      max_bytes: free heap bytes (all arenas) the process may keep for reuse.
      interval_s: how often glibc's count is read (``mallinfo2`` costs well under
        a millisecond).

    Example::

        if retain_freed_memory(512 << 20):
            HeapTrimmer(512 << 20).start()
    """

    def __init__(self, max_bytes: int, interval_s: float = 2.0) -> None:
        self.max_bytes = max_bytes
        self.interval_s = interval_s
        self.trims = 0
        self._mallinfo2 = _libc_function("mallinfo2")
        self._malloc_trim = _libc_function("malloc_trim")
        if self._mallinfo2 is not None:
            self._mallinfo2.restype = _MallInfo2
        self._trimmed_at: int | None = None  # free bytes right after the last trim
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="jitserve-heap-trim", daemon=True)

    @property
    def available(self) -> bool:
        """Whether this C library has ``mallinfo2`` and ``malloc_trim`` (glibc >= 2.33)."""
        return self._mallinfo2 is not None and self._malloc_trim is not None

    def free_bytes(self) -> int:
        """Bytes the heap holds free, in every arena (glibc's ``fordblks``)."""
        return int(self._mallinfo2().fordblks)

    def check(self) -> bool:
        """Trim if over the bound; whether it trimmed."""
        free = self.free_bytes()
        # malloc_trim leaves the pages it released counted as free: without this
        # guard an idle, fragmented heap would be trimmed again at every tick.
        if free <= self.max_bytes or free == self._trimmed_at:
            return False
        self._malloc_trim(0)
        self._trimmed_at = self.free_bytes()
        self.trims += 1
        logger.debug("heap held %d MiB free (bound %d MiB): trimmed", free >> 20,
                     self.max_bytes >> 20)
        return True

    def start(self) -> bool:
        """Start the thread; ``False`` (and no thread) without glibc's functions."""
        if not self.available:
            logger.info("no glibc mallinfo2/malloc_trim here: the heap is not trimmed")
            return False
        self._thread.start()
        return True

    def stop(self) -> None:
        """Stop the thread (it is a daemon: a process may also just exit)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # a trim bug must not kill the thread for good
                logger.exception("heap trim failed")
