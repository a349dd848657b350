"""Receive buffers for big answers, kept warm for the next answer once their arrays are gone.

A big answer is read into one buffer of its ``Content-Length`` and its arrays are
decoded as views of that buffer (``wire.unpackb``), so the bytes are copied once,
from the socket into place. A fresh buffer costs more than the copy, though: the
kernel hands out its pages one fault at a time (0.2-0.5 s per 256 MiB on the
machines measured, against 0.02 s to copy 256 MiB into pages already touched;
bench/service.py, P4), and glibc unmaps a freed block that big at once. So the
client keeps the buffers of answers whose arrays were all dropped, up to
``max_bytes`` in all, and reads the next big answer into one of them.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

__all__ = ["BufferPool"]


class BufferPool:
    """Byte buffers lent for one answer each, and kept for reuse once given back.

    ``take(n)`` lends a writable ``uint8`` array of ``n`` bytes; when it and every
    view of it (the answer's decoded arrays) are gone, its memory comes back here,
    kept while the pool holds at most ``max_bytes``, else freed.

    >>> pool = BufferPool(1 << 20)
    >>> buf = pool.take(1000); buf[:3] = 7; del buf   # back in the pool
    """

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of exactly ``nbytes``, backed by a kept one of at most twice that if any."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.nbytes <= 2 * nbytes]
            # By index: ``list.remove`` would compare arrays with ``==``.
            base = self._free.pop(min(fits, key=lambda i: self._free[i].nbytes)) if fits else None
        if base is None:
            base = np.empty(nbytes, np.uint8)
        lent = base[:nbytes]
        weakref.finalize(lent, self._give_back, base)
        return lent

    def _give_back(self, base: np.ndarray) -> None:
        with self._lock:
            if base.nbytes > self.max_bytes:
                return
            self._free.append(base)
            self._free.sort(key=lambda b: b.nbytes)  # evict the smallest first
            while sum(b.nbytes for b in self._free) > self.max_bytes:
                self._free.pop(0)

    @property
    def kept_bytes(self) -> int:
        """How many bytes the pool holds for reuse now."""
        with self._lock:
            return sum(b.nbytes for b in self._free)
