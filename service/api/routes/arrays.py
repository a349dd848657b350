"""``/v1/arrays``: keep arrays on the device, for calls that read them again and again."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from jitserve.wire import ErrorCode

from ...errors import BadRequest
from ..deps import Body, Owner, ServicesDep, get_owner
from ..openapi import errors, message_body
from ..schemas import (
    ArraysJSON,
    ArraysMsgpack,
    ArraysRequest,
    ExecuteAccepted,
    parse,
)

__all__ = ["router"]

router = APIRouter(prefix="/v1/arrays", tags=["arrays"], dependencies=[Depends(get_owner)],
                   responses=errors(ErrorCode.UNAUTHORIZED))


@router.post("", status_code=201, response_model=ExecuteAccepted,
             openapi_extra=message_body(ArraysJSON, ArraysMsgpack, required=True),
             responses=errors(ErrorCode.BAD_REQUEST, ErrorCode.PAYLOAD_TOO_LARGE,
                              ErrorCode.UNSUPPORTED_MEDIA_TYPE, ErrorCode.LIMIT_EXCEEDED,
                              ErrorCode.TOO_MANY_REQUESTS, ErrorCode.OUT_OF_MEMORY,
                              ErrorCode.UNAVAILABLE))
async def put_arrays(services: ServicesDep, body: Body, owner: Owner) -> ExecuteAccepted:
    """Upload arrays once and keep them on the device (``jax.device_put``).

    The answer is a ``done`` future whose outputs are the arrays, in order: pass
    ``{"future": id, "output": k}`` to executes instead of sending them again,
    release them with ``POST /v1/futures/release`` like any output.
    """
    services.drain.check_accepting()
    message = await body.message()
    if message is None:
        raise BadRequest("put needs a body {'arrays': [...]}")
    req = parse(ArraysRequest, message, "arrays request")
    fut = await services.calls.put(req.arrays, owner)
    if services.cluster is not None:
        await services.cluster.mirror.written(fut)  # any replica can answer for it from now on
    return ExecuteAccepted.of(fut, "put")
