"""``POST /v1/programs/{id}/execute``: the hot path of a cached call.

FastAPI declares it (its OpenAPI, and the validation of ``?wait``), but the
handler takes what other routes receive as dependencies itself (the app's
``Services``): resolving a dozen dependencies cost as much as the rest of a
cached call (docs/performance.md), and this route is the one every call goes
through. What it does is the same as theirs: ``deps.request_owner``
authenticates (or checks a peer's signature), the body is read by a
``BodyReader`` under the same limits. ``service.api.lane`` hands a well-formed
execute request to ``execute`` before the middleware stack sees it.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse

from jitserve.wire import ErrorCode, FutureStatus

from ...calls.calls import Call
from ...errors import BadRequest
from ..bodies import BodyReader, outputs_response, wants_json
from ..deps import Services, request_cluster, request_owner, services_of
from ..openapi import errors, message_body, outputs_content
from ..schemas import ExecuteAccepted, ExecuteJSON, ExecuteMsgpack, ExecuteRequest, parse

__all__ = ["ROUTE", "execute", "router"]

router = APIRouter(prefix="/v1/programs", tags=["programs"])

_ERRORS = (ErrorCode.UNAUTHORIZED, ErrorCode.BAD_REQUEST, ErrorCode.INVALID_PROGRAM,
           ErrorCode.PAYLOAD_TOO_LARGE, ErrorCode.UNSAFE_PROGRAM, ErrorCode.LIMIT_EXCEEDED,
           ErrorCode.PLATFORM_MISMATCH, ErrorCode.TOO_MANY_REQUESTS, ErrorCode.NOT_FOUND,
           ErrorCode.UNSUPPORTED_MEDIA_TYPE, ErrorCode.SIGNATURE_MISMATCH,
           ErrorCode.COMPILE_FAILED, ErrorCode.COMPILE_TIMEOUT, ErrorCode.COMPILER_ERROR,
           ErrorCode.FUTURE_CANCELLED, ErrorCode.FUTURE_FAILED, ErrorCode.REPLICA_LOST,
           ErrorCode.UNAVAILABLE)


@router.post("/{program_id}/execute", status_code=202, response_model=ExecuteAccepted,
             openapi_extra={**message_body(ExecuteJSON, ExecuteMsgpack, required=True),
                            "security": [{"HTTPBearer": []}]},
             responses={200: {"description": "the outputs, when ?wait was long enough",
                              "content": outputs_content()},
                        **errors(*_ERRORS)})
async def execute_program(
    program_id: str, request: Request,
    wait: Annotated[int | None, Query(ge=0, description="milliseconds to wait for the result")]
    = None,
    keep: Annotated[bool, Query(description=(
        "false: an answer that carries the outputs (200) also deletes the future, so a "
        "caller that only wants the values needs no DELETE; a 202 keeps it"))] = True,
) -> Response:
    """Run the program on arrays or future references; answers with a future.

    With ``?wait=<ms>``, answers ``200`` with the outputs if they are ready in time
    (and with ``keep=false``, forgets the future then).
    With several replicas, a call whose inputs are futures runs where they are.
    """
    return await execute(request, program_id, wait, keep)


async def execute(request: Request, program_id: str, wait: int | None, keep: bool) -> Response:
    """The route's work, for the route and for ``ExecuteLane``."""
    services = services_of(request)
    settings = services.settings
    owner = request_owner(request)
    cluster = services.cluster
    services.drain.check_accepting()
    forwarded = cluster is not None and request_cluster(request, services) is None
    program = await services.programs.get(program_id, owner, vouched=forwarded)
    body = BodyReader(request, settings.max_body_bytes, timeout_s=settings.body_timeout_s,
                      metrics=services.metrics)
    raw, message = await body.raw_message()
    req = parse(ExecuteRequest, _required(message), "execute request")
    wait_s = min(wait or 0, settings.max_wait_ms) / 1000
    given: dict[str, list[tuple[str, int]]] = {}
    if cluster is not None:  # a call on other replicas' futures runs there, or fetches them
        given = cluster.relay.donated_elsewhere(req.args, req.donate)
        relayed = await cluster.relay.run_elsewhere(
            request, req.args, owner, raw, wait_s=wait_s,
            pull_wait_s=settings.max_wait_ms / 1000, forwarded=forwarded)
        if relayed is not None:
            return relayed
    del raw
    call = await services.calls.execute(program, req.args, req.static_key, owner, req.timeout_s,
                                        req.donate, req.compiler_options)
    if given:
        assert cluster is not None
        await cluster.relay.release(given, owner)
    del req  # the executor holds the input arrays now; do not pin them while we wait
    if cluster is None:
        return await _answer(request, services, call, wait_s, keep)
    # Any replica can answer for the future once it is in Redis, and the answer waits
    # for that: until then it is held back, and written once, as it is then (deleted
    # with keep=false, it is never written).
    async with cluster.mirror.answering(call.future):
        return await _answer(request, services, call, wait_s, keep)


async def _answer(request: Request, services: Services, call: Call, wait_s: float,
                  keep: bool) -> Response:
    """The outputs, if ``call`` is done within ``wait_s`` (and then, unless ``keep``,
    its future is gone); else ``202`` with the future."""
    fut = call.future
    if (wait_s and await fut.wait_final(wait_s) and fut.status is FutureStatus.DONE
            and fut.outputs is not None):
        answer = await outputs_response(fut, services.calls, wants_json(request))
        if not keep:  # the answer holds the values on the host: the outputs can go
            services.futures.delete(fut)
        return answer
    accepted = ExecuteAccepted.of(fut, call.tier)
    return JSONResponse(accepted.model_dump(mode="json"), status_code=202)


def _required(message: Any) -> Any:
    if message is None:
        raise BadRequest("execute needs a body {'args': [...]}")
    return message


ROUTE = next(r for r in router.routes if getattr(r, "endpoint", None) is execute_program)
