"""The service's exceptions and the one place that turns them into HTTP answers.

Every error body is ``{"error": {"code": str, "message": str, ...}}``::

    ServiceError               code                 status
    ├── BadRequest             bad_request          400
    │   └── UnsupportedMediaType                     415
    ├── Unauthorized           unauthorized         401
    ├── NotFound               not_found            404
    ├── FuturePending          future_pending       409
    ├── FutureFailed           future_failed        422
    ├── FutureCancelled        future_cancelled     409
    ├── FutureExpired          future_expired       410
    ├── PayloadTooLarge        payload_too_large    413
    ├── TooManyRequests        too_many_requests    429 (+ Retry-After)
    └── Unavailable            unavailable          503 (+ Retry-After)

Compiler errors keep their own codes (400 for a bad program or signature, 422 for
one that is understood but refused); the wire codec's ``WireError`` is a 400
``bad_request``; anything unexpected is a 500 ``internal`` that hides the details.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from client.wire import WireError
from compiler.errors import CompilerError, InvalidProgram, SignatureMismatch

__all__ = [
    "BadRequest",
    "FutureCancelled",
    "FutureExpired",
    "FutureFailed",
    "FuturePending",
    "NotFound",
    "PayloadTooLarge",
    "ServiceError",
    "TooManyRequests",
    "Unauthorized",
    "Unavailable",
    "UnsupportedMediaType",
    "error_body",
    "install_error_handlers",
]

class ServiceError(Exception):
    """A request the service refuses; ``code`` and ``status`` shape the answer."""

    code = "internal"
    status = 500

    def __init__(self, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.message = message
        self.extra = extra

    def headers(self) -> dict[str, str] | None:
        return None


class BadRequest(ServiceError):
    code, status = "bad_request", 400


class UnsupportedMediaType(BadRequest):
    status = 415


class Unauthorized(ServiceError):
    code, status = "unauthorized", 401

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": "Bearer"}


class NotFound(ServiceError):
    code, status = "not_found", 404


class FuturePending(ServiceError):
    code, status = "future_pending", 409


class FutureFailed(ServiceError):
    code, status = "future_failed", 422


class FutureCancelled(ServiceError):
    code, status = "future_cancelled", 409


class FutureExpired(ServiceError):
    code, status = "future_expired", 410


class PayloadTooLarge(ServiceError):
    code, status = "payload_too_large", 413


class TooManyRequests(ServiceError):
    code, status = "too_many_requests", 429

    def __init__(self, message: str, retry_after_s: float = 1.0, **extra: Any) -> None:
        super().__init__(message, **extra)
        self.retry_after_s = max(1, math.ceil(retry_after_s))

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}


class Unavailable(ServiceError):
    """A dependency that has no local stand-in (the shared Redis, for its listings) is down."""

    code, status = "unavailable", 503

    def headers(self) -> dict[str, str]:
        return {"Retry-After": "5"}


# Compiler errors that mean "this is not a valid request" rather than "refused".
_COMPILER_400 = (InvalidProgram, SignatureMismatch)

_HTTP_CODES = {400: "bad_request", 401: "unauthorized", 404: "not_found",
               405: "method_not_allowed", 413: "payload_too_large", 429: "too_many_requests"}


def error_body(code: str, message: str, **extra: Any) -> dict[str, Any]:
    """The JSON document of every error answer."""
    return {"error": {"code": code, "message": message, **extra}}


def _response(status: int, code: str, message: str, headers: dict[str, str] | None = None,
              **extra: Any) -> JSONResponse:
    return JSONResponse(error_body(code, message, **extra), status_code=status, headers=headers)


async def _service_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ServiceError)
    return _response(exc.status, exc.code, exc.message, exc.headers(), **exc.extra)


async def _compiler_error(request: Request, exc: Exception) -> JSONResponse:
    status = 400 if isinstance(exc, _COMPILER_400) else 422
    return _response(status, getattr(exc, "code", "compiler_error"), str(exc))


async def _wire_error(request: Request, exc: Exception) -> JSONResponse:
    return _response(400, "bad_request", f"bad request body: {exc}")


async def _validation_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    details = [{"loc": list(e.get("loc", ())), "msg": e.get("msg", "")} for e in exc.errors()]
    where = "; ".join(f"{'.'.join(map(str, d['loc']))}: {d['msg']}" for d in details)
    return _response(400, "bad_request", f"invalid request: {where}", details=details)


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = _HTTP_CODES.get(exc.status_code, "bad_request" if exc.status_code < 500 else "internal")
    return _response(exc.status_code, code, str(exc.detail), dict(exc.headers or {}) or None)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # The details stay out of the answer; Starlette re-raises after this response,
    # so the server logs the traceback once.
    return _response(500, "internal", "internal server error")


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers that map every exception to an error document."""
    app.add_exception_handler(ServiceError, _service_error)
    app.add_exception_handler(CompilerError, _compiler_error)
    app.add_exception_handler(WireError, _wire_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected)
