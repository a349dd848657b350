"""``POST /v1/programs/{id}/execute``: the hot path of a cached call.

FastAPI declares it (its OpenAPI, and the validation of ``?wait``), but the
handler takes what other routes receive as dependencies from ``app.state``
itself: resolving a dozen dependencies cost as much as the rest of a cached
call (docs/performance.md), and this route is the one every call goes through.
What it does is the same as theirs: ``deps.request_owner`` authenticates (or
checks a peer's signature), the body is read by a ``BodyReader`` under the
same limits.

``ExecuteLane``, at the front of the app, goes one step further: it hands a
well-formed execute request to the same handler (``execute``) before the
middleware stack, the router, FastAPI's request wrappers and its parameter
validation see it; it does itself what the stack's middleware would do for it
(count it, name the replica, answer its errors through the app's own exception
handlers). A request it does not recognise (a ``?wait`` that is not a number,
say) goes down the stack as usual, so it is answered, and refused, exactly as
before.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from fastapi import APIRouter, FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive, Scope, Send

from jitserve.wire import ErrorCode

from ...calls.calls import Call
from ...cluster import replica_header
from ...errors import BadRequest
from ..bodies import BodyReader, outputs_response, wants_json
from ..deps import request_cluster, request_owner
from ..openapi import errors, message_body, outputs_content
from ..schemas import ExecuteAccepted, ExecuteJSON, ExecuteMsgpack, ExecuteRequest, parse

__all__ = ["ExecuteLane", "router"]

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
    state = request.app.state
    settings = state.settings
    owner = request_owner(request)
    cluster = state.cluster
    state.drain.check_accepting()
    forwarded = cluster is not None and request_cluster(request) is None
    program = await state.programs.get(program_id, owner, vouched=forwarded)
    body = BodyReader(request, settings.max_body_bytes, timeout_s=settings.body_timeout_s,
                      metrics=state.metrics)
    raw, message = await body.raw_message()
    req = parse(ExecuteRequest, _required(message), "execute request")
    wait_s = min(wait or 0, settings.max_wait_ms) / 1000
    if cluster is not None:  # a call on other replicas' futures runs there, or fetches them
        relayed = await cluster.relay.run_elsewhere(
            request, req.args, owner, raw, wait_s=wait_s,
            pull_wait_s=settings.max_wait_ms / 1000, forwarded=forwarded)
        if relayed is not None:
            return relayed
    del raw
    call = await state.calls.execute(program, req.args, req.static_key, owner, req.timeout_s,
                                     req.donate)
    del req  # the executor holds the input arrays now; do not pin them while we wait
    if cluster is None:
        return await _answer(request, state, call, wait_s, keep)
    # Any replica can answer for the future once it is in Redis, and the answer waits
    # for that: until then it is held back, and written once, as it is then (deleted
    # with keep=false, it is never written).
    async with cluster.mirror.answering(call.future):
        return await _answer(request, state, call, wait_s, keep)


async def _answer(request: Request, state: Any, call: Call, wait_s: float,
                  keep: bool) -> Response:
    """The outputs, if ``call`` is done within ``wait_s`` (and then, unless ``keep``,
    its future is gone); else ``202`` with the future."""
    fut = call.future
    if wait_s and await fut.wait_final(wait_s) and fut.outputs is not None:
        answer = await outputs_response(fut, state.metrics, wants_json(request), state.runtimes)
        if not keep:  # the answer holds the values on the host: the outputs can go
            state.futures.delete(fut)
        return answer
    accepted = ExecuteAccepted.of(fut, call.tier)
    return JSONResponse(accepted.model_dump(mode="json"), status_code=202)


def _required(message: Any) -> Any:
    if message is None:
        raise BadRequest("execute needs a body {'args': [...]}")
    return message


_PATH = re.compile(r"/v1/programs/([^/]+)/execute")
_ROUTE = next(r for r in router.routes if getattr(r, "endpoint", None) is execute_program)
_BOOLS = {"true": True, "1": True, "false": False, "0": False}


class ExecuteLane:
    """The front of the app: a well-formed execute request goes straight to ``execute``.

    Ahead of the middleware stack: a cached call's time in the API process went
    a fifth to the stack's layers and their ``send`` wrappers, and a third more to
    the router and FastAPI's request handling (docs/performance.md). So the lane
    does their part for the requests it takes: it counts them under the route's
    template (``RequestMetricsMiddleware``), names the replica in the answer
    (``AnnounceReplica``), answers errors through the app's exception handlers,
    and one without a handler as ``ServerErrorMiddleware`` does: a 500 from the
    app's handler for ``Exception``, then the error goes up to be logged.
    """

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    @staticmethod
    def take(scope: Scope) -> tuple[str, int | None, bool] | None:
        """``(program_id, wait, keep)`` of an execute request the lane serves, else ``None``."""
        if (scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path")
                or (match := _PATH.fullmatch(scope["path"])) is None
                or (query := _query(scope["query_string"])) is None):
            return None
        return match.group(1), *query

    async def serve(self, scope: Scope, receive: Receive, send: Send,
                    call: tuple[str, int | None, bool]) -> None:
        app = self.app
        scope["app"] = app
        scope["route"] = _ROUTE
        request = _LaneRequest(scope, receive, send)
        try:
            response = await execute(request, *call)
        except Exception as exc:
            handler = _handler(app, exc)
            if handler is not None:
                response = await handler(request, exc)
            else:
                await self._answer(scope, receive, send,
                                   await app.exception_handlers[Exception](request, exc))
                raise
        await self._answer(scope, receive, send, response)

    async def _answer(self, scope: Scope, receive: Receive, send: Send,
                      response: Response) -> None:
        state = self.app.state
        cluster = getattr(state, "cluster", None)
        if cluster is not None:
            response.raw_headers.append(replica_header(cluster))
        try:
            await response(scope, receive, send)
        finally:
            state.metrics.request(_ROUTE.path, response.status_code)


class _LaneRequest(Request):
    """A request whose headers are looked up in a dict (``_Headers``)."""

    def __init__(self, scope: Scope, *args: Any) -> None:
        super().__init__(scope, *args)
        self._headers = _Headers(scope=scope)  # what starlette's ``headers`` returns


class _Headers(Headers):
    """Starlette's headers, read through a dict of the first value of each name.

    A call reads six headers (authentication, a peer's signature, ``Accept``,
    ``Content-Type`` twice, ``Content-Length``); starlette's lookup scans the list
    for each, and raises and catches a ``KeyError`` for each one absent.
    """

    def __init__(self, *, scope: Scope) -> None:
        super().__init__(scope=scope)
        # ASGI names are lowercase already; the first of a repeated name wins, as in
        # a scan
        self._first = dict(reversed(self._list))

    def __getitem__(self, key: str) -> str:
        value = self._first.get(key.lower().encode("latin-1"))
        if value is None:
            raise KeyError(key)
        return value.decode("latin-1")

    def get(self, key: str, default: Any = None) -> Any:
        value = self._first.get(key.lower().encode("latin-1"))
        return default if value is None else value.decode("latin-1")

    def __contains__(self, key: Any) -> bool:
        return isinstance(key, str) and key.lower().encode("latin-1") in self._first


def _query(raw: bytes) -> tuple[int | None, bool] | None:
    """``(wait, keep)`` of a plain query string; ``None`` for anything FastAPI
    should judge (escapes, a non-numeric ``wait``, an unusual ``keep``)."""
    return _known_query(raw) if len(raw) <= _KEPT_BYTES else _parse_query(raw)


# Clients repeat their queries call after call: short ones are parsed once.
_KEPT_BYTES = 64


@functools.lru_cache(maxsize=256)
def _known_query(raw: bytes) -> tuple[int | None, bool] | None:
    return _parse_query(raw)


def _parse_query(raw: bytes) -> tuple[int | None, bool] | None:
    wait, keep = None, True
    if not raw:
        return wait, keep
    if b"%" in raw or b"+" in raw:
        return None
    for pair in raw.decode("latin-1").split("&"):
        name, _, value = pair.partition("=")
        if name == "wait":
            if not (value.isascii() and value.isdigit() and len(value) <= 15):
                return None
            wait = int(value)
        elif name == "keep":
            if (flag := _BOOLS.get(value)) is None:
                return None
            keep = flag
    return wait, keep


def _handler(app: FastAPI, exc: Exception) -> Callable[..., Awaitable[Response]] | None:
    """The handler ``ExceptionMiddleware`` would pick for ``exc``: by class, nearest
    first. ``Exception``'s own is ``ServerErrorMiddleware``'s, which is left to it."""
    if isinstance(exc, StarletteHTTPException) and exc.status_code in app.exception_handlers:
        return app.exception_handlers[exc.status_code]
    for cls in type(exc).__mro__:
        if cls is Exception:
            return None
        if cls in app.exception_handlers:
            return app.exception_handlers[cls]
    return None
