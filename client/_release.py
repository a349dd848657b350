"""``ReleaseQueue``: give the outputs of garbage-collected remote arrays back to the server.

A remote array's finalizer may run in any thread, in the middle of any code (a
garbage collection), so it only puts ``(future_id, output)`` on a queue; it never
does IO, takes a lock, or raises. One daemon thread per client takes them off in
batches and sends ``POST /v1/futures/release``, so this works the same under
``Client`` and ``AsyncClient``. A batch whose request fails for a reason that may
pass (no answer, a 5xx, a 429) goes again twice, 0.2 s and 1 s later; a batch that
still fails is logged as a warning and forgotten: the server frees its outputs at
their time to live.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import httpx

__all__ = ["ReleaseQueue", "Ref"]

logger = logging.getLogger("jitserve.client")

#: One output of a future: ``(future_id, output index)``.
Ref = tuple[str, int]
_STOP = ("", -1, 0)
# A batch whose request met a failure that passes (no answer, or the server busy or
# restarting) is sent again after these waits; then it is left to the outputs' TTL.
_AGAIN_AFTER_S = (0.2, 1.0)


def _passing(e: Exception) -> bool:
    """Whether a release request's failure may pass: sending it again can help."""
    if isinstance(e, httpx.TransportError):
        return True
    return isinstance(e, httpx.HTTPStatusError) and (
        e.response.status_code >= 500 or e.response.status_code == 429)


class ReleaseQueue:
    """Batches released outputs and sends them from one daemon thread.

    Args:
      send: posts one batch to the server (called from the thread; may raise).
      interval: seconds a batch waits for more releases before it is sent.
      batch: a batch this full is sent at once.
      max_bytes: a batch whose outputs hold this many bytes is sent at once: a
        loop that drops a big state per step would otherwise keep an interval's
        worth of states on the server, more the faster it runs.

    ``rider``, when set, is offered each batch first (but those sent at once for
    ``max_bytes``): it returns whether it takes the batch along (a running-ahead
    client's next ``POST /v1/calls``), sparing a request of its own.
    """

    def __init__(self, send: Callable[[list[Ref]], object], *, interval: float = 0.05,
                 batch: int = 512, max_bytes: int = 16 << 20) -> None:
        self.rider: Callable[[list[Ref]], bool] | None = None
        self._send = send
        self._interval = interval
        self._batch = batch
        self._max_bytes = max_bytes
        # (future_id, output, bytes); put() is safe in finalizers
        self._queue: queue.SimpleQueue[tuple[str, int, int]] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="jitserve-release", daemon=True)
        self._thread.start()

    def put(self, future_id: str, output: int, nbytes: int = 0) -> None:
        """Queue one output (of ``nbytes``) for release; safe from any thread and from a
        finalizer."""
        self._queue.put((future_id, output, max(nbytes, 0)))

    def stop(self) -> None:
        """Let the thread send what is queued and end, without waiting for it (safe in finalizers)."""
        self._queue.put(_STOP)

    def close(self, timeout: float = 10.0) -> None:
        """Send what is queued, once, and stop the thread (waiting at most ``timeout`` s)."""
        if self._thread.is_alive():
            self.stop()
            self._thread.join(timeout)

    def _run(self) -> None:
        stop = False
        while not stop:
            batch = [self._queue.get()]
            nbytes = batch[0][2]
            deadline = time.monotonic() + self._interval
            while len(batch) < self._batch and nbytes < self._max_bytes and batch[-1] is not _STOP:
                try:
                    batch.append(self._queue.get(timeout=max(deadline - time.monotonic(), 0.0)))
                except queue.Empty:
                    break
                nbytes += batch[-1][2]
            stop = batch[-1] is _STOP
            self._post([(item[0], item[1]) for item in batch if item is not _STOP],
                       urgent=nbytes >= self._max_bytes)

    def _post(self, refs: list[Ref], urgent: bool = False) -> None:
        """Send ``refs``, or let the ``rider`` take them (not ``urgent`` ones: those
        that hold ``max_bytes`` go at once)."""
        if not refs:
            return
        for wait in (*_AGAIN_AFTER_S, None):
            try:
                rider = self.rider
                if not urgent and rider is not None and rider(refs):
                    return
                self._send(refs)
                return
            except Exception as e:  # noqa: BLE001 - never kill the thread
                if wait is None or not _passing(e):
                    logger.warning("releasing %d outputs failed (%s): the server frees them "
                                   "at their time to live", len(refs), e)
                    return
            time.sleep(wait)
