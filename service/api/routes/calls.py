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

A batch may also let go of outputs (``release``, as ``POST /v1/futures/release``
takes them), once its calls have started: a client that runs ahead sends the
outputs its program dropped with its next calls rather than in a request of its
own. The answer always says how many were released (``released``, ``unknown``),
so a client knows the server takes them.

With ``?wait=<ms>``, the answer waits up to that long for the calls marked
``inline``, and carries the outputs of those that ended, when they came back with
the run's answer (small ones: ``wire.carried_outputs``): all of them as
``outputs``, or, beside big ones, the small ones as ``carried`` (``{"outputs":
[k, ...], "values": [...]}``: a training step's loss beside its model). A client
that runs ahead reads a quick call's values, or the loss it waits for, with one
round trip, as an execute's ``?wait`` gives them. Their futures are kept.

With replicas, a batch runs where most of its input futures are, as an execute
does: relayed whole to the replica holding them, whose answer it is. An input
another replica holds is then fetched from it first.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response

from jitserve.wire import ErrorCode, is_future_ref

from ...calls.calls import Call
from ...errors import BadRequest, FutureFailed, error_body, refusal_body
from ..bodies import BodyReader, array_response, wants_json
from ..deps import request_cluster, request_owner, services_of
from ..openapi import errors, message_body
from ..schemas import CallsAnswer, CallsItem, CallsJSON, CallsMsgpack, CallsRequest, parse
from .futures import release_refs

__all__ = ["router"]

log = logging.getLogger("jitserve.calls")

router = APIRouter(prefix="/v1", tags=["programs"])


@router.post("/calls", response_model=CallsAnswer,
             openapi_extra={**message_body(CallsJSON, CallsMsgpack, required=True),
                            "security": [{"HTTPBearer": []}]},
             responses=errors(ErrorCode.UNAUTHORIZED, ErrorCode.BAD_REQUEST,
                              ErrorCode.PAYLOAD_TOO_LARGE, ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                              ErrorCode.UNAVAILABLE))
async def start_calls(
    request: Request,
    wait: Annotated[int | None, Query(ge=0, description=(
        "milliseconds to wait for the calls marked inline, whose outputs the answer "
        "then carries"))] = None,
) -> Response:
    """Start calls in order, in one request; one entry per call: its future, or its error.

    Each call is what an execute's body is, with its ``program_id``; an argument
    ``{"call": i, "output": k}`` is output ``k`` of call ``i`` of this batch (an
    earlier one). A refused call's entry is ``{"error": {"code", "message"}}``, the
    error its own execute would get; the calls after it go on. With ``?wait``, the
    entries of ``inline`` calls that ended in time carry their ``outputs``.
    """
    services = services_of(request)
    settings = services.settings
    owner = request_owner(request)
    services.drain.check_accepting()
    body = BodyReader(request, settings.max_body_bytes, timeout_s=settings.body_timeout_s,
                      metrics=services.metrics)
    raw, message = await body.raw_message()
    parsed = parse(CallsRequest, message, "calls request")
    batch, release = parsed.calls, parsed.release
    del message, parsed
    wait_s = min(wait or 0, settings.max_wait_ms) / 1000
    forwarding = request_cluster(request, services)
    if forwarding is not None:  # the batch runs where most of its inputs are, as an execute
        relayed = await forwarding.relay.to_holder(
            request, [a for item in batch for a in item.args], owner, raw, wait_s=wait_s,
            forwarded=False)
        if relayed is not None:
            return relayed
    del raw
    started: list[Call | None] = []
    entries: list[dict[str, Any]] = []
    inline: list[int] = [i for i, item in enumerate(batch) if item.inline]
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
    # After the calls started: one that takes an output released here still reads it.
    done = await release_refs(services, release, owner)
    answer = {"calls": entries, "released": done.released, "unknown": done.unknown}
    cluster = services.cluster
    if cluster is None:
        return await _answer(request, started, answer, inline, wait_s)
    # Another replica may answer for these futures once they are in Redis: the
    # answer waits for that, as an execute's does.
    async with contextlib.AsyncExitStack() as stack:
        for each in started:
            if each is not None:
                await stack.enter_async_context(cluster.mirror.answering(each.future))
        return await _answer(request, started, answer, inline, wait_s)


async def _answer(request: Request, started: list[Call | None], answer: dict[str, Any],
                  inline: list[int], wait_s: float) -> Response:
    """The batch's answer; with ``wait_s``, once the ``inline`` calls ended (or it
    passed), their entries carrying the outputs that came back with their runs."""
    entries = answer["calls"]
    waited = [(i, call.future) for i in inline if (call := started[i]) is not None]
    if not wait_s or not waited:
        return JSONResponse(answer)
    deadline = time.monotonic() + wait_s
    for _, fut in waited:  # in order: the last to end is usually the last started
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        await fut.wait_final(remaining)
    nbytes, carried = 0, False
    for i, fut in waited:
        entries[i]["status"] = fut.status.value
        host, outputs = fut.host, fut.outputs
        if not fut.status.is_final or host is None or outputs is None:
            continue
        which = [k for k, (value, buf) in enumerate(zip(host, outputs))
                 if value is not None and buf is not None]
        if len(which) == len(outputs):
            entries[i]["outputs"] = host
        elif which:  # a loss beside a model: only the small ones came back
            entries[i]["carried"] = {"outputs": which, "values": [host[k] for k in which]}
        nbytes += sum(host[k].nbytes for k in which)
        carried = carried or bool(which)
    if not carried:
        return JSONResponse(answer)
    services_of(request).metrics.transferred("out", nbytes)
    return array_response(answer, wants_json(request), nbytes=nbytes)


async def _start(request: Request, item: CallsItem, index: int, started: list[Call | None],
                 owner: str | None) -> Call:
    """Start call ``index`` of a batch (``started``: the calls before it, ``None`` where
    refused)."""
    services = services_of(request)
    cluster = services.cluster
    given = cluster.relay.donated_elsewhere(item.args, item.donate) if cluster is not None else {}
    args = []
    for n, arg in enumerate(item.args):
        if isinstance(arg, dict) and "call" in arg and "future" not in arg:
            source, output = arg.get("call"), arg.get("output")
            if (type(source) is not int or type(output) is not int or set(arg) != {"call", "output"}
                    or not 0 <= source < index or output < 0):
                what = (f"an earlier call of this batch ({{'call': 0..{index - 1}, 'output': k}})"
                        if index else "an earlier call of this batch, and the first call has none")
                raise BadRequest(f"argument {n}: a call reference names {what}, got {arg!r:.100}")
            earlier = started[source]
            if earlier is None:
                raise FutureFailed(f"argument {n}: call {source} of this batch was refused, so "
                                   "its outputs do not exist")
            arg = {"future": earlier.future.future_id, "output": output}
        elif (cluster is not None and is_future_ref(arg)
              and cluster.membership.elsewhere(str(arg["future"]))):
            arg = await cluster.relay.pull(arg, owner, services.settings.max_wait_ms / 1000)
        args.append(arg)
    program = await services.programs.get(item.program_id, owner)
    call = await services.calls.execute(program, args, item.static_key, owner, item.timeout_s,
                                        item.donate, item.compiler_options)
    if given:
        assert cluster is not None
        await cluster.relay.release(given, owner)
    return call


ROUTE = next(r for r in router.routes if getattr(r, "endpoint", None) is start_calls)
