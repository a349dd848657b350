"""Forwarding: requests sent on to the replica that holds their futures.

A future's id starts with its replica's id (``<replica>.<token>``), so any
replica knows where its data is without asking. A request for another replica's
future is answered from the metadata (status, long-poll: ``mirror``, ``watch``)
or *forwarded* to that replica (result, delete, release, and an execute whose
inputs live there, which then runs there: data moves only when one call reads
futures of two replicas, and then one output at a time, ``Relay.pull``).

Forwarded requests are signed (``signing``) and travel on kept-alive connections
of ``peers``' client. A replica that does not answer is looked up in Redis: gone,
the request fails ``replica_lost``; still there, ``unavailable``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.parse
from collections.abc import AsyncIterator, Sequence
from typing import Any

import numpy as np
from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from jitserve import wire
from jitserve.wire import REPLICA_HEADER, ErrorCode, replica_of

from ..errors import ServiceError, Unavailable
from ..metrics import Metrics
from .membership import Membership, ReplicaLost, replica_lost
from .mirror import Mirror
from .peers import PeerClient, PeerError, PeerResponse
from .signing import OWNER_HEADER, PEER_HEADER, TO_HEADER, Signing, scope_path

__all__ = ["PeerRefusal", "Relay"]

# Answers up to this size are read whole; bigger ones stream through.
_WHOLE_BYTES = 1 << 20
_PASSED_HEADERS = ("content-type", "content-length", "retry-after", "www-authenticate")
_RELAYED = (b"accept", b"content-type")


class PeerRefusal(ServiceError):
    """Another replica's refusal, passed on with its code.

    (``peers.PeerError`` is the other failure of a hop: the peer did not answer
    properly at all.)
    """

    def __init__(self, code: ErrorCode, message: str, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.code = code


class Relay:
    """Requests to the other replicas, and the answers they give.

    Args:
      membership: where the other replicas are, and which are lost.
      signing: the signatures of the requests sent.
      mirror: the futures' metadata (whether a lost replica's future was the caller's).
      http: the connections to the other replicas.
      metrics: where bytes moved between replicas are counted.
    """

    def __init__(self, membership: Membership, signing: Signing, mirror: Mirror[Any],
                 http: PeerClient, metrics: Metrics) -> None:
        self._membership = membership
        self._signing = signing
        self._mirror = mirror
        self._http = http
        self._peer_in = metrics.peer_bytes_total.labels("in")
        self._peer_out = metrics.peer_bytes_total.labels("out")

    # -- one request -----------------------------------------------------------------

    async def request(self, rid: str, method: str, path: str, owner: str | None, *,
                      query: str = "", raw_path: str | None = None,
                      content: bytes | None = None, headers: dict[str, str] | None = None,
                      wait_s: float = 0.0) -> PeerResponse:
        """Send a request to replica ``rid`` as ``owner``; its answer, whose body the
        caller reads (``read``) or streams, and then releases.

        ``path`` is the path as the peer will read it (and checks the signature of);
        ``raw_path`` and ``query``, when given, are sent as they came (percent-encoded).
        ``ReplicaLost`` when ``rid`` is gone (before, or by the time it fails to answer).
        """
        peer = await self._membership.peer(rid)
        sent = {**headers} if headers else {}
        sent[PEER_HEADER] = self._signing.sign(method, path, owner)
        sent[OWNER_HEADER] = owner or ""
        sent[TO_HEADER] = rid
        if content:
            self._peer_out.inc(len(content))
        try:
            response = await self._http.request(method, peer.url, _target(path, query, raw_path),
                                                sent, content, read_s=30.0 + wait_s)
        except (PeerError, TimeoutError) as e:
            raise await self._not_there(rid, f"replica {rid} at {peer.url} did not answer: "
                                             f"{type(e).__name__}") from None
        answered = response.headers.get(REPLICA_HEADER)
        if answered is not None and answered != rid:
            # Another process answers at its address (it refused the request): rid is
            # not there, as if it did not answer.
            response.release()
            raise await self._not_there(rid, f"replica {rid} is not at {peer.url}: replica "
                                             f"{answered} answers there")
        return response

    async def _not_there(self, rid: str, why: str) -> ServiceError:
        """Replica ``rid`` did not answer: ``ReplicaLost`` if it is gone, else
        ``Unavailable`` saying ``why``."""
        if await self._membership.gone(rid):
            return replica_lost(rid)
        return Unavailable(why)

    @contextlib.asynccontextmanager
    async def forward(self, rid: str, method: str, path: str, owner: str | None, *,
                      params: dict[str, str] | None = None, content: bytes | None = None,
                      headers: dict[str, str] | None = None,
                      wait_s: float = 0.0) -> AsyncIterator[PeerResponse]:
        """``request`` as a context that releases the answer; ``params`` makes the query."""
        response = await self.request(rid, method, path, owner,
                                      query=urllib.parse.urlencode(params or {}),
                                      content=content, headers=headers, wait_s=wait_s)
        try:
            yield response
        finally:
            response.release()

    async def read(self, rid: str, response: PeerResponse) -> bytes:
        """The whole body of ``forward``'s answer, counted; ``Unavailable`` (or
        ``ReplicaLost``) when the peer stops sending it."""
        try:
            body = await response.read()
        except (PeerError, TimeoutError) as e:
            raise await self._not_there(rid, f"replica {rid} broke off its answer: "
                                             f"{type(e).__name__}") from None
        self._peer_in.inc(len(body))
        return body

    # -- what the routes do for another replica's futures ------------------------------

    async def answer_from(self, rid: str, request: Request, owner: str | None, *,
                          content: bytes | None = None, wait_s: float = 0.0) -> Response:
        """Forward ``request`` (its method, path, query, and ``content`` as its body) to
        replica ``rid``, and answer what it answers, streamed when it is big."""
        scope = request.scope
        headers = {k.decode(): v.decode("latin-1") for k, v in scope["headers"] if k in _RELAYED}
        raw_path = scope.get("raw_path")
        peer_response = await self.request(
            rid, scope["method"], scope_path(scope), owner,
            query=scope["query_string"].decode("latin-1"),
            raw_path=raw_path.decode("latin-1") if raw_path else None, content=content,
            headers=headers, wait_s=wait_s)
        try:
            passed = {k: v for k in _PASSED_HEADERS if (v := peer_response.headers.get(k))}
            size = int(passed.get("content-length", -1))
            if 0 <= size <= _WHOLE_BYTES:
                body = await self.read(rid, peer_response)
                peer_response.release()  # its connection serves the next request
                return Response(body, peer_response.status, headers=passed)
        except BaseException:
            peer_response.release()
            raise
        peer_in = self._peer_in

        async def stream() -> Any:
            try:
                async for chunk in peer_response.chunks():
                    peer_in.inc(len(chunk))
                    yield chunk
            finally:
                peer_response.release()

        return StreamingResponse(stream(), peer_response.status, headers=passed)

    def donated_elsewhere(self, args: Sequence[Any], donate: Sequence[Any]
                          ) -> dict[str, list[tuple[str, int]]]:
        """The other replicas' outputs among ``args`` that a call donates, by replica:
        it reads copies pulled here, and they are released on their replicas once it
        is accepted (``release``), as a donated input held here is (taken before the
        pull replaces the references; a ``donate`` out of range is the call's to refuse)."""
        given: dict[str, list[tuple[str, int]]] = {}
        for i in {i for i in donate if type(i) is int and 0 <= i < len(args)}:
            arg = args[i]
            rid = self._membership.elsewhere(str(arg["future"])) if wire.is_future_ref(arg) else None
            if rid is not None:
                given.setdefault(rid, []).append((str(arg["future"]), int(arg["output"])))
        return given

    async def release(self, refs: dict[str, list[tuple[str, int]]],
                      owner: str | None) -> tuple[int, int]:
        """Release other replicas' outputs, ``refs`` by replica (``POST /v1/futures/release``
        at each, at once); ``(released, unknown)`` summed. A lost replica's outputs are
        gone already: they count as unknown."""
        counts = await asyncio.gather(*(self._release_at(rid, group, owner)
                                        for rid, group in refs.items()))
        return sum(r for r, _ in counts), sum(u for _, u in counts)

    async def _release_at(self, rid: str, refs: list[tuple[str, int]],
                          owner: str | None) -> tuple[int, int]:
        body = json.dumps({"outputs": [{"future": f, "output": k} for f, k in refs]}).encode()
        try:
            async with self.forward(rid, "POST", "/v1/futures/release", owner, content=body,
                                    headers={"content-type": "application/json"}) as answer:
                raw = await self.read(rid, answer)
        except ReplicaLost:
            return 0, len(refs)
        try:
            doc = json.loads(raw)
            return int(doc["released"]), int(doc["unknown"])
        except (ValueError, KeyError, TypeError):
            raise Unavailable(f"replica {rid} answered a release with {answer.status}, "
                              "not with its counts") from None

    async def run_elsewhere(self, request: Request, args: list[Any], owner: str | None,
                            body: bytes | bytearray, *, wait_s: float, pull_wait_s: float,
                            forwarded: bool) -> Response | None:
        """Where an execute runs when its inputs are other replicas' futures.

        The whole call (``body``, as it came) is relayed to the replica holding most of
        its inputs, and its answer is that replica's: unless this one holds as many,
        that one drains, or ``forwarded`` (another replica sent the call here: it runs
        here). Otherwise the inputs other replicas hold are fetched into ``args``
        (waiting up to ``pull_wait_s`` for each), and ``None`` says: run it here.
        """
        relayed = await self.to_holder(request, args, owner, body, wait_s=wait_s,
                                       forwarded=forwarded)
        if relayed is not None:
            return relayed
        for i, arg in enumerate(args):
            if wire.is_future_ref(arg) and self._membership.elsewhere(str(arg["future"])):
                args[i] = await self.pull(arg, owner, pull_wait_s)
        return None

    async def to_holder(self, request: Request, args: list[Any], owner: str | None,
                        body: bytes | bytearray, *, wait_s: float,
                        forwarded: bool) -> Response | None:
        """The answer of the replica holding most of the future references in ``args``,
        ``request`` (with ``body``) relayed to it; ``None``: it runs here (see
        ``run_elsewhere``; ``POST /v1/calls`` relays a batch by all its calls' args)."""
        if not forwarded and (holder := self._holder(args)) is not None:
            with contextlib.suppress(ReplicaLost):  # gone: the call fails here, naming its input
                return await self.answer_from(holder, request, owner, content=bytes(body),
                                              wait_s=wait_s)
        return None

    def _holder(self, args: list[Any]) -> str | None:
        """The replica a call should run on: the one holding most of its input futures,
        unless that is this one, or it drains (then the inputs come here)."""
        held = wire.replicas_of(str(a["future"]) for a in args if wire.is_future_ref(a))
        if not held:
            return None
        rid, count = held.most_common(1)[0]
        me = self._membership.replica_id
        if rid == me or held[me] >= count or self._membership.peer_draining(rid):
            return None
        return rid

    async def pull(self, ref: dict[str, Any], owner: str | None, wait_s: float) -> np.ndarray:
        """Output ``ref["output"]`` of another replica's future ``ref["future"]``, fetched
        from that replica (waiting up to ``wait_s`` for it to be done)."""
        future_id, k = str(ref["future"]), int(ref["output"])
        rid = replica_of(future_id)
        assert rid is not None
        path = f"/v1/futures/{future_id}/result"
        params = {"outputs": str(k), "wait": str(int(wait_s * 1000))}
        try:
            async with self.forward(rid, "GET", path, owner, params=params,
                                    headers={"accept": wire.MSGPACK}, wait_s=wait_s) as answer:
                body = await self.read(rid, answer)
        except ReplicaLost:
            await self._mirror.deny_others(future_id, owner)
            raise
        if answer.status != 200:
            raise _refusal(answer.status, body, future_id)
        outputs = wire.unpackb(body)["outputs"]
        return outputs[0]


def _target(path: str, query: str, raw_path: str | None) -> str:
    """A peer request's target: ``raw_path`` (as the caller sent it) or ``path``
    percent-encoded, and the query as it came."""
    target = raw_path or urllib.parse.quote(path)
    return f"{target}?{query}" if query else target


def _refusal(status: int, body: bytes, future_id: str) -> ServiceError:
    try:
        error = json.loads(body)["error"]
        code = ErrorCode(error["code"])
        return PeerRefusal(code, f"input future {future_id}: {error['message']}",
                           **{k: v for k, v in error.items() if k not in ("code", "message")})
    except (ValueError, KeyError, TypeError):
        return PeerRefusal(ErrorCode.UNAVAILABLE,
                           f"the replica holding input future {future_id} answered {status}")
