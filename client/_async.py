"""``AsyncClient``: the asyncio client. All logic lives in ``_base``; this file does the IO."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar, overload

import httpx
import numpy as np

from jitserve.client._ahead import AsyncRunAhead
from jitserve.client._base import (
    DEFAULT_URL,
    BaseClient,
    Op,
    Ref,
    WireFormat,
    _Acquire,
    _Call,
    _Reply,
    _Settle,
    drive_step,
    fill,
    transport_error,
    unavailable_delay,
)
from jitserve.client._jit import AsyncRemoteFunction, check_jit_format
from jitserve.client._models import (
    DEFAULT_RUN_AHEAD,
    DEFAULT_TIMEOUT,
    NOT_GIVEN,
    CompileInfo,
    FutureInfo,
    NotGiven,
    ProgramInfo,
    Timeout,
)
from jitserve.client._remote import AsyncRemoteArray
from jitserve.client._transport import async_transport, lean_cookies
from jitserve.client.errors import APIError, JitserveError, ProtocolError

__all__ = ["AsyncClient"]

T = TypeVar("T")


class AsyncClient(BaseClient):
    """The asyncio twin of ``Client``: the same arguments, awaitable methods.

    Example::

        async with AsyncClient("http://127.0.0.1:8000") as c:
            f = c.jit(jnp.sin)
            y = await f(np.ones(3, np.float32))   # AsyncRemoteArray, at once
            print(await y.result(timeout=10))

    ``transport`` is an ``httpx.AsyncBaseTransport``. With ``run_ahead`` (on by
    default, as for ``Client``), ``await f(x)`` returns once the call is queued, and a
    task of the loop sends the queued calls in order; its arrays' awaitable methods
    wait for the call's answer.
    """

    _array_cls = AsyncRemoteArray

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        api_key: str | None | NotGiven = NOT_GIVEN,
        timeout: Timeout | float | None = DEFAULT_TIMEOUT,
        transport: httpx.AsyncBaseTransport | None = None,
        headers: Mapping[str, str] | None = None,
        wire_format: WireFormat = "msgpack",
        max_response_bytes: int | None = None,
        progress: bool | NotGiven = NOT_GIVEN,
        run_ahead: int = DEFAULT_RUN_AHEAD,
    ) -> None:
        super().__init__(base_url, api_key=api_key, timeout=timeout, headers=headers,
                         wire_format=wire_format, max_response_bytes=max_response_bytes,
                         progress=progress)
        if run_ahead < 0:
            raise ValueError(f"run_ahead must be 0 (off) or a number of calls, got {run_ahead!r}")
        if run_ahead:
            self._ahead = AsyncRunAhead(self, run_ahead)
        self._http = lean_cookies(httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers(), timeout=self.timeout.to_httpx(),
            transport=transport or async_transport()))
        # The event loop this client serves: its connections and its sender belong to it.
        self._loop: asyncio.AbstractEventLoop | None = None
        # Releases are sent from a thread (see ReleaseQueue), so over a blocking client.
        self._release_http = lean_cookies(httpx.Client(
            base_url=self.base_url, headers=self._headers(), timeout=self.timeout.to_httpx()))

    def _new_lock(self) -> asyncio.Lock:
        return asyncio.Lock()

    # ------------------------------------------------------------------ IO

    async def _send(self, call: _Call) -> _Reply:
        attempt = 0
        while True:
            try:
                return await self._send_once(call)
            except APIError as e:
                delay = unavailable_delay(e, attempt)
                if delay is None:
                    raise
            await asyncio.sleep(delay)
            attempt += 1

    async def _send_once(self, call: _Call) -> _Reply:
        request = self._build_request(self._http, call)
        try:
            response = await self._http.send(request, stream=True)
            try:
                data = await self._read(response)
            finally:
                await response.aclose()
        except httpx.TransportError as e:
            raise transport_error(e, request) from e
        return self._reply(response, data)

    async def _read(self, response: httpx.Response) -> memoryview | None:
        buf = self._body_buffer(response)
        if buf is None or response.is_stream_consumed:  # consumed: already in memory
            await response.aread()
            return None
        pos = 0
        async for chunk in response.aiter_raw():
            pos = fill(buf, pos, chunk)
        if pos != len(buf):
            raise ProtocolError(f"answer ended after {pos} of {len(buf)} bytes")
        return buf

    def _check_loop(self) -> None:
        """Refuse an event loop other than the one this client first ran in, naming the
        fix: httpx's connections and the sender's task belong to that loop, and failed
        in another ('Event loop is closed') with the batch's traceback logged."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            was = "a closed event loop" if self._loop.is_closed() else "another event loop"
            raise RuntimeError(f"this AsyncClient was first used in {was}, and its "
                               "connections belong to it: make an AsyncClient in each "
                               "event loop (each asyncio.run), as with httpx.AsyncClient")

    async def _drive(self, op: Op[T]) -> T:
        value: Any = None
        exc: JitserveError | None = None
        try:
            self._check_loop()
            while True:
                try:
                    step = drive_step(op, value, exc)
                except StopIteration as stop:
                    return stop.value
                finally:  # also when it raises: see ``drive_step``
                    value, exc = None, None
                try:
                    if isinstance(step, _Call):
                        value = await self._send(step)
                    elif isinstance(step, _Acquire):
                        await step.lock.acquire()
                    elif isinstance(step, _Settle):
                        value = await step.state.settled()
                    else:
                        await asyncio.sleep(step.seconds)
                except JitserveError as e:
                    exc = e
        finally:
            op.close()  # a cancelled call releases what it holds now, not at garbage collection

    async def aclose(self) -> None:
        """Send the calls on their way and the pending releases of dropped arrays, then
        close the connection pools."""
        if self._ahead is not None:
            await self._ahead.close(self.timeout.request)
        await asyncio.to_thread(self._releases.close)
        self._release_http.close()
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    # ------------------------------------------------------------------ API

    async def upload(self, program: bytes, *, format: str | None = None) -> ProgramInfo:
        """See ``Client.upload``."""
        return await self._drive(self._op_upload(program, format))

    async def get_program(self, program_id: str) -> ProgramInfo | None:
        """See ``Client.get_program``."""
        return await self._drive(self._op_get_program(program_id))

    async def compile(self, program_id: str, *, in_avals: Iterable[Any] | None = None,
                      static_key: str = "") -> CompileInfo:
        """See ``Client.compile``."""
        return await self._drive(self._op_compile(program_id, in_avals, static_key))

    async def execute(self, program_id: str, args: Sequence[Any], *, wait: float | None = None,
                      static_key: str = "", donate: Sequence[int] = ()) -> list[AsyncRemoteArray]:
        """See ``Client.execute``."""
        return self._wrap(await self._drive(self._op_execute(program_id, args, wait, static_key,
                                                             donate)))

    async def set_batching(self, program_id: str, *, max_batch_size: int,
                           max_delay_ms: float = 2.0) -> dict[str, Any]:
        """See ``Client.set_batching``."""
        return await self._drive(self._op_batching("PUT", program_id, {
            "max_batch_size": max_batch_size, "max_delay_ms": max_delay_ms}))

    async def get_batching(self, program_id: str) -> dict[str, Any]:
        """See ``Client.get_batching``."""
        return await self._drive(self._op_batching("GET", program_id))

    async def clear_batching(self, program_id: str) -> dict[str, Any]:
        """See ``Client.clear_batching``."""
        return await self._drive(self._op_batching("DELETE", program_id))

    async def future(self, future_id: str, *, wait: float | None = None) -> FutureInfo:
        """See ``Client.future``."""
        return await self._drive(self._op_future(future_id, wait))

    async def result(self, future_id: str, *, wait: float | None = None,
                     outputs: Sequence[int] | None = None,
                     name: str | None = None) -> list[np.ndarray]:
        """See ``Client.result``."""
        return await self._drive(self._op_result(future_id, wait, outputs, name))

    async def wait(self, future_id: str, *, name: str | None = None) -> FutureInfo:
        """See ``Client.wait``."""
        return await self._drive(self._op_wait(future_id, name))

    async def release(self, outputs: Iterable[Ref]) -> int:
        """See ``Client.release``."""
        return await self._drive(self._op_release(outputs))

    async def device_put(self, x: Any, sharding: Any = None) -> Any:
        """See ``Client.device_put``; the leaves are ``AsyncRemoteArray`` s."""
        if sharding is not None:
            return await self._placer(sharding)(x)
        return await self._drive(self._op_put(x))

    async def delete(self, future_id: str) -> str:
        """See ``Client.delete``."""
        return await self._drive(self._op_delete(future_id))

    async def devices(self) -> Any:
        """See ``Client.devices``."""
        return await self._drive(self._op_get("/v1/devices"))

    async def mesh(self, shape: Sequence[int], axis_names: Sequence[str]) -> Any:
        """See ``Client.mesh``."""
        return await self._drive(self._op_mesh(shape, axis_names))

    async def health(self) -> Any:
        """See ``Client.health``."""
        return await self._drive(self._op_get("/healthz"))

    async def ready(self) -> bool:
        """See ``Client.ready``."""
        return await self._drive(self._op_ready())

    @overload
    def jit(self, fn: Callable[..., Any], *, static_argnums: int | Sequence[int] = (),
            static_argnames: str | Iterable[str] = (),
            donate_argnums: int | Sequence[int] = (), donate_argnames: str | Iterable[str] = (),
            format: str = "jax_export", in_shardings: Any = None,
            out_shardings: Any = None, keep_unused: bool = False, inline: bool = False,
            compiler_options: dict[str, Any] | None = None, device: Any = None,
            backend: str | None = None) -> AsyncRemoteFunction: ...

    @overload
    def jit(self, fn: None = None, *, static_argnums: int | Sequence[int] = (),
            static_argnames: str | Iterable[str] = (),
            donate_argnums: int | Sequence[int] = (), donate_argnames: str | Iterable[str] = (),
            format: str = "jax_export", in_shardings: Any = None,
            out_shardings: Any = None, keep_unused: bool = False, inline: bool = False,
            compiler_options: dict[str, Any] | None = None, device: Any = None,
            backend: str | None = None) -> Callable[[Callable[..., Any]], AsyncRemoteFunction]: ...

    def jit(self, fn: Callable[..., Any] | None = None, *,
            static_argnums: int | Sequence[int] = (),
            static_argnames: str | Iterable[str] = (),
            donate_argnums: int | Sequence[int] = (), donate_argnames: str | Iterable[str] = (),
            format: str = "jax_export", in_shardings: Any = None, out_shardings: Any = None,
            keep_unused: bool = False, inline: bool = False,
            compiler_options: dict[str, Any] | None = None, device: Any = None,
            backend: str | None = None) -> Any:
        """See ``Client.jit``; calls of the result are awaitable."""
        def make(f: Callable[..., Any]) -> AsyncRemoteFunction:
            return AsyncRemoteFunction(self, f, static_argnums=static_argnums,
                                       static_argnames=static_argnames,
                                       donate_argnums=donate_argnums,
                                       donate_argnames=donate_argnames, format=format,
                                       in_shardings=in_shardings, out_shardings=out_shardings,
                                       keep_unused=keep_unused, inline=inline,
                                       compiler_options=compiler_options, device=device,
                                       backend=backend)
        check_jit_format(format)  # now, not when the decorator is applied
        return make if fn is None else make(fn)
