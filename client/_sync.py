"""``Client``: the blocking client. All logic lives in ``_base``; this file does the IO."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar, overload

import httpx
import numpy as np

from jitserve.client._ahead import RunAhead
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
from jitserve.client._jit import RemoteFunction, check_jit_format
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
from jitserve.client._remote import RemoteArray
from jitserve.client._transport import lean_cookies, sync_transport
from jitserve.client.errors import APIError, JitserveError, ProtocolError

__all__ = ["Client"]

T = TypeVar("T")


class Client(BaseClient):
    """A blocking jitserve client.

    Example::

        with Client("http://127.0.0.1:8000", api_key="...") as c:
            f = c.jit(lambda x, n: x * n, static_argnums=(1,))
            y = f(np.ones(3, np.float32), 2)    # RemoteArray, at once
            print(np.asarray(f(y, 3)))          # y stays on the server

    Args:
      base_url: the server, e.g. ``"http://127.0.0.1:8000"``.
      api_key: sent as ``Authorization: Bearer <key>``; defaults to ``$JITSERVE_API_KEY``,
        ``None`` sends none.
      timeout: a ``Timeout``, or seconds for each request (``None``: no limit).
      transport: an ``httpx.BaseTransport`` (``httpx.MockTransport`` in tests).
      headers: extra headers for every request.
      wire_format: ``"msgpack"`` (default) or ``"json"`` request and answer bodies.
      max_response_bytes: refuse to decode answers larger than this.
      progress: show that a wait is a compile (a bar, or a log line; ``_progress``);
        defaults to ``$JITSERVE_PROGRESS`` (``0`` turns it off), else on.
      run_ahead: how many calls of jitted functions may be on their way at once
        (``DEFAULT_RUN_AHEAD``). A call returns its arrays at once and is sent in order
        with the others (``POST /v1/calls``, a round trip per batch); a call the server
        refuses raises on the first use of its outputs, as jax reports an asynchronous
        error. ``0``: each call waits for the server to accept it, and raises a refusal
        itself.
    """

    _array_cls = RemoteArray

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        api_key: str | None | NotGiven = NOT_GIVEN,
        timeout: Timeout | float | None = DEFAULT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
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
            self._ahead = RunAhead(self, run_ahead)
        self._http = lean_cookies(httpx.Client(
            base_url=self.base_url, headers=self._headers(), timeout=self.timeout.to_httpx(),
            transport=transport or sync_transport()))
        self._release_http = self._http  # httpx.Client is thread-safe

    def _new_lock(self) -> threading.Lock:
        return threading.Lock()

    # ------------------------------------------------------------------ IO

    def _send(self, call: _Call) -> _Reply:
        attempt = 0
        while True:
            try:
                return self._send_once(call)
            except APIError as e:
                delay = unavailable_delay(e, attempt)
                if delay is None:
                    raise
            time.sleep(delay)
            attempt += 1

    def _send_once(self, call: _Call) -> _Reply:
        request = self._build_request(self._http, call)
        try:
            response = self._http.send(request, stream=True)
            try:
                data = self._read(response)
            finally:
                response.close()
        except httpx.TransportError as e:
            raise transport_error(e, request) from e
        return self._reply(response, data)

    def _read(self, response: httpx.Response) -> memoryview | None:
        buf = self._body_buffer(response)
        if buf is None or response.is_stream_consumed:  # consumed: already in memory
            response.read()
            return None
        pos = 0
        for chunk in response.iter_raw():
            pos = fill(buf, pos, chunk)
        if pos != len(buf):
            raise ProtocolError(f"answer ended after {pos} of {len(buf)} bytes")
        return buf

    def _drive(self, op: Op[T]) -> T:
        value: Any = None
        exc: JitserveError | None = None
        try:
            while True:
                try:
                    step = drive_step(op, value, exc)
                except StopIteration as stop:
                    return stop.value
                finally:  # also when it raises: see ``drive_step``
                    value, exc = None, None
                try:
                    if isinstance(step, _Call):
                        value = self._send(step)
                    elif isinstance(step, _Acquire):
                        step.lock.acquire()
                    elif isinstance(step, _Settle):
                        value = step.state.future_id
                    else:
                        time.sleep(step.seconds)
                except JitserveError as e:
                    exc = e
        finally:
            op.close()  # an interrupted call releases what it holds now, not at garbage collection

    def close(self) -> None:
        """Send the calls on their way and the pending releases of dropped arrays, then
        close the connection pool."""
        if self._ahead is not None:
            self._ahead.close(self.timeout.request)
        self._releases.close()
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    # ------------------------------------------------------------------ API

    def upload(self, program: bytes, *, format: str | None = None) -> ProgramInfo:
        """Upload program bytes (``jax_export`` or ``stablehlo``; detected when omitted)."""
        return self._drive(self._op_upload(program, format))

    def get_program(self, program_id: str) -> ProgramInfo | None:
        """The program's document, or ``None`` if the server does not have it."""
        return self._drive(self._op_get_program(program_id))

    def compile(self, program_id: str, *, in_avals: Iterable[Any] | None = None,
                static_key: str = "") -> CompileInfo:
        """Compile ahead of time; ``in_avals`` (avals, arrays, ``{"shape", "dtype"}``) fix dynamic dims."""
        return self._drive(self._op_compile(program_id, in_avals, static_key))

    def execute(self, program_id: str, args: Sequence[Any], *, wait: float | None = None,
                static_key: str = "", donate: Sequence[int] = ()) -> list[RemoteArray]:
        """Run a program on flattened input leaves; one ``RemoteArray`` per output.

        ``args`` are arrays (anything ``np.asarray`` takes) or ``RemoteArray`` s of
        this client, sent as references. With ``wait`` (seconds, capped at
        ``timeout.poll``) the server may hold the answer until the outputs are
        ready; they then come back already fetched. ``donate`` lists indices of
        ``args`` (references) the server may reuse; those arrays are deleted here.
        """
        return self._wrap(self._drive(self._op_execute(program_id, args, wait, static_key, donate)))

    def set_batching(self, program_id: str, *, max_batch_size: int,
                     max_delay_ms: float = 2.0) -> dict[str, Any]:
        """Batch this client's concurrent calls of ``program_id`` on the server.

        Calls whose arguments share a leading dimension are stacked into one run of
        at most ``max_batch_size`` rows, after waiting at most ``max_delay_ms`` for
        each other. The program must be a shape-polymorphic export whose inputs and
        outputs all lead with one symbolic dimension, and its rows independent
        (docs/batching.md)::

            b, = jax.export.symbolic_shape("b")
            exp = jax.export.export(jax.jit(mlp), platforms=["cpu"])(
                jax.ShapeDtypeStruct((b, 784), np.float32))
            pid = client.upload(exp.serialize()).program_id
            client.set_batching(pid, max_batch_size=64, max_delay_ms=2)

        Returns the configuration the server keeps (``enabled``, the two knobs, and
        ``batch_dimension``).
        """
        return self._drive(self._op_batching("PUT", program_id, {
            "max_batch_size": max_batch_size, "max_delay_ms": max_delay_ms}))

    def get_batching(self, program_id: str) -> dict[str, Any]:
        """The program's batching for this client's key (``enabled: false`` when off)."""
        return self._drive(self._op_batching("GET", program_id))

    def clear_batching(self, program_id: str) -> dict[str, Any]:
        """Stop batching the program's calls (queued ones still run)."""
        return self._drive(self._op_batching("DELETE", program_id))

    def future(self, future_id: str, *, wait: float | None = None) -> FutureInfo:
        """A future's state; ``wait`` long-polls until it leaves pending/running."""
        return self._drive(self._op_future(future_id, wait))

    def result(self, future_id: str, *, wait: float | None = None,
               outputs: Sequence[int] | None = None, name: str | None = None) -> list[np.ndarray]:
        """The outputs of a future, waiting up to ``wait`` seconds (``None``: as long as it takes).

        ``outputs`` asks for those outputs only, in that order (``None``: all).
        Raises ``JitserveTimeout`` if not done in time, and the future's error if it
        failed (``CompileError`` if its program did not compile). A wait on a
        compiling future shows progress; ``name`` is what it calls the computation.
        """
        return self._drive(self._op_result(future_id, wait, outputs, name))

    def wait(self, future_id: str, *, name: str | None = None) -> FutureInfo:
        """Wait until the future finishes (done, failed or cancelled), fetching nothing; its state."""
        return self._drive(self._op_wait(future_id, name))

    def release(self, outputs: Iterable[Ref]) -> int:
        """Free ``(future_id, output)`` pairs on the server now; how many it knew.

        Remote arrays do this themselves when garbage-collected or deleted.
        """
        return self._drive(self._op_release(outputs))

    def device_put(self, x: Any, sharding: Any = None) -> Any:
        """Upload an array, or a pytree of arrays, once; the same tree of ``RemoteArray`` s.

        For values every call reuses, such as parameters: passed to a jitted
        function they go as references. Leaves get jax's dtypes (as
        ``jax.device_put``), so this imports jax; remote arrays of this client
        stay as they are. ``sharding`` (a ``NamedSharding`` over ``mesh``, or a
        pytree prefix of them, as ``jax.device_put``'s): the arrays are laid out so
        across the server's devices, remote ones moved there on the server.

        >>> params = c.device_put({"w": np.ones((3, 3)), "b": np.zeros(3)})   # doctest: +SKIP
        """
        if sharding is not None:
            return self._placer(sharding)(x)
        return self._drive(self._op_put(x))

    def delete(self, future_id: str) -> str:
        """Cancel the future if it has not started and free its outputs; its new status."""
        return self._drive(self._op_delete(future_id))

    def devices(self) -> Any:
        """The server's devices document (``GET /v1/devices``)."""
        return self._drive(self._op_get("/v1/devices"))

    def mesh(self, shape: Sequence[int], axis_names: Sequence[str]) -> Any:
        """A ``jax.sharding.AbstractMesh`` of ``shape`` over the server's devices, for the
        shardings of ``jit``; ``ValueError`` if it needs more devices than a runtime
        of the server has.

        >>> mesh = c.mesh((2, 2), ("x", "y"))                           # doctest: +SKIP
        >>> f = c.jit(fn, in_shardings=NamedSharding(mesh, P("x", "y")))  # doctest: +SKIP
        """
        return self._drive(self._op_mesh(shape, axis_names))

    def health(self) -> Any:
        """``GET /healthz``: raises if the server is not alive."""
        return self._drive(self._op_get("/healthz"))

    def ready(self) -> bool:
        """Whether the server is ready to serve (``GET /readyz``)."""
        return self._drive(self._op_ready())

    @overload
    def jit(self, fn: Callable[..., Any], *, static_argnums: int | Sequence[int] = (),
            static_argnames: str | Iterable[str] = (),
            donate_argnums: int | Sequence[int] = (), donate_argnames: str | Iterable[str] = (),
            format: str = "jax_export", in_shardings: Any = None,
            out_shardings: Any = None, keep_unused: bool = False, inline: bool = False,
            compiler_options: dict[str, Any] | None = None, device: Any = None,
            backend: str | None = None) -> RemoteFunction: ...

    @overload
    def jit(self, fn: None = None, *, static_argnums: int | Sequence[int] = (),
            static_argnames: str | Iterable[str] = (),
            donate_argnums: int | Sequence[int] = (), donate_argnames: str | Iterable[str] = (),
            format: str = "jax_export", in_shardings: Any = None,
            out_shardings: Any = None, keep_unused: bool = False, inline: bool = False,
            compiler_options: dict[str, Any] | None = None, device: Any = None,
            backend: str | None = None) -> Callable[[Callable[..., Any]], RemoteFunction]: ...

    def jit(self, fn: Callable[..., Any] | None = None, *,
            static_argnums: int | Sequence[int] = (),
            static_argnames: str | Iterable[str] = (),
            donate_argnums: int | Sequence[int] = (), donate_argnames: str | Iterable[str] = (),
            format: str = "jax_export", in_shardings: Any = None, out_shardings: Any = None,
            keep_unused: bool = False, inline: bool = False,
            compiler_options: dict[str, Any] | None = None, device: Any = None,
            backend: str | None = None) -> Any:
        """Like ``jax.jit``, but the function runs on the server; see ``RemoteFunction``.

        Also a decorator: ``@c.jit`` or ``@c.jit(static_argnums=1)``.

        ``format`` is what each traced signature is sent as: ``"jax_export"`` (the
        default, a ``jax.export`` artifact) or ``"jaxpr"`` (a jaxpr document,
        ``docs/jaxpr-format.md``, which the server decodes against an allowlist).
        Any other value raises ``ValueError``. ``donate_argnums``/``donate_argnames``
        are ``jax.jit``'s: donated remote arrays are deleted by the call.
        ``in_shardings``/``out_shardings`` are ``jax.jit``'s too (pytree prefixes of
        the positional arguments and of the outputs), over a mesh of the server's
        devices (``mesh``): the function runs sharded across them, and ``shard_map``,
        collectives and sharding constraints over that mesh work inside it.
        ``keep_unused`` and ``inline`` are ``jax.jit``'s; ``compiler_options`` too (XLA
        options by name, such as ``{"xla_cpu_enable_fast_math": True}``): the server
        compiles with those it allows, and refuses others (``ProgramError`` on the first
        call, naming the option). ``device`` and ``backend`` raise ``TypeError``: the
        function runs on the server's devices (``in_shardings`` chooses among them).

        >>> f = c.jit(lambda x, n: x ** n, static_argnums=1)   # doctest: +SKIP
        >>> f(np.arange(3.0), 2).result()                       # doctest: +SKIP
        array([0., 1., 4.])
        """
        def make(f: Callable[..., Any]) -> RemoteFunction:
            return RemoteFunction(self, f, static_argnums=static_argnums,
                                  static_argnames=static_argnames,
                                  donate_argnums=donate_argnums, donate_argnames=donate_argnames,
                                  format=format, in_shardings=in_shardings,
                                  out_shardings=out_shardings, keep_unused=keep_unused,
                                  inline=inline, compiler_options=compiler_options,
                                  device=device, backend=backend)
        check_jit_format(format)  # now, not when the decorator is applied
        return make if fn is None else make(fn)
