"""JAX's remote-backend protocol, the IFRT proxy, served over gRPC (``xla.ifrt.proxy.GrpcIfrtService``).

jaxlib ships the client (``jaxlib._ifrt_proxy``); ``jitserve.client.ifrt_plugin``
registers it as jax's ``jitserve`` backend, so an unmodified JAX program run with
``JAX_PLATFORMS=jitserve JITSERVE_IFRT_TARGET=host:port`` sends every array and
program here. Served with ``grpc.aio`` on the API process's event loop, on a port of
its own (``JITSERVE_IFRT_PORT``; off when unset).

- ``GetVersion`` answers a protocol version both sides know (``PROTOCOL_VERSIONS``),
  or fails with FAILED_PRECONDITION naming both ranges: jaxlib's client aborts its
  process on an answer outside its range, so none is ever given.
- ``IfrtSession`` is one client: a stream of requests answered in order. A session is
  placed on one runtime (by API key, as ``/v1`` callers are) and lives there: its
  arrays and executables are the runtime's, and this process only relays. Requests
  queue while a batch is at the runtime and go as the next batch (``Op.IFRT``), so a
  client that pipelines is answered at the runtime's pace, not a round trip's. A
  request whose host buffer is still on its way holds its batch open until it comes,
  so the requests sent behind it (the call that uses the array) go along. Sessions
  open at once are bounded, in all (``JITSERVE_IFRT_MAX_SESSIONS``) and per key
  (``JITSERVE_TENANT_MAX_IFRT_SESSIONS``): one more is refused as it opens.
- ``HostBufferStore``/``Lookup``/``Delete`` move array bytes. Stored buffers wait here
  until the request that names them goes, and cross to the runtime in shared memory;
  a request whose buffer does not arrive within ``JITSERVE_IFRT_HOST_BUFFER_WAIT_S``
  is answered NOT_FOUND. What waits here, and what is on its way, is bounded
  (``JITSERVE_IFRT_MAX_HOST_BYTES``): a store past it waits for room, which the batch
  before the request that names it makes (``_room_to_receive``, ``_relay``).

A session ends when the client closes it, when it sends nothing for
``JITSERVE_IFRT_SESSION_IDLE_S``, when its runtime stops (a crash: UNAVAILABLE; an
execution past ``JITSERVE_EXECUTION_TIMEOUT_S``: DEADLINE_EXCEEDED), or when the
server shuts down (UNAVAILABLE: at the end of a SIGTERM's drain, which refuses new
sessions and gives open ones ``JITSERVE_DRAIN_TIMEOUT_S`` to close, or at once), with
a status that says which; the runtime then drops all it held. One log line per session says
who, how long and what it used.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import numpy as np

from jitserve.compiler.ifrt_protos import message

from ..api.auth import authenticate
from ..calls.futures import FutureStore
from ..calls.quotas import Quotas
from ..calls.tenants import Tenants, scope_of
from ..console import CompileRecord, Console
from ..errors import Unauthorized
from ..memory import SharedMemoryFull
from ..metrics import Metrics
from ..runtimes import frames
from ..runtimes.pool import RemoteError, Runtime, RuntimeLost, RuntimePool
from ..runtimes.protocol import IfrtCompiled, Op
from ..settings import Settings

__all__ = ["PROTOCOL_VERSIONS", "IfrtService", "start"]

log = logging.getLogger("jitserve.ifrt")

SERVICE = "xla.ifrt.proxy.GrpcIfrtService"
# The protocol versions this server speaks: jaxlib 0.10.2's and 0.11.2's clients ask
# for 16-25 (their serdes versions, 3 and 6, are taken as they come).
PROTOCOL_VERSIONS = range(16, 26)
SESSION_METADATA = "ifrt-proxy-grpc-ifrt-session-metadata-bin"
STORE_METADATA = "ifrt-proxy-grpc-host-buffer-store-metadata-bin"
API_KEY_ATTRIBUTE = "jitserve_api_key"  # in the session's initialization_data
# The devices a session asks for (JITSERVE_IFRT_DEVICES): it goes to the smallest group
# of at least that many; without it, to one of the largest groups.
DEVICES_ATTRIBUTE = "jitserve_devices"
_P = "xla.ifrt.proxy."
_BATCH_MAX = 256  # requests in one batch to a runtime
_CHUNK = 4 << 20  # bytes per HostBufferLookup message
# How long a session the server ended at shutdown still answers its client's requests
# with why: less than the grace ``grpc.aio.Server.stop`` gives handlers (``stop``).
_STOP_ANSWER_S = 2.0
_STOP = (b"", None)  # put in a session's queue to wake it when it should end (``end_all``)
# Requests read from a session's stream and not yet sent to its runtime: past this many
# bytes in its queue, and again in the batch being made, the stream is read no further
# until they go (gRPC's flow control holds the client back), so a client that sends
# faster than its runtime answers cannot fill this process's memory.
_QUEUED_MAX_BYTES = 64 << 20
_QUEUED_MAX = 4 * _BATCH_MAX


class _Requests:
    """A session's requests as they came, waiting for the batch that sends them: a queue
    (``None`` ends it) whose reader waits for ``room`` once it holds ``_QUEUED_MAX``
    requests or ``_QUEUED_MAX_BYTES``."""

    def __init__(self) -> None:
        self._items: asyncio.Queue[tuple[bytes, Any] | None] = asyncio.Queue()
        self.bytes = 0
        self._room = asyncio.Event()
        self._room.set()

    def put_nowait(self, item: tuple[bytes, Any] | None) -> None:
        self._items.put_nowait(item)
        self.bytes += len(item[0]) if item is not None else 0
        if self.bytes >= _QUEUED_MAX_BYTES or self._items.qsize() >= _QUEUED_MAX:
            self._room.clear()

    async def room(self) -> None:
        """Until the queue is under its bounds."""
        await self._room.wait()

    async def get(self) -> tuple[bytes, Any] | None:
        return self._took(await self._items.get())

    def get_nowait(self) -> tuple[bytes, Any] | None:
        return self._took(self._items.get_nowait())

    def empty(self) -> bool:
        return self._items.empty()

    def qsize(self) -> int:
        return self._items.qsize()

    def _took(self, item: tuple[bytes, Any] | None) -> tuple[bytes, Any] | None:
        self.bytes -= len(item[0]) if item is not None else 0
        if self.bytes < _QUEUED_MAX_BYTES and self._items.qsize() < _QUEUED_MAX:
            self._room.set()
        return item


@dataclasses.dataclass(eq=False)
class _Session:
    """One client's session, as this process sees it (its state is the runtime's)."""

    id: int
    owner: str
    runtime: Runtime
    protocol: int
    opened: float = dataclasses.field(default_factory=time.monotonic)
    generation: int | None = None  # the runtime process that holds it, from its first batch
    host_in: dict[int, _Stored] = dataclasses.field(default_factory=dict)
    # Host buffers refused (over a limit), by handle: why. The requests that name one
    # fail with that (their arrays hold the error), not the session.
    refused: dict[int, str] = dataclasses.field(default_factory=dict)
    host_out: dict[int, Any] = dataclasses.field(default_factory=dict)  # ndarray, or nbytes
    arrived: dict[int, asyncio.Event] = dataclasses.field(default_factory=dict)
    awaited: set[int] = dataclasses.field(default_factory=set)  # host buffers a request waits for
    requests: int = 0
    held: int = 0  # bytes of host_in, and of host_out's inline buffers
    incoming: int = 0  # bytes of stores on their way (``_room_to_receive``)
    held_back: set[int] = dataclasses.field(default_factory=set)  # stores waiting for room
    room: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)  # set as room frees
    # Requests held for the next batch: the first names a store that waits for the room
    # the batch before it makes (``_relay``).
    carry: list[tuple[bytes, Any]] = dataclasses.field(default_factory=list)
    admitted: set[int] = dataclasses.field(default_factory=set)  # held-back stores let through

    def freed(self) -> None:
        """Wake the stores waiting for room (``IfrtService._room_to_receive``)."""
        self.room.set()
        self.room = asyncio.Event()
    bytes_in: int = 0
    bytes_out: int = 0
    compiles: dict[str, int] = dataclasses.field(default_factory=dict)  # by tier
    device_bytes: int = 0  # its arrays' on the runtime, as of its last batch
    arrays: int = 0  # how many arrays it holds there, as of its last batch
    ended: str | None = None  # why it ended (a label), once it has
    ended_because: str = ""  # and in words
    # Its client's requests as they come (``IfrtService._read``); ``None`` when the
    # stream ended, ``_STOP`` when the server asks it to end (``stopping``).
    queue: _Requests = dataclasses.field(default_factory=_Requests)
    stopping: _SessionEnded | None = None  # the server ends it at the next batch (shutdown)

    def event(self, handle: int) -> asyncio.Event:
        event = self.arrived.get(handle)
        if event is None:
            event = self.arrived[handle] = asyncio.Event()
        return event


@dataclasses.dataclass(eq=False)
class _Stored:
    """A host buffer the client stored: small ones as bytes, big ones in a shared-memory
    segment of the pool's cache, written in place as the chunks come and read in place by
    the runtime (one copy on the way in)."""

    size: int
    data: bytes = b""
    segment: Any = None  # frames.Segment

    def desc(self) -> dict[str, Any]:
        """The uint8 array the runtime reads (``frames.ArrayDesc``)."""
        if self.segment is None:
            return {"dtype": "uint8", "shape": [self.size], "data": self.data}
        return {"dtype": "uint8", "shape": [self.size], "shm": self.segment.name, "offset": 0}


class _SessionEnded(Exception):
    """The session cannot go on: ``code`` and ``reason`` are its stream's status."""

    def __init__(self, code: grpc.StatusCode, reason: str, label: str) -> None:
        super().__init__(reason)
        self.code = code
        self.label = label


class IfrtService:
    """The handlers of ``GrpcIfrtService``; ``sessions`` are those open now."""

    def __init__(self, settings: Settings, runtimes: RuntimePool, metrics: Metrics,
                 console: Console | None = None, futures: FutureStore | None = None,
                 tenants: Tenants | None = None) -> None:
        self.settings = settings
        self.runtimes = runtimes
        self.metrics = metrics
        self.console = console
        # A key's /v1 futures and its sessions' arrays share its quotas: each side
        # counts the other's (FutureStore.held_elsewhere, and the batch's quotas here).
        self.futures = futures
        self._bytes_of: collections.Counter[str] = collections.Counter()  # by key, open sessions
        self._arrays_of: collections.Counter[str] = collections.Counter()
        if futures is not None:
            futures.held_elsewhere = self.held
        # Compiles per minute likewise: the key's /v1 compiles go with each batch, and its
        # sessions' real compiles (their times here) count in its /v1 budget.
        self.tenants = tenants
        self.compiled_at: dict[str, collections.deque[float]] = collections.defaultdict(
            collections.deque)
        if tenants is not None:
            tenants.compiles.elsewhere = self.compiles_in_minute
        self.sessions: dict[int, _Session] = {}
        # Sessions that ended while their client still uses them: their streams answer
        # every request with why (``_refusals``), and their host buffer calls are served
        # as an ended session's are, until the stream ends.
        self.ended: dict[int, _Session] = {}
        # With API keys, a key's quotas, counted by the runtime that holds its sessions
        # (placement is by key): device bytes and arrays over its IFRT arrays, and compiles.
        quotas = Quotas.from_settings(settings, settings.compile_workers)
        self.quotas = ({"device_bytes": quotas.device_bytes, "arrays": quotas.live_futures,
                        "compiles_per_minute": quotas.compiles_per_minute}
                       if settings.auth_enabled else None)
        self.sessions_per_key = quotas.ifrt_sessions if settings.auth_enabled else None
        self.refusing = False  # the server is shutting down: no new session
        self._closing: set[asyncio.Future[None]] = set()  # sessions whose runtime drops them

    # -- shutdown (``service.calls.drain.Sessions``) ----------------------------------

    def refuse_new(self) -> None:
        """Open no more sessions: each is refused with UNAVAILABLE saying the server drains."""
        self.refusing = True

    def open_count(self) -> int:
        """Sessions open, or closing (their runtime drops them)."""
        return len(self.sessions) + len(self._closing)

    async def end_all(self, reason: str) -> None:
        """End every open session with UNAVAILABLE and ``reason``: an idle one at once, a
        busy one when its batch at the runtime is answered. Returns once they all closed,
        or after ``_STOP_ANSWER_S`` (a batch still running then ends with the runtimes)."""
        self.refusing = True
        for session in list(self.sessions.values()):
            if session.stopping is None:
                session.stopping = _SessionEnded(grpc.StatusCode.UNAVAILABLE, reason, "shutdown")
                session.queue.put_nowait(_STOP)
        deadline = time.monotonic() + _STOP_ANSWER_S
        while self.sessions and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    def compiles_in_minute(self, owner: str) -> int:
        """How many real compiles ``owner``'s sessions started in the last minute."""
        window = self.compiled_at.get(owner)
        if not window:
            return 0
        while window and window[0] < time.monotonic() - 60:
            window.popleft()
        return len(window)

    def held(self, owner: str) -> tuple[int, int]:
        """The device bytes and arrays ``owner``'s open sessions hold, as of their last
        batches (kept per key as they change: every /v1 call of the key asks)."""
        return self._bytes_of.get(owner, 0), self._arrays_of.get(owner, 0)

    def _holds(self, session: _Session, device_bytes: int, arrays: int) -> None:
        """``session`` holds this now (its last batch said so, or it closed: 0)."""
        owner = session.owner
        self._bytes_of[owner] += device_bytes - session.device_bytes
        self._arrays_of[owner] += arrays - session.arrays
        session.device_bytes, session.arrays = device_bytes, arrays
        if not self._bytes_of[owner] and not self._arrays_of[owner]:
            del self._bytes_of[owner], self._arrays_of[owner]

    def describe(self) -> list[dict[str, Any]]:
        """The open sessions, for the console (``service.console``): each one's id, owner
        (its key's digest, "" without keys), runtime, age, requests, bytes each way,
        compiles by tier, the device bytes its arrays held after its last batch, and the host
        buffers its next requests wait for."""
        now = time.monotonic()
        return [{"session": f"{s.id:016x}", "owner": s.owner, "runtime": s.runtime.index,
                 "protocol": s.protocol, "age_s": round(now - s.opened, 3),
                 "requests": s.requests, "bytes_in": s.bytes_in, "bytes_out": s.bytes_out,
                 "host_bytes_held": s.held, "host_bytes_incoming": s.incoming,
                 "stores_held_back": sorted(s.held_back), "requests_queued": s.queue.qsize(),
                 "request_bytes_queued": s.queue.bytes, "device_bytes": s.device_bytes,
                 "compiles": dict(s.compiles), "waiting_for_host_buffers": sorted(s.awaited)}
                for s in list(self.sessions.values())]

    # -- GetVersion ------------------------------------------------------------------

    async def get_version(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await self._parse("GrpcGetVersionRequest", data, context)
        low = max(request.min_version.protocol_version, PROTOCOL_VERSIONS.start)
        high = min(request.max_version.protocol_version, PROTOCOL_VERSIONS.stop - 1)
        if low > high:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, (
                f"the client speaks IFRT proxy protocol {request.min_version.protocol_version}-"
                f"{request.max_version.protocol_version}; this jitserve server speaks "
                f"{PROTOCOL_VERSIONS.start}-{PROTOCOL_VERSIONS.stop - 1} (jaxlib 0.10.2 to 0.11.2)"))
        answer = message(_P + "GrpcGetVersionResponse")()
        answer.version.protocol_version = high
        answer.version.ifrt_serdes_version_number = request.max_version.ifrt_serdes_version_number
        return bytes(answer.SerializeToString())

    # -- IfrtSession -----------------------------------------------------------------

    async def session(self, requests: AsyncIterator[bytes],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            session = await self._open(context)
        except _SessionEnded as e:  # the first request (init) is answered with the reason:
            self.metrics.ifrt_sessions_closed.labels(e.label).inc()
            async for data in requests:  # jaxlib's client shows that, not the status
                with contextlib.suppress(Exception):
                    op_id = message(_P + "IfrtRequest").FromString(data).request_metadata.op_id
                    yield _error_response(op_id, e.code.value[0], str(e))
                break
            await context.abort(e.code, str(e))
        queue = session.queue
        reader = asyncio.ensure_future(self._read(requests, queue))
        try:
            while True:
                batch: list[tuple[bytes, Any]] = []
                try:
                    batch = await self._next_batch(session, queue) or []
                    if not batch:
                        break
                    responses = await self._relay(session, batch)
                except _SessionEnded as ended:
                    why = ended
                    if session.stopping is not None and why.label == "runtime_lost":
                        why = session.stopping  # the runtimes stop with the server
                    # Its host buffer calls are still answered, as an ended session's, from
                    # before the close's first wait (telling its runtime, which may be
                    # restarting): a call that found no session then would be NOT_FOUND,
                    # on which jaxlib's client drops the session without saying why.
                    self.ended[session.id] = session
                    await self._close(session, why.label, str(why))
                    # Each request waiting for an answer, and each one sent after, gets
                    # the reason as its error until the client ends the stream: jaxlib's
                    # client cancels a call itself when the stream ends and then says
                    # only "Connection to IFRT proxy server was terminated", so a
                    # program whose first failing call came after the end would never
                    # read why.
                    # (A batch that failed holds the requests it carried; one never made
                    # leaves them in ``carry``.)
                    pending, session.carry = batch or session.carry, []
                    async for response in self._refusals(pending, queue, why):
                        yield response
                    await context.abort(why.code, str(why))
                for response in _awaited_first(responses):
                    yield response
        finally:
            await self._close(session, "closed", "")
            self.ended.pop(session.id, None)
            reader.cancel()

    async def _refusals(self, batch: list[tuple[bytes, Any]], queue: _Requests,
                        e: _SessionEnded) -> AsyncIterator[bytes]:
        """The answers of an ended session: ``batch``'s, then those of each request the
        client sends, until it ends the stream or sends nothing for the idle time (for
        ``_STOP_ANSWER_S`` in all when the server shuts down)."""
        for _, request in batch:
            if request is not None:
                yield _refusal(request, e)
        wait_s = self.settings.ifrt_session_idle_s
        until = time.monotonic() + _STOP_ANSWER_S if e.label == "shutdown" else None
        while e.label != "idle":  # an idle client is not waited for again
            if until is not None:
                wait_s = until - time.monotonic()
            try:
                item = await asyncio.wait_for(queue.get(), max(0.0, wait_s))
            except TimeoutError:
                return
            if item is None:
                return
            if item[1] is not None:
                yield _refusal(item[1], e)

    async def _open(self, context: grpc.aio.ServicerContext) -> _Session:
        if self.refusing:
            raise _SessionEnded(grpc.StatusCode.UNAVAILABLE, (
                "jitserve is shutting down (draining) and opens no new IFRT session; start the "
                "program again (behind a load balancer, it reaches another replica)"), "draining")
        metadata = dict(context.invocation_metadata() or ())
        raw = metadata.get(SESSION_METADATA)
        if not isinstance(raw, bytes):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"an IFRT session needs its {SESSION_METADATA} metadata")
        try:
            opening = message(_P + "GrpcIfrtSessionMetadata").FromString(raw)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the {SESSION_METADATA} metadata does not parse")
        protocol = opening.version.protocol_version
        if protocol not in PROTOCOL_VERSIONS:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"IFRT proxy protocol {protocol} is not served "
                                f"({PROTOCOL_VERSIONS.start}-{PROTOCOL_VERSIONS.stop - 1} are)")
        key = None
        attributes = opening.initialization_data.attributes
        if API_KEY_ATTRIBUTE in attributes:
            key = attributes[API_KEY_ATTRIBUTE].string_value.decode("utf-8", "replace")
        try:
            if key is None and self.settings.auth_enabled:
                raise Unauthorized("this server needs an API key: the jitserve JAX backend sends "
                                   "JITSERVE_API_KEY")
            owner = authenticate(key, self.settings) or ""
        except Unauthorized as e:
            raise _SessionEnded(grpc.StatusCode.UNAUTHENTICATED, str(e), "unauthenticated") from None
        self._room_for_a_session(owner)
        devices = self._devices_asked(attributes)
        session_id = secrets.randbits(63) or 1
        runtime = self.runtimes.place(owner or None, f"{session_id:016x}", devices)
        session = _Session(session_id, owner, runtime, protocol)
        self.sessions[session_id] = session
        self.metrics.ifrt_sessions.inc()
        log.info("IFRT session %016x opened (key %s, runtime %d of %d devices, protocol %d)",
                 session_id, owner[:12] or "none", runtime.index, runtime.group.size, protocol,
                 extra={"fields": {"ifrt_session": f"{session_id:016x}", "owner": owner[:12],
                                   "runtime": runtime.index}})
        return session

    def _room_for_a_session(self, owner: str) -> None:
        """Refuse a new session past the server's limit on open sessions, or past its key's."""
        total = self.settings.ifrt_sessions_limit
        if len(self.sessions) >= total:
            raise _SessionEnded(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"this server has {len(self.sessions)} IFRT sessions open, its limit "
                f"(JITSERVE_IFRT_MAX_SESSIONS={total}); try again when one has ended"),
                "too_many_sessions")
        quota = self.sessions_per_key
        mine = sum(s.owner == owner for s in self.sessions.values())
        if quota is not None and mine >= quota:
            raise _SessionEnded(grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"quota ifrt_sessions: this key has {mine} IFRT sessions open; its quota is "
                f"{quota} (JITSERVE_TENANT_MAX_IFRT_SESSIONS): end one first"), "too_many_sessions")

    def _devices_asked(self, attributes: Any) -> int:
        """The devices a session's client asked for (``DEVICES_ATTRIBUTE``), else the most
        any group has: ``jax.devices()`` through the proxy lists its group's."""
        most = self.runtimes.max_devices
        if DEVICES_ATTRIBUTE not in attributes:
            return most
        value = attributes[DEVICES_ATTRIBUTE]
        text = value.string_value.decode("ascii", "replace") if value.string_value else str(
            value.int64_value)
        if not text.strip().isdigit() or not 1 <= int(text) <= most:
            raise _SessionEnded(grpc.StatusCode.INVALID_ARGUMENT, (
                f"JITSERVE_IFRT_DEVICES={text!r}: this server's groups have at most {most} "
                "devices (GET /v1/devices)"), "refused")
        return int(text)

    async def _read(self, requests: AsyncIterator[bytes], queue: _Requests) -> None:
        """Parse the client's requests as they come, while ``queue`` has room; ``None``
        when the stream ends."""
        try:
            async for data in requests:
                try:
                    request = message(_P + "IfrtRequest").FromString(data)
                except Exception:  # noqa: BLE001 - garbage: answered, never crashed on
                    request = None
                queue.put_nowait((data, request))
                await queue.room()
        except (asyncio.CancelledError, grpc.RpcError, grpc.aio.AioRpcError):
            pass
        finally:
            queue.put_nowait(None)

    async def _next_batch(self, session: _Session,
                          queue: _Requests) -> list[tuple[bytes, Any]] | None:
        """The requests to send next (at least one), or ``None`` once the client is done."""
        if session.stopping is not None:
            raise session.stopping
        if session.carry:
            more, session.carry = session.carry, []
        else:
            try:
                first = await asyncio.wait_for(queue.get(), self.settings.ifrt_session_idle_s)
            except TimeoutError:
                raise _SessionEnded(grpc.StatusCode.ABORTED, (
                    f"jitserve closed this session: it sent nothing for "
                    f"{self.settings.ifrt_session_idle_s:g} s (JITSERVE_IFRT_SESSION_IDLE_S)"),
                    "idle") from None
            if first is _STOP and session.stopping is not None:
                raise session.stopping
            if first is None:
                return None
            more = [first]
        # Requests that name host buffers still on their way wait for them here, before
        # the batch is closed: what the client sends meanwhile (the call that uses the
        # arrays, its ready check) then goes with them, not a runtime round trip later.
        batch: list[tuple[bytes, Any]] = []
        size = sum(len(data) for data, _ in more)  # bounded as the queue is
        while more:
            waited = False
            for _, request in more:
                kind = request.WhichOneof("request") if request is not None else None
                for handle in _host_buffers_named(request, kind) if kind else ():
                    waited = await self._wait_for_buffer(session, handle) or waited
            batch += more
            more = []
            while (len(batch) + len(more) < _BATCH_MAX and size < _QUEUED_MAX_BYTES
                   and not queue.empty()):
                item = queue.get_nowait()
                if item is None:
                    queue.put_nowait(None)  # seen again after this batch
                    break
                if item is _STOP:
                    continue  # ``stopping`` ends the session before the next batch
                more.append(item)
                size += len(item[0])
            if not waited:
                batch += more
                break
        return batch

    async def _relay(self, session: _Session, batch: list[tuple[bytes, Any]]) -> list[bytes]:
        """Send one batch to the session's runtime; its responses, in order."""
        answers: list[bytes | None] = [None] * len(batch)
        sent: list[bytes] = []
        kinds: list[str] = []
        buffers: dict[int, _Stored] = {}
        refused: dict[int, str] = {}
        executes = compiles = 0
        for i, (data, request) in enumerate(batch):
            kind = request.WhichOneof("request") if request is not None else None
            if request is None or kind is None:
                answers[i] = _error_response(
                    request.request_metadata.op_id if request is not None else 0,
                    3, "the request is not an IfrtRequest jitserve can read"
                    if request is None else "the request names no operation")
                self.metrics.ifrt_requests.labels("garbled", "INVALID_ARGUMENT").inc()
                continue
            named = _host_buffers_named(request, kind)
            for handle in named:
                await self._wait_for_buffer(session, handle)
            if any(h in session.held_back for h in named):
                if i:  # the requests before it go, and their buffers make room for its store
                    session.carry = batch[i:]
                    answers = answers[:i]
                    break
                # Nothing before it: what is held waits for requests after it (or for none),
                # so its stores come past the bound (by this one request's buffers at most).
                session.admitted.update(h for h in named if h in session.held_back)
                session.freed()
                for handle in named:
                    while handle in session.held_back:  # until its store goes on (or ends)
                        await session.room.wait()
                    # Then for its bytes, as for any store: a bounded wait, since a store
                    # let through may still stall or be cancelled.
                    await self._wait_for_buffer(session, handle)
            for handle in named:
                stored = session.host_in.pop(handle, None)
                session.arrived.pop(handle, None)
                if stored is not None:
                    session.held -= stored.size
                    buffers[handle] = stored
                elif handle in session.refused:
                    refused[handle] = session.refused.pop(handle)
            executes += kind == "loaded_executable_execute_request"
            compiles += kind == "compile_request"
            sent.append(data)
            kinds.append(kind)
        if buffers:
            session.freed()
        if sent:
            self.metrics.ifrt_batch_requests.observe(len(sent))
            responses, host, compiled = await self._to_runtime(session, sent, buffers, refused,
                                                               executes, compiles)
            for each in compiled:
                self._compiled(session, each)
            for handle, desc in host.items():
                session.host_out[int(handle)] = desc
                session.held += len(desc.get("data", b""))
                session.event(-int(handle)).set()
            it = iter(responses)
            for i, answer in enumerate(answers):
                if answer is None:
                    answers[i] = next(it)
            for kind, response in zip(kinds, responses):
                self.metrics.ifrt_requests.labels(kind.removesuffix("_request"),
                                                  _status_of(response)).inc()
        session.requests += len(answers)
        return [a for a in answers if a is not None]

    async def _wait_for_buffer(self, session: _Session, handle: int) -> bool:
        """Wait until host buffer ``handle`` is here, or for at most
        ``JITSERVE_IFRT_HOST_BUFFER_WAIT_S``; whether it had to."""
        if handle in session.host_in or handle in session.refused or handle in session.held_back:
            return False
        session.awaited.add(handle)
        try:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(session.event(handle).wait(),
                                       self.settings.ifrt_host_buffer_wait_s)
        finally:
            session.awaited.discard(handle)
        return True

    async def _to_runtime(self, session: _Session, requests: list[bytes],
                          buffers: dict[int, _Stored], refused: dict[int, str], executes: int,
                          compiles: int) -> tuple[list[bytes], dict[int, Any], list[IfrtCompiled]]:
        settings = self.settings
        timeout = (executes * settings.execution_timeout_s + compiles * settings.lookup_timeout_s
                   or settings.decode_timeout_s)
        try:
            message: dict[str, Any] = {"session": session.id, "owner": session.owner,
                                       "scope": scope_of(session.owner, scoped=settings.auth_enabled,
                                                         shared=settings.tenant_share_executables),
                                       "requests": requests,
                                       "buffers": {h: b.desc() for h, b in buffers.items()},
                                       "refused": refused,
                                       "host": {"held": session.held,
                                                "max": settings.ifrt_max_host_bytes},
                                       "max_run_bytes": settings.execution_bytes_limit}
            if self.quotas is not None:
                futures = self.futures
                quotas = dict(self.quotas)
                if futures is not None:
                    quotas["v1_device_bytes"] = futures.device_bytes_of(session.owner)
                    quotas["v1_futures"] = futures.live_of(session.owner)
                if self.tenants is not None:
                    quotas["v1_compiles"] = self.tenants.compiles.count(session.owner)
                message["quotas"] = quotas
            reply = await session.runtime.request(Op.IFRT, message, timeout_s=timeout)
        except RuntimeLost as e:
            raise self._lost(session, e) from None
        except RemoteError as e:
            code = (grpc.StatusCode.RESOURCE_EXHAUSTED if e.code == "out_of_memory"
                    else grpc.StatusCode.INTERNAL)
            raise _SessionEnded(code, f"jitserve's runtime refused the batch: {e}",
                                "refused") from None
        finally:  # the runtime has copied what it kept (or is gone)
            for stored in buffers.values():
                if stored.segment is not None:
                    self.runtimes.segments.give_back(stored.segment)
        generation = reply.get("generation")
        if session.generation is None:
            session.generation = generation
        elif generation != session.generation:
            # Said as a batch in flight when it died hears it (``_lost``): whichever
            # batch finds out first, the client reads the same cause.
            raise _SessionEnded(grpc.StatusCode.UNAVAILABLE, (
                f"jitserve's runtime {session.runtime.index} was lost and restarted "
                f"({session.runtime.last_exit or 'it exited'}): this session's arrays and "
                "executables are gone; open a new session"), "runtime_lost")
        moved = sum(b.size for b in buffers.values())
        session.bytes_in += moved
        if session.ended is None:  # a closed session holds nothing any more
            self._holds(session, int(reply.get("device_bytes", 0)), int(reply.get("arrays", 0)))
        self.metrics.ifrt_bytes.labels("in").inc(moved)
        return list(reply["responses"]), dict(reply.get("host", {})), list(reply.get("compiles", ()))

    def _compiled(self, session: _Session, found: IfrtCompiled) -> None:
        """Count a compile of the session by its tier; one that memory did not answer is
        logged as /v1's are (one line per compile or load) and kept for the console."""
        tier, reasons = found["tier"], found["recompiled_because"]
        session.compiles[tier] = session.compiles.get(tier, 0) + 1
        self.metrics.ifrt_compiles.labels(tier).inc()
        if tier == "compiled" and session.owner:
            self.compiled_at[session.owner].append(time.monotonic())
        if tier == "memory":  # this runtime had it loaded: nothing to see
            return
        record = CompileRecord(time.time(), session.owner or None, found["program_id"],
                               found["name"], found["signature"], tier, found["seconds"],
                               tuple(reasons) if reasons else None, found["executable_id"])
        record.log(f" (IFRT session {session.id:016x})", session=f"{session.id:016x}")
        if self.console is not None:
            self.console.compiled(record)

    def _lost(self, session: _Session, e: RuntimeLost) -> _SessionEnded:
        if e.code == "execution_timeout":
            return _SessionEnded(grpc.StatusCode.DEADLINE_EXCEEDED, (
                f"an execution passed its deadline of {self.settings.execution_timeout_s:g} s "
                f"(JITSERVE_EXECUTION_TIMEOUT_S): jitserve stopped runtime "
                f"{session.runtime.index}, and this session's arrays and executables are gone"),
                "execution_timeout")
        return _SessionEnded(grpc.StatusCode.UNAVAILABLE, (
            f"jitserve's runtime {session.runtime.index} was lost ({e}): this session's arrays "
            "and executables are gone; open a new session"), "runtime_lost")

    async def _close(self, session: _Session, reason: str, detail: str) -> None:
        """End ``session``: it holds nothing from now on, and its runtime drops all it held.
        The runtime's part goes on if the handler is cancelled meanwhile (its client went
        away while it closed): a close that never reached the runtime would leak there."""
        if self.sessions.pop(session.id, None) is None:
            return
        session.ended, session.ended_because = reason, detail
        self._holds(session, 0, 0)
        self.metrics.ifrt_sessions.dec()
        self.metrics.ifrt_sessions_closed.labels(reason).inc()
        closing = asyncio.ensure_future(self._release(session, reason, detail))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
        await asyncio.shield(closing)

    async def _release(self, session: _Session, reason: str, detail: str) -> None:
        """Tell ``session``'s runtime to drop it, and log what it used."""
        used: dict[str, Any] = {}
        if session.generation is not None and session.runtime.generation == session.generation:
            with contextlib.suppress(RemoteError):
                used = await session.runtime.request(Op.IFRT_CLOSE, {"session": session.id},
                                                     timeout_s=self.settings.decode_timeout_s)
        seconds = time.monotonic() - session.opened
        log.info("IFRT session %016x closed (%s%s) after %.1f s: %d requests, %d compiles %s, "
                 "%d executes, %d bytes in, %d bytes out", session.id, reason,
                 f": {detail}" if detail else "", seconds, session.requests,
                 sum(session.compiles.values()), session.compiles, used.get("executes", 0),
                 session.bytes_in, session.bytes_out,
                 extra={"fields": {"ifrt_session": f"{session.id:016x}", "reason": reason,
                                   "seconds": round(seconds, 3), "requests": session.requests,
                                   "compiles": session.compiles,
                                   "executes": used.get("executes", 0),
                                   "bytes_in": session.bytes_in, "bytes_out": session.bytes_out,
                                   "owner": session.owner[:12]}})

    # -- host buffers ----------------------------------------------------------------

    async def host_buffer_store(self, chunks: AsyncIterator[bytes],
                                context: grpc.aio.ServicerContext) -> bytes:
        metadata = dict(context.invocation_metadata() or ())
        try:
            meta = message(_P + "GrpcHostBufferStoreMetadata").FromString(metadata[STORE_METADATA])
        except Exception:  # noqa: BLE001 - missing or garbage
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"a host buffer store needs its {STORE_METADATA} metadata")
        session = await self._session_of(meta.session_id, context)
        if meta.buffer_size < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"host buffer {meta.handle} announces {meta.buffer_size} bytes")
        limit = self.settings.max_body_bytes
        over = None
        if meta.buffer_size > limit:
            over = (f"a host buffer of {meta.buffer_size:,} bytes is over this server's limit of "
                    f"{limit:,} (JITSERVE_MAX_BODY_BYTES)")
        elif meta.buffer_size > self.settings.ifrt_max_host_bytes:
            over = (f"a host buffer of {meta.buffer_size:,} bytes is over this session's limit "
                    f"of {self.settings.ifrt_max_host_bytes:,} (JITSERVE_IFRT_MAX_HOST_BYTES)")
        elif not await self._room_to_receive(session, meta.handle, meta.buffer_size):
            over = (f"host buffer {meta.handle} ({meta.buffer_size:,} bytes) waited "
                    f"{self.settings.ifrt_host_buffer_wait_s:g} s (JITSERVE_IFRT_HOST_BUFFER_WAIT_S) "
                    f"for room under JITSERVE_IFRT_MAX_HOST_BYTES "
                    f"({self.settings.ifrt_max_host_bytes:,}): this session holds "
                    f"{session.held:,} bytes of host buffers no request has used yet, and "
                    f"{session.incoming:,} more are on their way")
        if over is not None:
            # Read and dropped, and the refusal kept for the request that names it: jaxlib's
            # client gives the whole session up on a failed upload (and then aborts the
            # program at its next device_put), where a failed request is an error the
            # program reads on the array.
            await self._receive(meta.handle, meta.buffer_size, chunks, context, keep=False)
            if session.ended is None:
                session.refused[meta.handle] = over
                session.event(meta.handle).set()
            return b""
        session.incoming += meta.buffer_size  # on its way: counted by _room_to_receive
        try:
            stored = await self._receive(meta.handle, meta.buffer_size, chunks, context)
        except SharedMemoryFull as e:  # the server's configuration: refused as over a limit
            log.warning("IFRT session %016x: %s", session.id, e)
            await self._receive(meta.handle, meta.buffer_size, chunks, context, keep=False)
            if session.ended is None:
                session.refused[meta.handle] = f"host buffer {meta.handle}: {e}"
                session.event(meta.handle).set()
            return b""
        finally:
            session.incoming -= meta.buffer_size
            session.freed()
        if session.ended is None:
            replaced = session.host_in.pop(meta.handle, None)  # stored again before its use
            if replaced is not None:
                session.held -= replaced.size
                session.freed()
                if replaced.segment is not None:
                    self.runtimes.segments.give_back(replaced.segment)
            session.host_in[meta.handle] = stored
            session.held += stored.size
            session.event(meta.handle).set()
        elif stored.segment is not None:
            self.runtimes.segments.give_back(stored.segment)
        return b""

    async def _room_to_receive(self, session: _Session, handle: int, size: int) -> bool:
        """Wait until ``size`` more bytes of stores on their way fit under the session's
        ``JITSERVE_IFRT_MAX_HOST_BYTES``, for at most ``JITSERVE_IFRT_HOST_BUFFER_WAIT_S``;
        whether they do. A store takes its whole segment when it starts, so stores that
        come slowly (each bounded only between its chunks) would otherwise take the
        host's shared memory; held back, they wait for the others to arrive, which never
        waits for a request to use them (a program's burst of ``device_put``s goes on)."""
        limit = self.settings.ifrt_max_host_bytes

        def fits() -> bool:
            return (session.held + size <= limit and session.incoming + size <= limit
                    or handle in session.admitted)

        if fits():
            return True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.ifrt_host_buffer_wait_s
        session.held_back.add(handle)
        waiting = session.arrived.pop(handle, None)
        if waiting is not None:  # a batch waits for this buffer: it goes without the request
            waiting.set()
        try:
            while not fits() and session.ended is None:
                left = deadline - loop.time()
                if left <= 0:
                    return False
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(session.room.wait(), left)
            return session.ended is None
        finally:
            session.held_back.discard(handle)
            session.admitted.discard(handle)
            session.freed()  # wakes a batch waiting for it to leave held_back (``_relay``)

    async def _receive(self, handle: int, size: int, chunks: AsyncIterator[bytes],
                       context: grpc.aio.ServicerContext, keep: bool = True) -> _Stored:
        """A host buffer of ``size`` bytes from its chunks, written where it will be read
        (``keep=False``: read, its length checked, and dropped)."""
        stored = _Stored(size)
        if not keep:
            target = memoryview(bytearray(0))
        elif size >= frames.INLINE_MAX_BYTES:
            stored.segment = self.runtimes.segments.take(size)
            target = memoryview(stored.segment.map)
        else:
            target = memoryview(bytearray(size))
        offset = 0
        wait_s = self.settings.body_timeout_s
        loop = asyncio.get_running_loop()
        try:
            try:  # a store whose chunks stop coming would hold its segment for ever
                async with asyncio.timeout(wait_s) as idle:
                    async for chunk in chunks:
                        idle.reschedule(loop.time() + wait_s)
                        piece = _chunk_data(chunk)
                        if offset + len(piece) > size:
                            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, (
                                f"host buffer {handle} is longer than the {size} bytes its "
                                "metadata announced"))
                        if keep:
                            target[offset:offset + len(piece)] = piece
                        offset += len(piece)
            except TimeoutError:
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, (
                    f"no bytes of host buffer {handle} came for {wait_s:g} s "
                    f"(JITSERVE_BODY_TIMEOUT_S), {offset:,} of its {size:,}; send a host "
                    "buffer without pauses"))
            if offset != size:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, (
                    f"host buffer {handle} has {offset} bytes, not the {size} its metadata "
                    "announced"))
        except BaseException:
            if stored.segment is not None:
                self.runtimes.segments.give_back(stored.segment)
            raise
        if stored.segment is None:
            stored.data = bytes(target)
        return stored

    async def host_buffer_lookup(self, data: bytes,
                                 context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        request = await self._parse("GrpcHostBufferLookupRequest", data, context)
        session = await self._session_of(request.session_id, context)
        if session.ended is not None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, session.ended_because)
        handle = int(request.handle)
        if handle not in session.host_out:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(session.event(-handle).wait(),
                                       self.settings.ifrt_host_buffer_wait_s)
        desc = session.host_out.pop(handle, None)
        session.arrived.pop(-handle, None)
        if desc is not None and "data" in desc:
            session.held -= len(desc["data"])
            session.freed()
        if desc is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no host buffer {handle} in this session")
        if "nbytes" not in desc:  # small: it came with the batch's answer
            small = memoryview(frames.unpack_arrays([desc])[0].reshape(-1).view(np.uint8).data)
            for chunk in self._chunks(session, small):
                yield chunk
            return
        size = int(desc["nbytes"])
        try:
            segment = self.runtimes.segments.take(size)
        except SharedMemoryFull as e:
            log.warning("IFRT session %016x: %s", session.id, e)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"host buffer {handle} could not be read: {e}")
        try:
            try:
                reply = await session.runtime.request(Op.IFRT_READ, {
                    "session": session.id, "handle": handle,
                    "into": {"shm": segment.name, "offsets": [0]}},
                    timeout_s=self.settings.decode_timeout_s)
            except RemoteError as e:
                if e.code == "out_of_memory":  # the runtime could not map the segment
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                        f"host buffer {handle} could not be read: {e}")
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"host buffer {handle} is gone: {e}")
            if [d.get("shm") for d in reply["arrays"]] != [segment.name]:
                await context.abort(grpc.StatusCode.INTERNAL, "a runtime answered a read elsewhere")
            for chunk in self._chunks(session, memoryview(segment.map)[:size]):
                yield chunk
        finally:
            self.runtimes.segments.give_back(segment)

    def _chunks(self, session: _Session, data: memoryview) -> Iterator[bytes]:
        """``data`` as ``GrpcHostBufferLookupResponse`` messages of ``_CHUNK`` bytes, each
        written out by hand: one copy of the bytes, not protobuf's two."""
        session.bytes_out += len(data)
        self.metrics.ifrt_bytes.labels("out").inc(len(data))
        if not len(data):
            yield b""
        for start in range(0, len(data), _CHUNK):
            piece = data[start:start + _CHUNK]
            yield b"".join((b"\x0a", _varint(len(piece)), piece))

    async def host_buffer_delete(self, data: bytes, context: grpc.aio.ServicerContext) -> bytes:
        request = await self._parse("GrpcHostBufferDeleteRequest", data, context)
        session = await self._session_of(request.session_id, context)
        stored = session.host_in.pop(request.handle, None)
        made = session.host_out.pop(request.handle, None)
        session.held -= (stored.size if stored else 0) + len((made or {}).get("data", b""))
        session.freed()
        if stored is not None and stored.segment is not None:
            self.runtimes.segments.give_back(stored.segment)
        return bytes(message(_P + "GrpcHostBufferDeleteResponse")().SerializeToString())

    async def _session_of(self, session_id: int, context: grpc.aio.ServicerContext) -> _Session:
        """An open session, or an ended one whose stream still answers (``ended``)."""
        session = self.sessions.get(session_id) or self.ended.get(session_id)
        if session is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no IFRT session {session_id:x} is open")
        assert session is not None
        return session

    @staticmethod
    async def _parse(name: str, data: bytes, context: grpc.aio.ServicerContext) -> Any:
        try:
            return message(_P + name).FromString(data)
        except Exception:  # noqa: BLE001 - protobuf's DecodeError
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a {name}")


def _awaited_first(responses: list[bytes]) -> list[bytes]:
    """A batch's responses to write, the last request's first. A client thread that waits
    for an answer sends nothing more until it has it, so a batch's last request is the
    one a waiting client most likely waits for (reading a loss: its
    ``copy_to_host_buffer``, behind the step's arrays and execute, whose answers the
    client takes as they come). Each answer written costs grpc's Python server a turn,
    a fifth of a millisecond here: this one first, the client goes on a millisecond
    sooner. jaxlib's client matches answers by ``op_id``, as the reference server's,
    which answers each request when its work is done, needs."""
    return [responses[-1], *responses[:-1]] if len(responses) > 1 else responses


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if not value:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def _chunk_data(chunk: bytes) -> memoryview:
    """The ``data`` of a ``GrpcHostBufferStoreRequest`` without copying it: its one field,
    read by hand where the message is just that field (as the client sends it)."""
    if chunk[:1] == b"\x0a":
        length, start, shift = 0, 1, 0
        while start < len(chunk) and shift < 64:
            byte = chunk[start]
            length |= (byte & 0x7F) << shift
            start += 1
            shift += 7
            if not byte & 0x80:
                if start + length == len(chunk):
                    return memoryview(chunk)[start:]
                break
    return memoryview(message(_P + "GrpcHostBufferStoreRequest").FromString(chunk).data)


def _host_buffers_named(request: Any, kind: str) -> list[int]:
    """The host buffers a request reads (they must be here before it goes)."""
    body = getattr(request, kind)
    if kind == "make_array_from_host_buffer_request":
        return [int(body.host_buffer_handle)]
    if kind == "make_arrays_from_host_buffer_shards_request":
        return [int(b.host_buffer_handle) for spec in body.specs for b in spec.host_buffers]
    return []


# jaxlib's client (0.10.2 to 0.11.2) aborts the user's process when a
# ``get_default_layout`` is answered with an error: it reads the answer's value
# without looking at its status. A program that makes an array (``device_put``) and
# uses it asks for its layout; if its session ends in between (its runtime lost),
# that layout is refused with the rest, and the program died of SIGABRT instead of
# raising. So an ended session answers it anyway: with the descending layout, the
# CPU and GPU clients' default for every dtype and rank (``{1,0}`` for a matrix,
# ``{}`` for a scalar). Nothing runs with it: every request after it fails with the
# reason the session ended, which the program then raises.
_LAYOUT = "get_default_layout_request"


def _refusal(request: Any, e: _SessionEnded) -> bytes:
    """The answer of an ended session to ``request``: the reason it ended (a layout
    excepted: ``_LAYOUT``)."""
    if request.WhichOneof("request") == _LAYOUT:
        return _layout_response(request)
    return _error_response(request.request_metadata.op_id, e.code.value[0], str(e))


def _layout_response(request: Any) -> bytes:
    response = message(_P + "IfrtResponse")()
    response.response_metadata.op_id = request.request_metadata.op_id
    rank = len(request.get_default_layout_request.dims)
    response.get_default_layout_response.serialized_pjrt_layout = (
        "{" + ",".join(str(d) for d in reversed(range(rank))) + "}").encode()
    return bytes(response.SerializeToString())


def _error_response(op_id: int, code: int, text: str) -> bytes:
    response = message(_P + "IfrtResponse")()
    response.response_metadata.op_id = op_id
    response.response_metadata.status.code = code
    response.response_metadata.status.message = text
    return bytes(response.SerializeToString())


def _status_of(data: bytes) -> str:
    """The status code name of a serialized response, for the metrics."""
    response = message(_P + "IfrtResponse").FromString(data)
    code = response.response_metadata.status.code
    return grpc.StatusCode.OK.name if code == 0 else next(
        (s.name for s in grpc.StatusCode if s.value[0] == code), str(code))


async def start(settings: Settings, runtimes: RuntimePool, metrics: Metrics,
                console: Console | None = None, futures: FutureStore | None = None,
                tenants: Tenants | None = None) -> tuple[grpc.aio.Server, IfrtService]:
    """A started IFRT proxy server on ``settings.host``:``settings.ifrt_port``
    (``console``: where its compiles are kept for ``/console``; ``futures`` and
    ``tenants``: /v1's futures and compile budgets, whose keys' quotas its sessions share)."""
    service = IfrtService(settings, runtimes, metrics, console, futures, tenants)
    server = grpc.aio.server(options=[
        ("grpc.max_receive_message_length", min(settings.max_body_bytes + (1 << 20), 2**31 - 1)),
        ("grpc.max_send_message_length", -1),
        ("grpc.so_reuseport", 0),  # a stale server on the port is an error, not a split
        # Host buffers are hundreds of MiB: let the client send them in big HTTP/2 frames
        # (the default is 16 KiB), and start with big flow-control windows.
        ("grpc.http2.max_frame_size", (1 << 24) - 1),
        ("grpc.http2.bdp_probe", 1),
    ])

    def raw(kind: str, fn: Any) -> grpc.RpcMethodHandler:
        return getattr(grpc, kind)(fn, request_deserializer=None, response_serializer=None)

    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
        "GetVersion": raw("unary_unary_rpc_method_handler", service.get_version),
        "IfrtSession": raw("stream_stream_rpc_method_handler", service.session),
        "HostBufferStore": raw("stream_unary_rpc_method_handler", service.host_buffer_store),
        "HostBufferLookup": raw("unary_stream_rpc_method_handler", service.host_buffer_lookup),
        "HostBufferDelete": raw("unary_unary_rpc_method_handler", service.host_buffer_delete),
    })])
    address = f"{settings.host}:{settings.ifrt_port}"
    if settings.ifrt_tls_cert is not None and settings.ifrt_tls_key is not None:
        credentials = grpc.ssl_server_credentials(
            [(settings.ifrt_tls_key.read_bytes(), settings.ifrt_tls_cert.read_bytes())])
        port = server.add_secure_port(address, credentials)
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise RuntimeError(f"cannot listen for the IFRT proxy on {address} (JITSERVE_IFRT_PORT)")
    await server.start()
    service.port = port  # type: ignore[attr-defined]
    tls = settings.ifrt_tls_cert is not None
    log.info("IFRT proxy (unmodified JAX programs) on %s:%d (%s)", settings.host, port,
             "TLS" if tls else "plaintext", extra={"fields": {"ifrt_port": port, "tls": tls}})
    return server, service
