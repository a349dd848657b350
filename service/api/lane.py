"""The execute lane: a well-formed execute (or ``POST /v1/calls``) request goes
straight to its handler.

Ahead of the middleware stack: a cached call's time in the API process went a
fifth to the stack's layers and their ``send`` wrappers, and a third more to the
router and FastAPI's request handling (docs/performance.md). So the lane does
their part for the requests it takes: it counts them under the route's template
(``RequestMetricsMiddleware``), names the replica in the answer
(``AnnounceReplica``), answers errors through the app's exception handlers, and
one without a handler as ``ServerErrorMiddleware`` does: a 500 from the app's
handler for ``Exception``, then the error goes up to be logged. A request it does
not recognise (a ``?wait`` that is not a number, say) goes down the stack as
usual, so it is answered, and refused, exactly as FastAPI would.

What the lane does itself it does with the framework's and the app's own pieces
wherever that costs no measurable time: starlette's ``Request`` and its headers,
starlette's ``QueryParams`` (behind a cache of the queries clients repeat), the
app's ``Metrics.request`` and ``replica_header``. A dict of headers of its own
(dropped in issue 35) measured no faster than starlette's scan of the list:
``bench/trees.py`` P1 over 3000 rounds, each way round, read 0.982 and 0.992
(the server started second ahead both times). Kept: the lookup of the exception
handler (``_handler``), which starlette has only as a private function.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from fastapi import Request, Response
from starlette.datastructures import QueryParams
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute
from starlette.types import Receive, Scope, Send

from ..cluster import replica_header
from .deps import Services

__all__ = ["CallsHandler", "ExecuteLane", "Handler", "LaneApp"]

#: The execute route's work: ``(request, program_id, wait, keep)`` -> its answer.
Handler = Callable[[Request, str, "int | None", bool], Awaitable[Response]]
#: ``POST /v1/calls``'s work: ``(request, wait)`` -> its answer.
CallsHandler = Callable[[Request, "int | None"], Awaitable[Response]]


class LaneApp(Protocol):
    """What the lane needs of its app (``service.app.JitserveApp``)."""

    @property
    def services(self) -> Services: ...

    @property
    def exception_handlers(self) -> Mapping[Any, Callable[..., Any]]: ...

_PATH = re.compile(r"/v1/programs/([^/]+)/execute")
_CALLS = "/v1/calls"
_BOOLS = {"true": True, "1": True, "false": False, "0": False}


class ExecuteLane:
    """The front of the app: a well-formed execute request goes straight to ``handler``,
    a well-formed ``POST /v1/calls`` (a running-ahead client's every batch) to
    ``calls_handler``.

    Args:
      app: the app it stands in front of (its services, exception handlers).
      route: the execute route, under whose template the answers are counted.
      handler: the route's work (``api.routes.execute.execute``).
      calls_route, calls_handler: the same for ``POST /v1/calls``
        (``api.routes.calls.start_calls``).
    """

    def __init__(self, app: LaneApp, route: BaseRoute, handler: Handler,
                 calls_route: BaseRoute, calls_handler: CallsHandler) -> None:
        self.app = app
        self._execute = (route, getattr(route, "path", ""), handler)
        self._calls = (calls_route, getattr(calls_route, "path", ""), calls_handler)

    def take(self, scope: Scope) -> tuple[Any, tuple[Any, ...]] | None:
        """The route (its template, work) of a request the lane serves and the work's
        arguments (``(program_id, wait, keep)``, or ``(wait,)``); else ``None``."""
        if scope["type"] != "http" or scope["method"] != "POST" or scope.get("root_path"):
            return None
        path = scope["path"]
        if path == _CALLS:
            query = _query(scope["query_string"])
            return None if query is None else (self._calls, (query[0],))
        if (match := _PATH.fullmatch(path)) is None or (query := _query(scope["query_string"])) is None:
            return None
        return self._execute, (match.group(1), *query)

    async def serve(self, scope: Scope, receive: Receive, send: Send,
                    call: tuple[Any, tuple[Any, ...]]) -> None:
        app = self.app
        (route, path, work), args = call
        scope["app"] = app
        scope["route"] = route
        request = Request(scope, receive, send)
        try:
            response = await work(request, *args)
        except Exception as exc:
            handler = _handler(app, exc)
            if handler is not None:
                response = await handler(request, exc)
            else:
                await self._answer(scope, receive, send, path,
                                   await app.exception_handlers[Exception](request, exc))
                raise
        await self._answer(scope, receive, send, path, response)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, path: str,
                      response: Response) -> None:
        services = self.app.services
        if services.cluster is not None:
            response.raw_headers.append(replica_header(services.cluster))
        try:
            await response(scope, receive, send)
        finally:
            services.metrics.request(path, response.status_code)


def _query(raw: bytes) -> tuple[int | None, bool] | None:
    """``(wait, keep)`` of a query string, read as starlette reads it (``QueryParams``:
    escapes decoded, the last of a repeated name); ``None`` for a value FastAPI should
    judge (a ``wait`` that is no plain number, a ``keep`` that is no plain boolean)."""
    return _known_query(raw) if len(raw) <= _KEPT_BYTES else _parse_query(raw)


# Clients repeat their queries call after call: short ones are parsed once, so the
# parse is starlette's own (a cached lookup costs the same whoever parsed it).
_KEPT_BYTES = 64


@functools.lru_cache(maxsize=256)
def _known_query(raw: bytes) -> tuple[int | None, bool] | None:
    return _parse_query(raw)


def _parse_query(raw: bytes) -> tuple[int | None, bool] | None:
    params = QueryParams(raw.decode("latin-1"))
    wait, keep = params.get("wait"), params.get("keep")
    if wait is not None and not (wait.isascii() and wait.isdigit() and len(wait) <= 15):
        return None
    flag = True if keep is None else _BOOLS.get(keep)
    if flag is None:
        return None
    return (None if wait is None else int(wait)), flag


def _handler(app: LaneApp, exc: Exception) -> Callable[..., Awaitable[Response]] | None:
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
