"""The service's exceptions and the one place that turns them into HTTP answers.

Every error body is ``{"error": {"code": str, "message": str, ...}}``; each
code's HTTP status is the wire contract's (``jitserve.wire.ERROR_STATUS``)::

    ServiceError               code
    ├── BadRequest             bad_request          400
    │   └── UnsupportedMediaType  unsupported_media_type  415
    ├── Unauthorized           unauthorized         401
    ├── Forbidden              forbidden            403
    ├── NotFound               not_found            404
    ├── FuturePending          future_pending       409
    ├── FutureFailed           future_failed        422
    ├── FutureCancelled        future_cancelled     409
    ├── FutureExpired          future_expired       410
    ├── PayloadTooLarge        payload_too_large    413
    ├── TooManyRequests        too_many_requests    429 (+ Retry-After)
    └── Unavailable            unavailable          503 (+ Retry-After)

Compiler errors keep their own codes (400 for a bad program or signature, 422 for
one that is understood but refused); the compiler's ``CacheUnavailable`` (the
shared Redis is down, for a listing) is a 503 ``unavailable``; the wire codec's
``WireError`` is a 400 ``bad_request``; anything unexpected is a 500 ``internal`` that hides the details.
A client that disconnects before its request body ended (Starlette's
``ClientDisconnect``) is logged on one info line and counted as status 499, nginx's
"client closed request": nobody receives that answer, and it is no server error.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from jitserve.compiler import CacheUnavailable
from jitserve.compiler.errors import CompilerError
from jitserve.wire import ErrorCode, WireError

from .memory import SharedMemoryFull

if TYPE_CHECKING:
    from .metrics import Metrics

__all__ = [
    "BadRequest",
    "Forbidden",
    "FutureCancelled",
    "FutureExpired",
    "FutureFailed",
    "FuturePending",
    "NotFound",
    "OnRefused",
    "PayloadTooLarge",
    "ServiceError",
    "TooManyRequests",
    "Unauthorized",
    "Unavailable",
    "UnsupportedMediaType",
    "error_body",
    "refusal_body",
    "install_error_handlers",
]

refusal_log = logging.getLogger("jitserve.refusals")


class ServiceError(Exception):
    """A request the service refuses; ``code`` (and its status) shape the answer."""

    code = ErrorCode.INTERNAL

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.extra = extra

    def headers(self) -> dict[str, str] | None:
        return None


class BadRequest(ServiceError):
    code = ErrorCode.BAD_REQUEST


class UnsupportedMediaType(BadRequest):
    code = ErrorCode.UNSUPPORTED_MEDIA_TYPE


class Unauthorized(ServiceError):
    code = ErrorCode.UNAUTHORIZED

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class Forbidden(ServiceError):
    """A valid API key that may not do this (an admin route, ``JITSERVE_ADMIN_KEYS``)."""

    code = ErrorCode.FORBIDDEN


class NotFound(ServiceError):
    code = ErrorCode.NOT_FOUND


class FuturePending(ServiceError):
    code = ErrorCode.FUTURE_PENDING


class FutureFailed(ServiceError):
    code = ErrorCode.FUTURE_FAILED


class FutureCancelled(ServiceError):
    code = ErrorCode.FUTURE_CANCELLED


class FutureExpired(ServiceError):
    code = ErrorCode.FUTURE_EXPIRED


class PayloadTooLarge(ServiceError):
    code = ErrorCode.PAYLOAD_TOO_LARGE


class TooManyRequests(ServiceError):
    code = ErrorCode.TOO_MANY_REQUESTS

    def __init__(self, message: str, retry_after_s: float = 1.0, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.retry_after_s = max(1, math.ceil(retry_after_s))

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class Unavailable(ServiceError):
    """A dependency that has no local stand-in (the shared Redis, for its listings) is down."""

    code = ErrorCode.UNAVAILABLE

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "5"}


# Starlette's own HTTP errors (unknown route, wrong method) by status.
_HTTP_CODES = {e.status: e for e in (ErrorCode.BAD_REQUEST, ErrorCode.UNAUTHORIZED,
                                     ErrorCode.FORBIDDEN,
                                     ErrorCode.NOT_FOUND, ErrorCode.METHOD_NOT_ALLOWED,
                                     ErrorCode.PAYLOAD_TOO_LARGE, ErrorCode.TOO_MANY_REQUESTS)}


def error_body(code: str, message: str, **extra: Any) -> dict[str, Any]:
    """The JSON document of every error answer."""
    return {"error": {"code": code, "message": message, **extra}}


def refusal_body(exc: Exception) -> dict[str, Any] | None:
    """The error document a refusal ``exc`` is answered with (as the handlers below
    answer it), for an answer that carries several (``POST /v1/calls``); ``None`` for
    an exception that is no refusal (a bug: answered ``internal``)."""
    if isinstance(exc, ServiceError):
        return error_body(exc.code.value, exc.message, **exc.extra)
    if isinstance(exc, CompilerError):
        return error_body(ErrorCode(exc.code).value, str(exc))
    if isinstance(exc, CacheUnavailable):
        return error_body(ErrorCode.UNAVAILABLE.value, f"the shared cache is unavailable: {exc}")
    if isinstance(exc, WireError):
        return error_body(ErrorCode.BAD_REQUEST.value, f"bad request body: {exc}")
    if isinstance(exc, SharedMemoryFull):
        return error_body(ErrorCode.UNAVAILABLE.value, str(exc))
    return None


def _response(code: ErrorCode, message: str, headers: dict[str, str] | None = None,
              status: int | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse(error_body(code.value, message, **extra),
                        status_code=status or code.status, headers=headers)


def _refused(request: Request, response: JSONResponse, code: ErrorCode, message: str) -> JSONResponse:
    """Log one line for a refused request (4xx): the route, the code and the reason."""
    if response.status_code < 500:
        refusal_log.info("refused %s %s: %d %s: %.300s", request.method, request.url.path,
                         response.status_code, code.value, message,
                         extra={"fields": {"method": request.method, "path": request.url.path,
                                           "status": response.status_code, "code": code.value}})
    return response


async def _service_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    return _refused(request, _response(exc.code, exc.message, exc.headers(), **exc.extra),
                    exc.code, exc.message)


async def _compiler_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, CompilerError)
    code = ErrorCode(exc.code)
    return _refused(request, _response(code, str(exc)), code, str(exc))


async def _cache_unavailable(request: Request, exc: Exception) -> JSONResponse:
    return await _service_error(request, Unavailable(f"the shared cache is unavailable: {exc}"))


async def _shared_memory_full(request: Request, exc: Exception) -> JSONResponse:
    # The server's configuration, not the request: said to the operator as well.
    log.warning("%s %s: %s", request.method, request.url.path, exc)
    return await _service_error(request, Unavailable(str(exc)))


async def _wire_error(request: Request, exc: Exception) -> JSONResponse:
    message = f"bad request body: {exc}"
    return _refused(request, _response(ErrorCode.BAD_REQUEST, message), ErrorCode.BAD_REQUEST,
                    message)


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    details = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", "")} for e in exc.errors()]
    where = "; ".join(f"{'.'.join(map(str, d['loc']))}: {d['msg']}" for d in details)
    message = f"invalid request: {where}"
    return _refused(request, _response(ErrorCode.BAD_REQUEST, message, details=details),
                    ErrorCode.BAD_REQUEST, message)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    fallback = ErrorCode.BAD_REQUEST if exc.status_code < 500 else ErrorCode.INTERNAL
    code = _HTTP_CODES.get(exc.status_code, fallback)
    headers = dict(exc.headers or {})
    message = str(exc.detail)
    if exc.status_code == 405:
        # Starlette names the methods of the first route whose path matched; a path
        # has one route per method here (GET and DELETE /v1/programs/{id}).
        allowed = _allowed_methods(request)
        headers["Allow"] = ", ".join(allowed)
        message = f"{request.method} is not allowed here; allowed: {', '.join(allowed)}"
    return _response(code, message, headers or None, status=exc.status_code)


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _allowed_methods(request: Request) -> list[str]:
    """Every method some route of the app serves at ``request``'s path (asked of each
    route as that method: included routers answer ``matches`` but list no methods)."""
    routes = request.app.router.routes
    return [m for m in _METHODS
            if any(r.matches({**request.scope, "method": m})[0] is Match.FULL for r in routes)]


# nginx's status for a request whose client went away before the answer.
_CLIENT_CLOSED = 499

log = logging.getLogger("jitserve.requests")


def _client_disconnect(metrics: Metrics) -> Callable[[Request, Exception], Awaitable[Response]]:
    async def handle(request: Request, exc: Exception) -> Response:
        where = f" {exc}" if str(exc) else ""
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        log.info("%s disconnected before its request body ended%s: %s %s", client, where,
                 request.method, request.url.path)
        metrics.body_aborted("disconnect")
        return Response(status_code=_CLIENT_CLOSED)  # never delivered; the metrics count it

    return handle


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # The details stay out of the answer; Starlette re-raises after this response,
    # so the server logs the traceback once.
    return _response(ErrorCode.INTERNAL, "internal server error")


#: Told of each refusal: the request, its error code and the quota it ran into, if any.
OnRefused = Callable[[Request, str, "str | None"], None]


def _noted(handler: Callable[[Request, Exception], Awaitable[Response]],
           on_refused: OnRefused) -> Callable[[Request, Exception], Awaitable[Response]]:
    """``handler``, telling ``on_refused`` of each refusal it answers."""
    async def handle(request: Request, exc: Exception) -> Response:
        response = await handler(request, exc)
        error = (refusal_body(exc) or {}).get("error") or {"code": ErrorCode.BAD_REQUEST.value}
        quota = error.get("quota")
        on_refused(request, str(error["code"]), None if quota is None else str(quota))
        return response

    return handle


def install_error_handlers(app: FastAPI, metrics: Metrics,
                           on_refused: OnRefused | None = None) -> None:
    """Register the handlers that map every exception to an error document (``metrics``
    counts the bodies that clients broke off; ``on_refused`` hears of each refusal:
    the console's errors by code).

    Unknown routes and wrong methods (starlette's own errors) and server errors are
    not refusals.
    """
    refusals: list[tuple[type[Exception], Callable[[Request, Exception], Awaitable[Response]]]] = [
        (ServiceError, _service_error), (CompilerError, _compiler_error),
        (CacheUnavailable, _cache_unavailable), (SharedMemoryFull, _shared_memory_full),
        (WireError, _wire_error),
        (RequestValidationError, _validation_error)]
    for cls, handler in refusals:
        app.add_exception_handler(cls, handler if on_refused is None
                                  else _noted(handler, on_refused))
    app.add_exception_handler(ClientDisconnect, _client_disconnect(metrics))
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
