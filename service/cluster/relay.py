"""What the routes do for another replica's futures (``service.cluster``).

``replica_header`` names the replica in every answer (``wire.REPLICA_HEADER``,
``api.announce``), so that a balancer can learn which server holds which
replica's futures.

``relay`` sends the request on to the replica that holds the future and answers
with what it answers, streamed; ``pull`` fetches one output of another replica's
future as an array, for a call that reads futures of two replicas.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from jitserve import wire
from jitserve.wire import ErrorCode

from ..errors import ServiceError
from ._cluster import Cluster, ReplicaLost, replica_of, scope_path

__all__ = ["PeerError", "pull", "relay", "remote_replica", "replica_header"]

# Answers up to this size are read whole; bigger ones stream through.
_WHOLE_BYTES = 1 << 20
_PASSED_HEADERS = ("content-type", "content-length", "retry-after", "www-authenticate")
_REPLICA_HEADER = wire.REPLICA_HEADER.encode()
_RELAYED = (b"accept", b"content-type")


def replica_header(cluster: Cluster) -> tuple[bytes, bytes]:
    """The raw header that names this replica in an answer, as it is named now (a
    replica that rejoins is renamed)."""
    return _REPLICA_HEADER, cluster.replica_id.encode()


class PeerError(ServiceError):
    """Another replica's refusal, passed on with its code."""

    def __init__(self, code: ErrorCode, message: str, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.code = code


def remote_replica(cluster: Cluster | None, future_id: str) -> str | None:
    """The replica holding ``future_id`` when it is another one (and this request may
    be forwarded); ``None`` to serve it here."""
    if cluster is None:
        return None
    rid = replica_of(future_id)
    return rid if rid is not None and rid != cluster.replica_id else None


async def relay(cluster: Cluster, rid: str, request: Request, owner: str | None, *,
                content: bytes | None = None, wait_s: float = 0.0) -> Response:
    """Forward ``request`` (its method, path, query, and ``content`` as its body) to
    replica ``rid``, and answer what it answers."""
    scope = request.scope
    headers = {k.decode(): v.decode("latin-1") for k, v in scope["headers"] if k in _RELAYED}
    raw_path = scope.get("raw_path")
    peer_response = await cluster.request(
        rid, scope["method"], scope_path(scope), owner, query=scope["query_string"].decode("latin-1"),
        raw_path=raw_path.decode("latin-1") if raw_path else None, content=content,
        headers=headers, wait_s=wait_s)
    try:
        passed = {k: v for k in _PASSED_HEADERS if (v := peer_response.headers.get(k))}
        size = int(passed.get("content-length", -1))
        if 0 <= size <= _WHOLE_BYTES:
            body = await cluster.read(rid, peer_response)
            peer_response.release()  # its connection serves the next request
            return Response(body, peer_response.status, headers=passed)
    except BaseException:
        peer_response.release()
        raise

    async def stream() -> Any:
        try:
            async for chunk in peer_response.chunks():
                cluster.received(len(chunk))
                yield chunk
        finally:
            peer_response.release()

    return StreamingResponse(stream(), peer_response.status, headers=passed)


async def pull(cluster: Cluster, ref: dict[str, Any], owner: str | None,
               wait_s: float) -> np.ndarray:
    """Output ``ref["output"]`` of another replica's future ``ref["future"]``, fetched
    from that replica (waiting up to ``wait_s`` for it to be done)."""
    future_id, k = str(ref["future"]), int(ref["output"])
    rid = replica_of(future_id)
    assert rid is not None
    path = f"/v1/futures/{future_id}/result"
    params = {"outputs": str(k), "wait": str(int(wait_s * 1000))}
    try:
        async with cluster.forward(rid, "GET", path, owner, params=params,
                                   headers={"accept": wire.MSGPACK}, wait_s=wait_s) as answer:
            body = await cluster.read(rid, answer)
    except ReplicaLost:
        await cluster.metadata(future_id, owner)  # NotFound if it is none of the caller's
        raise
    if answer.status != 200:
        raise _refusal(answer.status, body, future_id)
    outputs = wire.unpackb(body)["outputs"]
    return outputs[0]


def _refusal(status: int, body: bytes, future_id: str) -> ServiceError:
    try:
        error = json.loads(body)["error"]
        code = ErrorCode(error["code"])
        return PeerError(code, f"input future {future_id}: {error['message']}",
                         **{k: v for k, v in error.items() if k not in ("code", "message")})
    except (ValueError, KeyError, TypeError):
        return PeerError(ErrorCode.UNAVAILABLE,
                         f"the replica holding input future {future_id} answered {status}")
