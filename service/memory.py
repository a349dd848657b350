"""Keep freed big blocks in the process heap, so big requests do not page-fault afresh.

glibc hands every block above its mmap threshold (at most 32 MiB by default)
straight back to the kernel when freed. A server that receives and returns
arrays of hundreds of MiB then pays for fresh pages on every request: on the
machines this was measured on, touching 256 MiB of fresh pages cost 0.15 s,
reusing pages 0.006 s (bench/service.py, P4). Raising the mmap and trim
thresholds keeps those blocks for reuse; the price is that the process's RSS
does not shrink after a burst of big requests.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

__all__ = ["retain_freed_memory"]

logger = logging.getLogger("jitserve.memory")

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_INT_MAX = 2**31 - 1  # mallopt takes an int: blocks above 2 GiB are still mmapped


def retain_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds; ``False`` where there is no glibc mallopt."""
    name = ctypes.util.find_library("c")
    try:
        mallopt = ctypes.CDLL(name).mallopt if name else None
    except (OSError, AttributeError):
        mallopt = None
    if mallopt is None:
        logger.info("no glibc mallopt here: freed memory goes back to the OS as usual")
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, _INT_MAX) == 1 and mallopt(_M_TRIM_THRESHOLD, _INT_MAX) == 1
    if not ok:
        logger.warning("mallopt refused the thresholds: freed memory goes back to the OS")
    return ok
