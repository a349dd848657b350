"""``/v1/futures``: poll, long-poll, fetch, release and delete array futures."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse

from jitserve.wire import ErrorCode, FutureStatus

from ...calls.futures import Future
from ...cluster import Cluster, ReplicaLost, remote_replica
from ...errors import (
    BadRequest,
    FutureCancelled,
    FutureFailed,
    FuturePending,
    NotFound,
)
from ..bodies import BodyReader, outputs_response, wants_json
from ..deps import (
    AsJSON,
    Body,
    Owner,
    Services,
    ServicesDep,
    WaitSeconds,
    get_body,
    get_owner,
    get_wait_s,
    request_cluster,
    request_owner,
    services_of,
)
from ..openapi import errors, message_body, outputs_content
from ..schemas import (
    DeleteResult,
    FutureRef,
    FutureView,
    ReleaseRequest,
    ReleaseResult,
    parse,
)

__all__ = ["RELEASE_ROUTE", "RESULT_ROUTE", "release", "release_refs", "result", "router"]

router = APIRouter(prefix="/v1/futures", tags=["futures"], dependencies=[Depends(get_owner)],
                   responses=errors(ErrorCode.UNAUTHORIZED, ErrorCode.NOT_FOUND,
                                    ErrorCode.UNAVAILABLE))

OutputsQuery = Annotated[str | None, Query(
    pattern=r"^\d{1,6}(,\d{1,6})*$", max_length=70_000,
    description="comma-separated output indices (e.g. 0,2): only those, in that order")]


@router.post("/release", response_model=ReleaseResult,
             openapi_extra=message_body(ReleaseRequest, ReleaseRequest, required=True),
             responses=errors(ErrorCode.BAD_REQUEST, ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                              ErrorCode.PAYLOAD_TOO_LARGE))
async def release_outputs(request: Request, services: ServicesDep, body: Body,
                          owner: Owner) -> ReleaseResult:
    """Let go of outputs, as a client's arrays are garbage-collected.

    Each output's device memory is freed once no accepted call still has to read
    it; a future whose outputs are all released is gone. Releasing never stops a
    compile or a run (later calls may read its other outputs, or this one).
    References to nothing of the caller's are counted in ``unknown``.
    """
    return await _release(request, services, body, owner)


async def _release(request: Request, services: Services, body: BodyReader,
                   owner: str | None) -> ReleaseResult:
    req = parse(ReleaseRequest, await body.message(), "release request")
    return await release_refs(services, req.outputs, owner)


async def release_refs(services: Services, refs: Sequence[FutureRef],
                       owner: str | None) -> ReleaseResult:
    """Let go of the outputs ``refs`` names, here and on the replicas holding them
    (``POST /v1/futures/release``, and a batch's ``release``, most often empty). A
    request another replica forwarded here releases them where they are too: a
    batch goes to the replica holding its calls' inputs, with the releases it carries
    (they went nowhere but here, and stayed until their futures' TTL)."""
    if not refs:
        return ReleaseResult(released=0, unknown=0)
    cluster = services.cluster
    here: list[tuple[str, int]] = []
    elsewhere: defaultdict[str, list[tuple[str, int]]] = defaultdict(list)
    for r in refs:
        rid = remote_replica(cluster, r.future)
        (here if rid is None else elsewhere[rid]).append((r.future, r.output))
    released, unknown = services.futures.release(here, owner)
    if elsewhere:
        assert cluster is not None
        there, lost = await cluster.relay.release(elsewhere, owner)
        released, unknown = released + there, unknown + lost
    return ReleaseResult(released=released, unknown=unknown)


@router.get("/{future_id}", response_model=FutureView, responses=errors(ErrorCode.BAD_REQUEST))
async def get_future(future_id: str, request: Request, services: ServicesDep, owner: Owner,
                     wait: WaitSeconds) -> Response | FutureView:
    """The future's status; ``?wait=<ms>`` long-polls until the status changes."""
    cluster = request_cluster(request, services)
    if (rid := remote_replica(cluster, future_id)) is not None:
        assert cluster is not None
        try:
            doc = await cluster.watch.wait_change(future_id, owner, None, wait)
        except NotFound:
            # Redis evicts, and may restart empty: its replica may hold it all the same.
            return await _relay(cluster, rid, request, future_id, owner, wait)
        return FutureView.model_validate(doc)
    fut = services.futures.get(future_id, owner)
    if cluster is None and services.cluster is not None:  # forwarded: the sender's Redis
        services.cluster.mirror.changed(fut)  # lost it, so write it again
    if wait and not fut.status.is_final:
        await fut.wait_change(fut.status, wait)
    return FutureView.of(fut)


@router.get("/{future_id}/result",
            responses={200: {"description": "the outputs (msgpack, or JSON on Accept)",
                             "content": outputs_content()},
                       **errors(ErrorCode.BAD_REQUEST, ErrorCode.FUTURE_PENDING,
                                ErrorCode.FUTURE_CANCELLED, ErrorCode.FUTURE_FAILED,
                                ErrorCode.REPLICA_LOST)})
async def get_result(future_id: str, request: Request, services: ServicesDep, owner: Owner,
                     wait: WaitSeconds, as_json: AsJSON,
                     outputs: OutputsQuery = None) -> Response:
    """The outputs of a done future (``?outputs=0,2``: those); ``?wait=<ms>`` waits first."""
    return await _result(request, services, future_id, owner, wait, as_json, outputs)


async def _result(request: Request, services: Services, future_id: str, owner: str | None,
                  wait: float, as_json: bool, outputs: str | None) -> Response:
    cluster = request_cluster(request, services)
    if (rid := remote_replica(cluster, future_id)) is not None:
        return await _relay(cluster, rid, request, future_id, owner, wait)
    fut = services.futures.get(future_id, owner)
    which = None if outputs is None else [int(k) for k in outputs.split(",")]
    for k in which or ():
        if k >= len(fut.out_avals):
            raise BadRequest(f"future {fut.future_id} has {len(fut.out_avals)} outputs; "
                             f"there is no output {k}")
    if wait:
        await fut.wait_final(wait)
    _raise_unless_done(fut)
    return await outputs_response(fut, services.calls, as_json, which)


@router.delete("/{future_id}", response_model=DeleteResult, response_model_exclude_none=True)
async def delete_future(future_id: str, request: Request, services: ServicesDep,
                        owner: Owner) -> Response | DeleteResult:
    """Cancel the future, and free its outputs.

    A running execution is stopped when nothing else runs on its runtime;
    otherwise it runs on (to its end or its deadline), ``detail`` says why, and
    its outputs are dropped when it ends.
    """
    cluster = request_cluster(request, services)
    if (rid := remote_replica(cluster, future_id)) is not None:
        return await _relay(cluster, rid, request, future_id, owner)
    fut = services.futures.get(future_id, owner)
    status, detail = services.futures.delete(fut)
    return DeleteResult(future_id=fut.future_id, status=status.value, detail=detail)


async def _relay(cluster: Cluster | None, rid: str, request: Request, future_id: str,
                 owner: str | None, wait_s: float = 0.0) -> Response:
    """The answer of replica ``rid``, which holds the future; ``ReplicaLost`` (once the
    future is known to be the caller's) when that replica is gone."""
    assert cluster is not None
    try:
        return await cluster.relay.answer_from(rid, request, owner, wait_s=wait_s)
    except ReplicaLost:
        await cluster.mirror.deny_others(future_id, owner)
        raise


def _raise_unless_done(fut: Future) -> None:
    """The error a result request gets for a future that has no outputs to give."""
    error = fut.error or {}
    if fut.removed is not None:
        raise NotFound(f"future {fut.future_id} was {fut.removed}")
    if fut.status is FutureStatus.FAILED:
        raise FutureFailed(error.get("message", "execution failed"), cause=error)
    if fut.status is FutureStatus.CANCELLED:
        raise FutureCancelled(error.get("message", "cancelled"))
    if fut.status is not FutureStatus.DONE:
        raise FuturePending(f"future {fut.future_id} is {fut.status.value}; "
                            "retry later or pass ?wait=<ms>")


# -- the same routes through the lane (service/api/lane.py), which reads their queries --


async def release(request: Request) -> Response:
    """``POST /v1/futures/release``'s work, for the lane."""
    services = services_of(request)
    owner = request_owner(request)
    done = await _release(request, services, await get_body(request, services), owner)
    return JSONResponse(done.model_dump(mode="json"))


async def result(request: Request, future_id: str, wait: int | None,
                 outputs: str | None) -> Response:
    """``GET /v1/futures/{future_id}/result``'s work, for the lane (``wait`` in ms)."""
    services = services_of(request)
    owner = request_owner(request)
    return await _result(request, services, future_id, owner, await get_wait_s(services, wait),
                         wants_json(request), outputs)


RELEASE_ROUTE = next(r for r in router.routes if getattr(r, "endpoint", None) is release_outputs)
RESULT_ROUTE = next(r for r in router.routes if getattr(r, "endpoint", None) is get_result)
