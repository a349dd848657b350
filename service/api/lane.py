"""The execute lane: a well-formed request of a loop's routes goes straight to its
handler: an execute, ``POST /v1/calls``, a result's fetch, a release.

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

import dataclasses
import functools
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol, TypeVar

from fastapi import Request, Response
from starlette.datastructures import QueryParams
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute
from starlette.types import Receive, Scope, Send

from ..cluster import replica_header
from .deps import Services

__all__ = ["CallsHandler", "ExecuteLane", "Handler", "LaneApp", "LaneRoute", "lane_routes"]

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


@dataclasses.dataclass(frozen=True)
class LaneRoute:
    """A route the lane serves: ``match`` reads a request's scope into the arguments of
    ``work`` (after the request), or says ``None``: not one the lane takes."""

    route: BaseRoute  # counted under its template, as routed requests are
    work: Callable[..., Awaitable[Response]]
    match: Callable[[Scope], tuple[Any, ...] | None]

    @property
    def path(self) -> str:
        return str(getattr(self.route, "path", ""))


_BOOLS = {"true": True, "1": True, "false": False, "0": False}
# ``?outputs=0,2`` as the route's pattern reads it, in ASCII digits (anything else is
# FastAPI's to judge), within its length.
_OUTPUTS = re.compile(r"[0-9]{1,6}(,[0-9]{1,6})*")
_OUTPUTS_MAX = 70_000


def lane_routes(execute: tuple[BaseRoute, Handler], calls: tuple[BaseRoute, CallsHandler],
                result: tuple[BaseRoute, Callable[..., Awaitable[Response]]],
                release: tuple[BaseRoute, Callable[..., Awaitable[Response]]]
                ) -> list[LaneRoute]:
    """The lane's routes (each a route and its work): an execute, ``POST /v1/calls``,
    ``GET /v1/futures/{id}/result`` and ``POST /v1/futures/release``, the requests a
    training loop makes every step or every few."""
    return [
        LaneRoute(*execute, _matcher("POST", r"/v1/programs/([^/]+)/execute", _query)),
        LaneRoute(*calls, _matcher("POST", "/v1/calls", _calls_query)),
        LaneRoute(*result, _matcher("GET", r"/v1/futures/([^/]+)/result", _result_query)),
        LaneRoute(*release, _matcher("POST", "/v1/futures/release", None)),
    ]


def _matcher(method: str, path: str, query: Callable[[bytes], tuple[Any, ...] | None] | None
             ) -> Callable[[Scope], tuple[Any, ...] | None]:
    """What reads a request of ``method`` on ``path`` (a pattern; its groups are the path's
    parameters) into its work's arguments: the parameters, then what ``query`` reads
    (``None`` from it: FastAPI's to judge; no ``query``: the query is not read)."""
    pattern = re.compile(path)

    def match(scope: Scope) -> tuple[Any, ...] | None:
        if scope["method"] != method or (found := pattern.fullmatch(scope["path"])) is None:
            return None
        if query is None:
            return found.groups()
        read = query(scope["query_string"])
        return None if read is None else (*found.groups(), *read)

    return match


class ExecuteLane:
    """The front of the app: a well-formed request of one of ``routes`` goes straight to
    its work (``lane_routes``: an execute, a running-ahead client's every batch, a
    fetch, a release); any other goes down the stack.

    Args:
      app: the app it stands in front of (its services, exception handlers).
      routes: what it serves (``LaneRoute``).
    """

    def __init__(self, app: LaneApp, routes: list[LaneRoute]) -> None:
        self.app = app
        self._routes = routes

    def take(self, scope: Scope) -> tuple[LaneRoute, tuple[Any, ...]] | None:
        """The route of a request the lane serves, and its work's arguments; else ``None``."""
        if scope["type"] != "http" or scope.get("root_path"):
            return None
        for route in self._routes:
            args = route.match(scope)
            if args is not None:
                return route, args
        return None

    async def serve(self, scope: Scope, receive: Receive, send: Send,
                    call: tuple[LaneRoute, tuple[Any, ...]]) -> None:
        app = self.app
        route, args = call
        scope["app"] = app
        scope["route"] = route.route
        request = Request(scope, receive, send)
        try:
            response = await route.work(request, *args)
        except Exception as exc:
            handler = _handler(app, exc)
            if handler is not None:
                response = await handler(request, exc)
            else:
                await self._answer(scope, receive, send, route.path,
                                   await app.exception_handlers[Exception](request, exc))
                raise
        await self._answer(scope, receive, send, route.path, response)

    async def _answer(self, scope: Scope, receive: Receive, send: Send, path: str,
                      response: Response) -> None:
        services = self.app.services
        if services.cluster is not None:
            response.raw_headers.append(replica_header(services.cluster))
        try:
            await response(scope, receive, send)
        finally:
            services.metrics.request(path, response.status_code)


def _calls_query(raw: bytes) -> tuple[int | None] | None:
    """``(wait,)`` of a batch's query (``_query`` without ``keep``)."""
    read = _query(raw)
    return None if read is None else (read[0],)


def _parse_result_query(raw: bytes) -> tuple[int | None, str | None] | None:
    params = QueryParams(raw.decode("latin-1"))
    wait, outputs = _wait(params.get("wait")), params.get("outputs")
    if wait is False or (outputs is not None and (
            len(outputs) > _OUTPUTS_MAX or not _OUTPUTS.fullmatch(outputs))):
        return None
    return wait, outputs


def _wait(value: str | None) -> int | None | bool:
    """A ``?wait`` in ms; ``False`` for one that is no plain number (FastAPI's to judge)."""
    if value is None:
        return None
    if not (value.isascii() and value.isdigit() and len(value) <= 15):
        return False
    return int(value)


# Clients repeat their queries call after call: short ones are parsed once, so the
# parse is starlette's own (a cached lookup costs the same whoever parsed it).
_KEPT_BYTES = 64

T = TypeVar("T")


def _kept(parse: Callable[[bytes], T]) -> Callable[[bytes], T]:
    """``parse``, its answers for short queries kept (``_KEPT_BYTES``, 256 of them)."""
    known = functools.lru_cache(maxsize=256)(parse)

    def read(raw: bytes) -> T:
        return known(raw) if len(raw) <= _KEPT_BYTES else parse(raw)

    return read


def _parse_query(raw: bytes) -> tuple[int | None, bool] | None:
    params = QueryParams(raw.decode("latin-1"))
    wait, keep = _wait(params.get("wait")), params.get("keep")
    flag = True if keep is None else _BOOLS.get(keep)
    if wait is False or flag is None:
        return None
    return wait, flag


#: ``(wait, keep)`` of an execute's query, read as starlette reads it (``QueryParams``:
#: escapes decoded, the last of a repeated name); ``None`` for a value FastAPI should
#: judge (a ``wait`` that is no plain number, a ``keep`` that is no plain boolean).
_query = _kept(_parse_query)
#: ``(wait, outputs)`` of a result's query, read the same way.
_result_query = _kept(_parse_result_query)


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
