"""What ``Client`` and ``AsyncClient`` share: configuration, requests, answers, operations.

Every operation is written once, here, as a generator that yields the HTTP calls it
needs (``_Call``), a pause (``_Sleep``), a lock to wait for (``_Acquire``) or a call
on its way to be answered (``_Settle``), and receives each answer (``_Reply``) or the
exception it raised. ``Client`` drives these generators with blocking IO and
``AsyncClient`` with ``await``, so the two never drift apart.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import sys
import time
import weakref
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from typing import Any, Literal, TypeVar
from urllib.parse import quote

import httpx
import numpy as np

from jitserve import wire
from jitserve.client._buffers import BufferPool
from jitserve.client._models import (
    DEFAULT_TIMEOUT,
    NOT_GIVEN,
    Aval,
    CompileInfo,
    FutureInfo,
    NotGiven,
    ProgramInfo,
    Timeout,
)
from jitserve.client._progress import PROGRESS_AFTER, PROGRESS_TICK, compile_progress, progress_default
from jitserve.client._release import Ref, ReleaseQueue
from jitserve.client._remote import KeyType, _FutureState, _RemoteBase, local_value, register_with_jax
from jitserve.client._trace import local_input
from jitserve.client.errors import (
    APIError,
    ConnectError,
    FuturePending,
    JitserveError,
    JitserveTimeout,
    NotFound,
    ProtocolError,
    RequestTimeout,
    ServerError,
    TransportError,
    error_from_response,
)

__all__ = ["BaseClient", "Ref"]

T = TypeVar("T")
WireFormat = Literal["msgpack", "json"]

API_KEY_ENV = "JITSERVE_API_KEY"
DEFAULT_URL = "http://127.0.0.1:8000"
USER_AGENT = "jitserve-client/0.1.0"


def fill(buf: bytearray | memoryview, pos: int, chunk: bytes) -> int:
    """Copy ``chunk`` into ``buf`` at ``pos``; the new position."""
    end = pos + len(chunk)
    if end > len(buf):
        raise ProtocolError(f"answer is longer than its Content-Length of {len(buf)}")
    buf[pos:end] = chunk
    return end


@dataclasses.dataclass(frozen=True)
class _Call:
    """One HTTP request an operation needs; ``wait`` is the server-side wait it asks for."""

    method: str
    path: str
    params: dict[str, str] | None = None
    content: bytes | wire.PackedBody | None = None
    content_type: str | None = None
    wait: float = 0.0
    replica: str | None = None  # the replica holding the futures it is about (a hint)


@functools.lru_cache(maxsize=512)
def _url(base_url: str, path: str, params: tuple[tuple[str, str], ...]) -> httpx.URL:
    """The absolute URL of a request, parsed once: httpx parses a path and its
    parameters again on every request (150 us, a tenth of a small call), and a
    program's calls all go to the same one."""
    return httpx.URL(base_url + path, params=dict(params) if params else None)


@dataclasses.dataclass(frozen=True)
class _Sleep:
    seconds: float


@dataclasses.dataclass(frozen=True)
class _Acquire:
    """Wait for ``lock`` (from ``_new_lock``); the operation releases it when done."""

    lock: Any


@dataclasses.dataclass(frozen=True)
class _Settle:
    """Wait until the call that makes future ``state`` is answered (``_ahead``: it is on
    its way); the operation gets its refusal thrown in, if it was refused."""

    state: Any


@dataclasses.dataclass(frozen=True)
class _Reply:
    """A 2xx answer, its body decoded by ``Content-Type``."""

    status: int
    body: Any
    request: httpx.Request

    def parse(self, parser: Callable[[Any], T]) -> T:
        """``parser(body)``, with this request on any ``ProtocolError`` it raises."""
        try:
            return parser(self.body)
        except ProtocolError as e:
            e.request = e.request or self.request
            raise


@dataclasses.dataclass(frozen=True)
class _Execution:
    """What an execute answered: a future, and its outputs when they came inline."""

    future_id: str
    out_avals: tuple[Aval, ...]
    outputs: list[np.ndarray] | None
    out_tree: Any


Op = Generator[_Call | _Sleep | _Acquire | _Settle, Any, T]


def _ms(seconds: float) -> str:
    return str(max(int(round(seconds * 1000)), 0))


def _left(deadline: float | None) -> float:
    """Seconds until ``deadline`` (``None``: infinitely many)."""
    return math.inf if deadline is None else max(deadline - time.monotonic(), 0.0)


def _weakly(method: Callable[[list[Ref]], None]) -> Callable[[list[Ref]], None]:
    """``method``, without keeping its object alive: a no-op once the object is gone."""
    ref = weakref.WeakMethod(method)

    def call(refs: list[Ref]) -> None:
        bound = ref()
        if bound is not None:
            bound(refs)

    return call


def _holder(future_ids: Iterable[Any]) -> str | None:
    """The replica holding most of ``future_ids`` (``None`` for none of a replica)."""
    held = wire.replicas_of(str(fid) for fid in future_ids)
    return held.most_common(1)[0][0] if held else None


def _seg(ident: str) -> str:
    """A path segment for an id; quoting keeps a hostile id inside its segment."""
    return quote(str(ident), safe="")


# A 503 (the replica drains, or cannot reach another's future for a moment) means the
# request was not taken: sending it again is safe. Waits of 0.25, 0.5, 1, 2 s.
_UNAVAILABLE_RETRIES = 4


def unavailable_delay(error: APIError, attempt: int) -> float | None:
    """Seconds to wait before sending again a request answered ``error``; ``None`` to give up."""
    if error.status_code != 503 or attempt >= _UNAVAILABLE_RETRIES:
        return None
    return 0.25 * 2 ** attempt


def transport_error(exc: httpx.TransportError, request: httpx.Request) -> TransportError:
    """The client's exception for an httpx transport failure."""
    text = f"{type(exc).__name__} on {request.method} {request.url}: {exc}"
    if isinstance(exc, httpx.TimeoutException):
        return RequestTimeout(text, request=request)
    if isinstance(exc, httpx.ConnectError):
        return ConnectError(text, request=request)
    return TransportError(text, request=request)


class BaseClient:
    """Configuration and every operation of the API, without IO (see the module docstring).

    Subclasses set ``_release_http``: a blocking httpx client for the
    ``ReleaseQueue``'s thread, which releases the outputs of dropped arrays.
    """

    _array_cls: type[_RemoteBase]
    _release_http: httpx.Client

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        *,
        api_key: str | None | NotGiven = NOT_GIVEN,
        timeout: Timeout | float | None = DEFAULT_TIMEOUT,
        headers: Mapping[str, str] | None = None,
        wire_format: WireFormat = "msgpack",
        max_response_bytes: int | None = None,
        progress: bool | NotGiven = NOT_GIVEN,
    ) -> None:
        if wire_format not in ("msgpack", "json"):
            raise ValueError(f"wire_format must be 'msgpack' or 'json', got {wire_format!r}")
        self.base_url = base_url.rstrip("/")
        self.api_key = os.environ.get(API_KEY_ENV) if isinstance(api_key, NotGiven) else api_key
        self.timeout = Timeout.of(timeout)
        self.wire_format: WireFormat = wire_format
        self.max_response_bytes = max_response_bytes
        self._extra_headers = dict(headers or {})
        self.progress = progress_default() if isinstance(progress, NotGiven) else progress
        self._platforms: tuple[str, ...] | None | NotGiven = NOT_GIVEN
        self._programs: set[str] = set()  # program ids the server is known to have
        self._placers: dict[Any, Any] = {}  # device_put's identity functions, by sharding
        self._releases = ReleaseQueue(_weakly(self._post_releases))
        self._ahead: Any = None  # the calls on their way (Client(run_ahead=N), _ahead)
        self._buffers = BufferPool()  # big answers are read into these (_body_buffer)
        # A client dropped without close() ends its release thread too.
        weakref.finalize(self, self._releases.stop)

    def _new_lock(self) -> Any:
        """A lock for ``_Acquire``, of the kind this client's driver waits for."""
        raise NotImplementedError

    def _placer(self, sharding: Any) -> Any:
        """``device_put`` with a sharding: an identity jitted with that output sharding,
        one per sharding (a pytree prefix, so a tree of them is keyed by its leaves)."""
        import jax

        leaves, tree = jax.tree.flatten(sharding, is_leaf=lambda s: s is None)
        key = (tree, tuple(leaves))
        placer = self._placers.get(key)
        if placer is None:
            # The subclasses' jit: a RemoteFunction, or its async twin.
            placer = self._placers[key] = self.jit(  # type: ignore[attr-defined]
                _identity, out_shardings=sharding)
        return placer

    def _knows_program(self, program_id: str) -> bool:
        return program_id in self._programs

    def _remember_program(self, program_id: str) -> None:
        self._programs.add(program_id)

    def _forget_programs(self, program_ids: Iterable[str]) -> None:
        self._programs.difference_update(program_ids)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.base_url!r})"

    # ------------------------------------------------------------------ HTTP plumbing

    def _headers(self) -> dict[str, str]:
        accept = wire.JSON if self.wire_format == "json" else f"{wire.MSGPACK}, {wire.JSON};q=0.5"
        headers = {"User-Agent": USER_AGENT, "Accept": accept}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return {**headers, **self._extra_headers}

    def _encode(self, body: Any) -> tuple[bytes | wire.PackedBody, str]:
        if self.wire_format == "json":
            return wire.dumps_json(body), wire.JSON
        if _array_bytes(body) < wire.STREAM_BYTES:
            # One call of the C packer: packing piece by piece ran 44 Python calls
            # for a one-array call, a twentieth of its client CPU.
            return wire.packb(body), wire.MSGPACK
        packed = wire.PackedBody(wire.pack_pieces(body))
        # Big bodies go out as views of the arrays' own buffers: no copy into one
        # message, which costs as much again as sending it.
        return (packed if packed.nbytes >= wire.STREAM_BYTES else packed.join()), wire.MSGPACK

    def _build_request(self, http: httpx.Client | httpx.AsyncClient, call: _Call) -> httpx.Request:
        headers = {"Content-Type": call.content_type} if call.content_type else {}
        if call.replica is not None:  # for a balancer that routes by it (docs/deploy.md)
            headers[wire.REPLICA_HEADER] = call.replica
        content: Any = call.content
        if isinstance(content, wire.PackedBody):
            # With a length the server reads into one buffer of the right size.
            headers["Content-Length"] = str(content.nbytes)
            content = aiter(content) if isinstance(http, httpx.AsyncClient) else iter(content)
        params = tuple(call.params.items()) if call.params else ()
        return http.build_request(call.method, _url(self.base_url, call.path, params),
                                  content=content, headers=headers or None,
                                  timeout=self.timeout.to_httpx(call.wait))

    def _body_buffer(self, response: httpx.Response) -> memoryview | None:
        """One buffer of the declared length for a big answer; ``None``: read it as usual.

        Reading a big answer chunk by chunk and joining the chunks copies it once
        more than filling a buffer of the right size. The buffer comes from
        ``_buffers`` (warm pages) and the answer's arrays are views of it.
        """
        declared = response.headers.get("content-length", "")
        if (not declared.isdigit() or int(declared) < wire.STREAM_BYTES
                or response.headers.get("content-encoding")
                or (self.max_response_bytes and int(declared) > self.max_response_bytes)):
            return None
        return self._buffers.take(int(declared)).data

    def _decode_body(self, response: httpx.Response, data: Any = None) -> Any:
        ctype = response.headers.get("content-type", "").split(";")[0].strip().lower()
        data = response.content if data is None else data
        if not data:
            return None
        if ctype in wire.MSGPACK_TYPES:
            return wire.unpackb(data, max_bytes=self.max_response_bytes)
        if ctype == wire.JSON or ctype.endswith("+json"):
            return wire.loads_json(data, max_bytes=self.max_response_bytes)
        return response.text

    def _reply(self, response: httpx.Response, data: Any = None) -> _Reply:
        """Decode a 2xx answer, or raise the ``APIError`` of a 4xx/5xx one."""
        try:
            body = self._decode_body(response, data)
        except wire.WireError as e:
            if response.is_success:
                raise ProtocolError(f"undecodable answer to {response.request.method} "
                                    f"{response.request.url}: {e}", request=response.request) from e
            body = None
        if not response.is_success:
            raise error_from_response(response, body)
        return _Reply(response.status_code, body, response.request)

    # ------------------------------------------------------------------ arguments, arrays

    def _arg(self, a: Any) -> Any:
        """One execute argument on the wire: a future reference or an array."""
        if isinstance(a, _RemoteBase):
            # Another client's future lives on another server (or under another key).
            return a.ref() if a._belongs_to(self) else np.asarray(a)
        if wire.is_future_ref(a):
            return dict(a)
        return np.asarray(a)

    def _wrap(self, ex: _Execution, avals: Sequence[Aval] | None = None,
              keys: Sequence[KeyType | None] | None = None, name: str = "",
              shardings: Sequence[Any] = ()) -> list[Any]:
        """The remote arrays of an execution (``avals`` overrides the server's).

        ``keys`` gives the ``KeyType`` of outputs that are typed PRNG keys; ``name``
        is what compile progress calls the computation; ``shardings`` the outputs'
        layouts on the server's devices, for a sharded program.
        """
        avals = avals or ex.out_avals
        values = None if ex.outputs is None else dict(enumerate(ex.outputs))
        state = _FutureState(self, ex.future_id, len(avals), self._releases, values=values,
                             name=name, nbytes=[a.nbytes for a in avals])
        return self._arrays(state, avals, keys, shardings)

    def _arrays(self, state: _FutureState, avals: Sequence[Aval],
                keys: Sequence[KeyType | None] | None = None,
                shardings: Sequence[Any] = ()) -> list[Any]:
        """The remote arrays of future ``state``'s outputs (``_wrap``)."""
        if "jax" in sys.modules:  # without jax, nobody can hand them to jax
            register_with_jax()
        keys = keys or (None,) * len(avals)
        shardings = shardings or (None,) * len(avals)
        return [self._array_cls(state, i, a, k, s)
                for i, (a, k, s) in enumerate(zip(avals, keys, shardings))]

    @staticmethod
    def _outputs(body: Any) -> list[np.ndarray]:
        outputs = body.get("outputs") if isinstance(body, Mapping) else None
        if not isinstance(outputs, list) or not all(isinstance(o, np.ndarray) for o in outputs):
            raise ProtocolError(f"expected {{'outputs': [arrays...]}}, got {body!r:.200}")
        return outputs

    # ------------------------------------------------------------------ operations

    def _op_upload(self, program: bytes, format: str | None) -> Op[ProgramInfo]:
        params = {"format": format} if format else None
        reply = yield _Call("POST", "/v1/programs", params, bytes(program), wire.OCTET_STREAM)
        return reply.parse(ProgramInfo.from_json)

    def _op_get_program(self, program_id: str) -> Op[ProgramInfo | None]:
        try:
            reply = yield _Call("GET", f"/v1/programs/{_seg(program_id)}")
        except NotFound:
            return None
        return reply.parse(ProgramInfo.from_json)

    def _op_compile(self, program_id: str, in_avals: Iterable[Any] | None,
                    static_key: str, donate: Sequence[int] = (),
                    compiler_options: Mapping[str, Any] | None = None) -> Op[CompileInfo]:
        body: dict[str, Any] = {"static_key": static_key}
        if in_avals is not None:
            body["in_avals"] = [Aval.of(a).to_json() for a in in_avals]
        if donate:
            body["donate"] = list(donate)
        if compiler_options:
            body["compiler_options"] = dict(compiler_options)
        content, ctype = self._encode(body)
        reply = yield _Call("POST", f"/v1/programs/{_seg(program_id)}/compile", None, content, ctype)
        return reply.parse(CompileInfo.from_json)

    def _op_execute(self, program_id: str, args: Sequence[Any], wait: float | None,
                    static_key: str, donate: Sequence[int] = (),
                    out_avals: Sequence[Aval] | None = None,
                    compiler_options: Mapping[str, Any] | None = None) -> Op[_Execution]:
        """Run a program; the remote arrays of ours at ``donate`` are deleted once it is
        queued. ``out_avals``: the outputs' avals where the caller knows them (a
        ``jit``), so an answer's are not read again on every call. ``compiler_options``:
        XLA options of its executable (``jax.jit``'s)."""
        for a in args:  # an input from a call on its way (``_ahead``): once it is answered
            if isinstance(a, _RemoteBase) and a._belongs_to(self) and not a._future.is_known():
                yield _Settle(a._future)
        body: dict[str, Any] = {"args": [self._arg(a) for a in args]}
        if static_key:
            body["static_key"] = static_key
        if donate:
            body["donate"] = list(donate)
        if compiler_options:
            body["compiler_options"] = dict(compiler_options)
        content, ctype = self._encode(body)
        ask = None if wait is None else min(wait, self.timeout.poll)
        params = None if ask is None else {"wait": _ms(ask)}
        reply = yield _Call("POST", f"/v1/programs/{_seg(program_id)}/execute", params,
                            content, ctype, wait=ask or 0.0,
                            replica=_holder(a["future"] for a in body["args"]
                                            if wire.is_future_ref(a)))
        ex = reply.parse(functools.partial(self._execution, reply.status, out_avals))
        for i in donate:
            if isinstance(args[i], _RemoteBase) and args[i]._belongs_to(self):
                args[i]._release_here()  # the server released it
        return ex

    def _op_put(self, x: Any) -> Op[Any]:
        """Upload the arrays of pytree ``x`` once (``POST /v1/arrays``); the tree of remote arrays.

        Leaves are canonicalized as ``jax.device_put`` does; remote arrays of this
        client stay as they are.
        """
        import jax

        leaves, treedef = jax.tree_util.tree_flatten(x)
        todo = [i for i, leaf in enumerate(leaves)
                if not (isinstance(leaf, _RemoteBase) and leaf._belongs_to(self))]
        if todo:
            inputs = [local_input(local_value(leaves[i])) for i in todo]
            content, ctype = self._encode({"arrays": [value for value, _, _ in inputs]})
            reply = yield _Call("POST", "/v1/arrays", None, content, ctype)
            ex = reply.parse(functools.partial(self._execution, reply.status, None))
            avals = [Aval(v.shape, wire.dtype_name(v.dtype), spec.weak_type) for v, spec, _ in inputs]
            arrays = self._wrap(ex, avals, [key for _, _, key in inputs], "device_put")
            for i, array in zip(todo, arrays):
                leaves[i] = array
        return jax.tree_util.tree_unflatten(treedef, leaves)

    def _execution(self, status: int, known: Sequence[Aval] | None, body: Any) -> _Execution:
        if not isinstance(body, Mapping) or not isinstance(body.get("future_id"), str):
            raise ProtocolError(f"execute answer: expected a future_id, got {body!r:.200}")
        if known is not None and status in (200, 202):
            outputs = self._outputs(body) if status == 200 and "outputs" in body else None
            return _Execution(body["future_id"], tuple(known), outputs, body.get("out_tree"))
        if status == 200 and "outputs" in body:
            outputs = self._outputs(body)
            avals = tuple(Aval(o.shape, o.dtype.name) for o in outputs)
            return _Execution(body["future_id"], avals, outputs, body.get("out_tree"))
        info = FutureInfo.from_json({"status": "pending", **body})
        return _Execution(info.future_id, info.out_avals, None, info.out_tree)

    def _op_future(self, future_id: str, wait: float | None) -> Op[FutureInfo]:
        ask = None if wait is None else min(wait, self.timeout.poll)
        params = None if ask is None else {"wait": _ms(ask)}
        reply = yield _Call("GET", f"/v1/futures/{_seg(future_id)}", params, wait=ask or 0.0,
                            replica=wire.replica_of(future_id))
        return reply.parse(FutureInfo.from_json)

    def _op_fetch(self, st: _FutureState, index: int, future_id: str,
                  deadline: float | None) -> Op[None]:
        """Fetch output ``index`` of future ``st`` (and its small siblings:
        ``_FutureState.wanted``) into ``st``, waiting until ``deadline`` at most."""
        wanted = st.wanted(index)
        wait = None if deadline is None else _left(deadline)
        try:
            got = yield from self._op_result(future_id, wait, wanted, st.name)
        except NotFound:
            if wanted == [index]:
                raise
            # A sibling was released since ``wanted`` was read (dropped in another
            # thread: a running-ahead sender lets go of the inputs of the calls it
            # sent), and the server refused the whole fetch: ask for the one output.
            wanted = [index]
            wait = None if deadline is None else _left(deadline)
            got = yield from self._op_result(future_id, wait, wanted, st.name)
        st.keep(got, wanted)

    def _op_result(self, future_id: str, wait: float | None, outputs: Sequence[int] | None = None,
                   name: str | None = None) -> Op[list[np.ndarray]]:
        """Long-poll ``/result`` in slices of at most ``timeout.poll`` until done or ``wait``.

        ``outputs`` asks for those outputs only, in that order. Past ``PROGRESS_AFTER``
        seconds it looks once whether the future is compiling (see ``_op_watch``).
        """
        deadline = None if wait is None else time.monotonic() + wait
        watch_at = time.monotonic() + PROGRESS_AFTER if self.progress else math.inf
        chosen = {} if outputs is None else {"outputs": ",".join(map(str, outputs))}
        backoff = 0.01
        while True:
            ask = min(self.timeout.poll, _left(deadline), max(watch_at - time.monotonic(), 0.0))
            started = time.monotonic()
            try:
                reply = yield _Call("GET", f"/v1/futures/{_seg(future_id)}/result",
                                    {**chosen, "wait": _ms(ask)} if ask > 0 else chosen or None,
                                    wait=ask, replica=wire.replica_of(future_id))
                return reply.parse(self._outputs)
            except FuturePending as e:
                if deadline is not None and time.monotonic() >= deadline:
                    raise JitserveTimeout(f"future {future_id} not done after {wait} s",
                                          request=e.request) from e
                if time.monotonic() >= watch_at:
                    watch_at = math.inf
                    info = yield from self._op_future(future_id, None)
                    yield from self._op_watch(info, name, deadline)
                elif time.monotonic() - started < ask / 2:
                    # The server answered early without holding the request: back off.
                    yield _Sleep(min(backoff, _left(deadline)))
                    backoff = min(backoff * 2, 1.0)

    def _op_wait(self, future_id: str, name: str | None = None) -> Op[FutureInfo]:
        """Long-poll the future's status until it finishes, showing compile progress as ``_op_result``."""
        watch_at = time.monotonic() + PROGRESS_AFTER if self.progress else math.inf
        while True:
            info = yield from self._op_future(
                future_id, min(self.timeout.poll, max(watch_at - time.monotonic(), 0.0)))
            if info.done:
                return info
            if time.monotonic() >= watch_at:
                watch_at = math.inf
                yield from self._op_watch(info, name, None)

    def _op_watch(self, info: FutureInfo, name: str | None, deadline: float | None) -> Op[None]:
        """While ``info``'s future compiles, show for how long; returns when it stops, or at ``deadline``."""
        if info.status != wire.FutureStatus.COMPILING:
            return
        with compile_progress(name or f"future {info.future_id}", self.base_url) as show:
            while info.status == wire.FutureStatus.COMPILING:
                show(float(info.timings.get("compile_s") or 0.0))
                ask = min(PROGRESS_TICK, _left(deadline))
                if ask <= 0:
                    return
                started = time.monotonic()
                info = yield from self._op_future(info.future_id, ask)
                if info.status == wire.FutureStatus.COMPILING and time.monotonic() - started < ask / 2:
                    yield _Sleep(ask / 2)  # a server that does not hold the request

    def _op_delete(self, future_id: str) -> Op[str]:
        reply = yield _Call("DELETE", f"/v1/futures/{_seg(future_id)}",
                            replica=wire.replica_of(future_id))
        body = reply.body
        return str(body.get("status", "")) if isinstance(body, Mapping) else ""

    def _release_call(self, refs: Iterable[Ref]) -> _Call:
        refs = list(refs)
        content, ctype = self._encode({"outputs": [{"future": f, "output": i} for f, i in refs]})
        return _Call("POST", "/v1/futures/release", None, content, ctype,
                     replica=_holder(f for f, _ in refs))

    def _op_calls(self, calls: list[dict[str, Any]], wait: float | None = None,
                  release: Sequence[Ref] = ()) -> Op[tuple[list[Any], bool]]:
        """``POST /v1/calls``: start ``calls`` in order, then let go of ``release``; one
        entry per call, its future or its error (``_ahead``), and whether the server
        takes releases with a batch. With ``wait``, the ``inline`` calls' entries carry
        their outputs if they end within it. Sent to the replica holding most of the
        batch's inputs."""
        body: dict[str, Any] = {"calls": calls}
        if release:
            body["release"] = [{"future": f, "output": i} for f, i in release]
        content, ctype = self._encode(body)
        ask = None if wait is None else min(wait, self.timeout.poll)
        params = None if ask is None else {"wait": _ms(ask)}
        refs = (a["future"] for c in calls for a in c["args"] if wire.is_future_ref(a))
        reply = yield _Call("POST", "/v1/calls", params, content, ctype, wait=ask or 0.0,
                            replica=_holder(refs))
        entries = reply.body.get("calls") if isinstance(reply.body, Mapping) else None
        if not isinstance(entries, list) or len(entries) != len(calls):
            raise ProtocolError(f"POST /v1/calls: expected {len(calls)} entries, got "
                                f"{reply.body!r:.200}", request=reply.request)
        return entries, type(reply.body.get("released")) is int

    def _op_release(self, refs: Iterable[Ref]) -> Op[int]:
        reply = yield self._release_call(refs)
        body = reply.body
        return int(body.get("released", 0)) if isinstance(body, Mapping) else 0

    def _post_releases(self, refs: list[Ref]) -> None:
        """Send one batch for the ``ReleaseQueue``, from its thread, over ``_release_http``."""
        request = self._build_request(self._release_http, self._release_call(refs))
        self._release_http.send(request).raise_for_status()

    def _op_batching(self, method: str, program_id: str,
                     config: Mapping[str, Any] | None = None) -> Op[dict[str, Any]]:
        """``GET``, ``PUT`` or ``DELETE`` a program's batching (docs/batching.md)."""
        content = None if config is None else json.dumps(dict(config)).encode()
        reply = yield _Call(method, f"/v1/programs/{_seg(program_id)}/batching", None, content,
                            None if config is None else wire.JSON)
        return dict(reply.body)

    def _op_get(self, path: str) -> Op[Any]:
        reply = yield _Call("GET", path)
        return reply.body

    def _op_ready(self) -> Op[bool]:
        try:
            yield _Call("GET", "/readyz")
        except ServerError:
            return False
        return True

    def _op_mesh(self, shape: Sequence[int], axis_names: Sequence[str]) -> Op[Any]:
        """``Client.mesh``: checked against the devices ``/v1/devices`` lists."""
        from jax.sharding import AbstractMesh

        shape, axis_names = tuple(int(n) for n in shape), tuple(str(a) for a in axis_names)
        if len(shape) != len(axis_names) or any(n < 1 for n in shape):
            raise ValueError(f"a mesh needs one positive size per axis name; got shape {shape} "
                             f"for axes {axis_names}")
        doc = yield from self._op_get("/v1/devices")
        have = 1
        if isinstance(doc, Mapping):  # the largest group's, or every device listed
            have = int(doc.get("max_program_devices") or len(doc.get("devices") or [None]))
        need = math.prod(shape)
        if need > have:
            raise ValueError(f"a mesh of shape {shape} needs {need} devices; the server runs "
                             f"programs on at most {have}")
        return AbstractMesh(shape, axis_names)

    def _op_executable(self, executable_id: str) -> Op[dict[str, Any] | None]:
        """The server's record of an executable (``GET /v1/executables/{id}``); ``None``
        when no tier holds it any more."""
        try:
            return (yield from self._op_get(f"/v1/executables/{_seg(executable_id)}"))
        except NotFound:
            return None

    def _op_executable_text(self, executable_id: str) -> Op[str]:
        """An executable's optimized HLO (``GET /v1/executables/{id}/text``)."""
        text = yield from self._op_get(f"/v1/executables/{_seg(executable_id)}/text")
        return text if isinstance(text, str) else ""

    def _op_platforms(self) -> Op[tuple[str, ...] | None]:
        """The server's jax.export platforms (from ``/v1/devices``), asked once per client."""
        if isinstance(self._platforms, NotGiven):
            try:
                body = yield from self._op_get("/v1/devices")
            except NotFound:
                body = None
            self._platforms = platforms_of(body)
        return self._platforms


def _identity(x: Any) -> Any:
    """What ``device_put`` with a sharding runs: the arrays, laid out as it asks."""
    return x


def platforms_of(doc: Any) -> tuple[str, ...] | None:
    """The export platforms named in a ``/v1/devices`` document; ``None`` if it names none.

    Reads ``platform`` from the document, its ``backend`` and each of its ``devices``
    (or from each entry of a list). jax backends say ``gpu`` where jax.export says
    ``cuda`` or ``rocm``; the document's platform versions tell which.
    """
    entries = list(doc) if isinstance(doc, list) else [doc]
    if isinstance(doc, Mapping):
        entries.append(doc.get("backend"))
        devices = doc.get("devices")
        entries += devices if isinstance(devices, list) else []
    rocm = "rocm" in repr(doc).lower()
    found: list[str] = []
    for e in entries:
        if isinstance(e, Mapping) and isinstance(e.get("platform"), str):
            name = e["platform"].lower()
            found.append(("rocm" if rocm else "cuda") if name == "gpu" else name)
    return tuple(dict.fromkeys(found)) or None


def drive_step(op: Op[T], value: Any,
               exc: JitserveError | None) -> _Call | _Sleep | _Acquire | _Settle:
    """Advance ``op`` with an answer or an exception; ``StopIteration`` carries its result.

    An exception ``op`` does not catch goes on to the caller with this frame in its
    traceback: neither this frame nor the driver's may keep it in a variable, or the
    two would hold each other (a cycle, freed only by the garbage collector), and
    with them every frame it went through and the arrays in their locals: a program
    that caught a failed read held its arrays past their last use."""
    if exc is None:
        return op.send(value)
    try:
        return op.throw(exc)
    finally:
        del exc


_NO_BYTES = frozenset({str, int, float, bool, type(None)})


def _array_bytes(obj: Any) -> int:
    """The bytes of the arrays and buffers in a message about to be packed."""
    kind = type(obj)  # exact types first: a batch of calls is mostly small dicts and ids
    if kind is dict:
        return sum(map(_array_bytes, obj.values()))
    if kind is list or kind is tuple:
        return sum(map(_array_bytes, obj))
    if kind in _NO_BYTES:
        return 0
    if isinstance(obj, (np.ndarray, memoryview)):
        return obj.nbytes
    if isinstance(obj, (bytes, bytearray)):
        return len(obj)
    if isinstance(obj, Mapping):
        return sum(_array_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_array_bytes(v) for v in obj)
    return 0
