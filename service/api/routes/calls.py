"""``POST /v1/calls``: several calls started in order, in one request.

A client that runs ahead (it sends the next calls before the answers to the last
ones came back) sends what it has queued as one batch: one round trip for all of
them, whatever the network's latency. A call may take an output of an earlier
call of the same batch (``{"call": i, "output": k}``), whose future does not
exist yet when the batch is sent; each call is otherwise an execute
(``POST /v1/programs/{id}/execute``), started as that route starts it, in order.

The answer has one entry per call: its future (id, status, executable, tier), or
the error its own execute would have got. A call refused leaves the later ones
to go on; one that takes an output of a refused call is refused too, naming it.
The outputs' avals are not repeated here: ``GET /v1/futures/{id}`` gives them.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from jitserve.wire import ErrorCode

from ...calls.calls import Call
from ...errors import BadRequest, FutureFailed, error_body, refusal_body
from ..bodies import BodyReader
from ..deps import request_owner, services_of
from ..openapi import errors, message_body
from ..schemas import CallsAnswer, CallsItem, CallsJSON, CallsMsgpack, CallsRequest, parse

__all__ = ["router"]

log = logging.getLogger("jitserve.calls")

router = APIRouter(prefix="/v1", tags=["programs"])


@router.post("/calls", response_model=CallsAnswer,
             openapi_extra={**message_body(CallsJSON, CallsMsgpack, required=True),
                            "security": [{"HTTPBearer": []}]},
             responses=errors(ErrorCode.UNAUTHORIZED, ErrorCode.BAD_REQUEST,
                              ErrorCode.PAYLOAD_TOO_LARGE, ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                              ErrorCode.UNAVAILABLE))
async def start_calls(request: Request) -> JSONResponse:
    """Start calls in order, in one request; one entry per call: its future, or its error.

    Each call is what an execute's body is, with its ``program_id``; an argument
    ``{"call": i, "output": k}`` is output ``k`` of call ``i`` of this batch (an
    earlier one). A refused call's entry is ``{"error": {"code", "message"}}``, the
    error its own execute would get; the calls after it go on.
    """
    services = services_of(request)
    settings = services.settings
    owner = request_owner(request)
    services.drain.check_accepting()
    body = BodyReader(request, settings.max_body_bytes, timeout_s=settings.body_timeout_s,
                      metrics=services.metrics)
    _, message = await body.raw_message()
    batch = parse(CallsRequest, message, "calls request").calls
    del message
    started: list[Call | None] = []
    entries: list[dict[str, Any]] = []
    for index, item in enumerate(batch):
        try:
            call = await _start(request, item, index, started, owner)
        except Exception as e:  # noqa: BLE001 - each call's refusal is its own entry
            refused = refusal_body(e)
            if refused is None:
                log.exception("call %d of a batch failed unexpectedly", index)
                refused = error_body(ErrorCode.INTERNAL.value, f"internal error: {type(e).__name__}")
            started.append(None)
            entries.append(refused)
            continue
        started.append(call)
        fut = call.future
        entries.append({"future_id": fut.future_id, "status": fut.status.value,
                        "executable_id": fut.executable_id, "tier": call.tier})
    batch.clear()  # the executor holds the inputs now
    cluster = services.cluster
    if cluster is None:
        return JSONResponse({"calls": entries})
    # Another replica may answer for these futures once they are in Redis: the
    # answer waits for that, as an execute's does.
    async with contextlib.AsyncExitStack() as stack:
        for each in started:
            if each is not None:
                await stack.enter_async_context(cluster.mirror.answering(each.future))
        return JSONResponse({"calls": entries})


async def _start(request: Request, item: CallsItem, index: int, started: list[Call | None],
                 owner: str | None) -> Call:
    """Start call ``index`` of a batch (``started``: the calls before it, ``None`` where
    refused)."""
    services = services_of(request)
    args = []
    for n, arg in enumerate(item.args):
        if isinstance(arg, dict) and "call" in arg and "future" not in arg:
            source, output = arg.get("call"), arg.get("output")
            if (type(source) is not int or type(output) is not int or set(arg) != {"call", "output"}
                    or not 0 <= source < index or output < 0):
                raise BadRequest(f"argument {n}: a call reference names an earlier call of this "
                                 f"batch ({{'call': 0..{index - 1}, 'output': k}}), got {arg!r:.100}")
            earlier = started[source]
            if earlier is None:
                raise FutureFailed(f"argument {n}: call {source} of this batch was refused, so "
                                   "its outputs do not exist")
            arg = {"future": earlier.future.future_id, "output": output}
        args.append(arg)
    program = await services.programs.get(item.program_id, owner)
    return await services.calls.execute(program, args, item.static_key, owner, item.timeout_s,
                                        item.donate)
