"""Array futures: ``RemoteArray`` (sync) and ``AsyncRemoteArray``.

A future has one or more outputs; each output is a remote array. Siblings share
one ``_FutureState``, so the outputs are fetched once, by whichever sibling asks
first, and cached for all of them.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from jitserve import wire
from jitserve.client._models import Aval
from jitserve.client.errors import JitserveTimeout, ProtocolError

if TYPE_CHECKING:
    from jitserve.client._async import AsyncClient
    from jitserve.client._sync import Client

__all__ = ["AsyncRemoteArray", "RemoteArray"]


class _FutureState:
    """What the siblings of one future share: its id, client and fetched outputs."""

    def __init__(self, client: Any, future_id: str,
                 outputs: list[np.ndarray] | None = None) -> None:
        self.client = client
        self.future_id = future_id
        self.outputs = outputs
        self.lock = threading.Lock()
        self.alock: asyncio.Lock | None = None  # made on first async use, in its loop

    def output(self, index: int) -> np.ndarray:
        assert self.outputs is not None
        if index >= len(self.outputs):
            raise ProtocolError(f"future {self.future_id} has {len(self.outputs)} outputs; "
                                f"output {index} is missing")
        return self.outputs[index]


class _RemoteBase:
    """What sync and async remote arrays share: identity, shape, dtype, repr."""

    __slots__ = ("_future", "aval", "dtype", "index", "shape")

    def __init__(self, future: _FutureState, index: int, aval: Aval) -> None:
        self._future = future
        self.index = index
        self.aval = aval
        self.shape: tuple[Any, ...] = tuple(aval.shape)
        try:
            self.dtype: np.dtype = wire.dtype_from_name(aval.dtype)
        except wire.WireError as e:
            raise ProtocolError(f"output {index} of future {future.future_id}: {e}") from None

    @property
    def future_id(self) -> str:
        """The id of the future this array is an output of."""
        return self._future.future_id

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def ref(self) -> dict[str, Any]:
        """The wire reference that stands in for this array in a later execute."""
        return {"future": self.future_id, "output": self.index}

    def _belongs_to(self, client: Any) -> bool:
        return self._future.client is client

    def _cached(self) -> np.ndarray | None:
        return None if self._future.outputs is None else self._future.output(self.index)

    def __repr__(self) -> str:
        state = "fetched" if self._future.outputs is not None else "remote"
        return (f"{type(self).__name__}(future={self.future_id!r}, index={self.index}, "
                f"shape={self.shape}, dtype={self.dtype.name}, {state})")


def _as_requested(a: np.ndarray, dtype: Any, copy: bool | None) -> np.ndarray:
    """numpy's ``__array__(dtype, copy)`` protocol on a fetched array."""
    if dtype is not None and np.dtype(dtype) != a.dtype:
        if copy is False:
            raise ValueError(f"converting {a.dtype} to {np.dtype(dtype)} needs a copy")
        return a.astype(dtype)
    return a.copy() if copy else a


class RemoteArray(_RemoteBase):
    """One output of a future on the server; fetch it with ``result()`` or ``np.asarray``.

    Pass it to a later call and the data never leaves the server::

        y = f(x)                 # RemoteArray, at once
        z = f(y)                 # y is sent as a reference
        z.result(timeout=10)     # numpy array
    """

    __slots__ = ()

    def result(self, timeout: float | None = None) -> np.ndarray:
        """The array's value (read-only), waiting up to ``timeout`` seconds (``None``: no limit).

        Raises ``JitserveTimeout`` when the future is not done in time, and the
        future's error (``FutureFailed``...) if it failed.
        """
        st = self._future
        if st.outputs is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            if not st.lock.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
                raise JitserveTimeout(f"future {st.future_id} not done after {timeout} s")
            try:
                if st.outputs is None:
                    left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                    st.outputs = self._client.result(st.future_id, wait=left)
            finally:
                st.lock.release()
        return st.output(self.index)

    @property
    def _client(self) -> Client:
        return self._future.client  # type: ignore[no-any-return]

    def done(self) -> bool:
        """Whether the future finished (done, failed or cancelled); asks the server once."""
        return self._future.outputs is not None or self._client.future(self.future_id).done

    def block_until_ready(self) -> RemoteArray:
        """Wait until the value is computed, like ``jax.Array.block_until_ready``; returns self.

        The value stays on the server (nothing is downloaded); a failed future raises.
        """
        if self._future.outputs is None:
            info = self._client.future(self.future_id, wait=self._client.timeout.poll)
            while not info.done:
                info = self._client.future(self.future_id, wait=self._client.timeout.poll)
            if info.status != "done":
                self.result()  # raises the future's error
        return self

    def delete(self) -> None:
        """Free the future on the server: every output of it, not only this one."""
        self._client.delete(self.future_id)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return _as_requested(self.result(), dtype, copy)


class AsyncRemoteArray(_RemoteBase):
    """``RemoteArray`` for ``AsyncClient``: the methods that talk to the server are awaitable.

    ``await a`` is ``await a.result()``. ``np.asarray(a)`` works once the value is fetched.
    """

    __slots__ = ()

    @property
    def _client(self) -> AsyncClient:
        return self._future.client  # type: ignore[no-any-return]

    async def result(self, timeout: float | None = None) -> np.ndarray:
        """The array's value, waiting up to ``timeout`` seconds (``None``: no limit)."""
        st = self._future
        if st.outputs is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            st.alock = st.alock or asyncio.Lock()
            try:
                async with asyncio.timeout(timeout):
                    await st.alock.acquire()
            except TimeoutError:
                raise JitserveTimeout(f"future {st.future_id} not done after {timeout} s") from None
            try:
                if st.outputs is None:
                    left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
                    st.outputs = await self._client.result(st.future_id, wait=left)
            finally:
                st.alock.release()
        return st.output(self.index)

    def __await__(self) -> Any:
        return self.result().__await__()

    async def done(self) -> bool:
        """Whether the future finished (done, failed or cancelled)."""
        if self._future.outputs is not None:
            return True
        return (await self._client.future(self.future_id)).done

    async def block_until_ready(self) -> AsyncRemoteArray:
        """Wait until the value is computed, without downloading it; returns self."""
        if self._future.outputs is None:
            info = await self._client.future(self.future_id, wait=self._client.timeout.poll)
            while not info.done:
                info = await self._client.future(self.future_id, wait=self._client.timeout.poll)
            if info.status != "done":
                await self.result()  # raises the future's error
        return self

    async def delete(self) -> None:
        """Free the future on the server: every output of it, not only this one."""
        await self._client.delete(self.future_id)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        value = self._cached()
        if value is None:
            raise TypeError(f"{self!r} is not fetched yet: `await x.result()` first")
        return _as_requested(value, dtype, copy)
