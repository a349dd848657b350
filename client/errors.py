"""Every exception the client raises.

One tree; catch ``JitserveError`` for all of them::

    JitserveError
    ├── HostCallbackError           the jitted function calls back into Python (jax.debug.print,
    │                               pure_callback...): refused before upload (also a ValueError)
    ├── TransportError              no HTTP answer came back
    │   ├── ConnectError            the server could not be reached
    │   └── RequestTimeout          one HTTP exchange ran out of time (also a JitserveTimeout)
    ├── JitserveTimeout             a deadline passed (also builtins.TimeoutError)
    ├── ProtocolError               an answer that does not follow docs/api.md
    └── APIError                    the server answered 4xx/5xx {"error": {"code", "message"}}
        ├── BadRequest              400 bad_request, and any other unmapped 4xx
        │   ├── ProgramError        invalid_program, unsafe_program, limit_exceeded,
        │   │                       platform_mismatch, too_many_devices, signature_mismatch,
        │   │                       compile_failed, compile_timeout
        │   └── PayloadTooLarge     413 payload_too_large
        ├── Unauthorized            401 unauthorized
        ├── NotFound                404 not_found
        ├── TooManyRequests         429 too_many_requests (.retry_after seconds)
        ├── FutureError             a future that has no outputs to give
        │   ├── FuturePending       409 future_pending (not done yet)
        │   ├── FutureFailed        future_failed: its execution failed (.error)
        │   │   └── CompileError    ... because its program did not compile; .code is the
        │   │                       compiler's (compile_failed...); also a ProgramError
        │   ├── FutureCancelled     409 future_cancelled
        │   └── FutureExpired       410 future_expired
        └── ServerError             5xx

An ``APIError`` is chosen by the answer's ``code`` first, its status second, so a
code this client does not know still lands on the right branch. Every exception
carries ``request``: the ``httpx.Request`` that caused it (``None`` only for a
deadline that passed between requests).
"""

from __future__ import annotations

import builtins
from collections.abc import Mapping
from typing import Any, TypeVar

import httpx

from jitserve.wire import PROGRAM_ERRORS, ErrorCode

__all__ = [
    "APIError",
    "BadRequest",
    "CompileError",
    "ConnectError",
    "FutureCancelled",
    "FutureError",
    "FutureExpired",
    "FutureFailed",
    "FuturePending",
    "HostCallbackError",
    "JitserveError",
    "JitserveTimeout",
    "NotFound",
    "PayloadTooLarge",
    "ProgramError",
    "ProtocolError",
    "RequestTimeout",
    "ServerError",
    "TooManyRequests",
    "TransportError",
    "Unauthorized",
    "error_class",
    "error_from_response",
]


class JitserveError(Exception):
    """Base of every client error; ``request`` is the request that caused it."""

    def __init__(self, message: str, *, request: httpx.Request | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request = request


_E = TypeVar("_E", bound=BaseException)


def _raised_anew(e: _E) -> _E:
    """A copy of ``e`` to raise, for an error kept to be raised on every use of what it
    belongs to (a refused call's, on each use of its outputs): the same class, fields
    and cause, without calling its constructor. Raising the kept error itself hung on
    it the frames each raise went through, and the arrays in their locals, for as long
    as the call's other outputs lived (a program that caught the error and went on
    held its arrays past their last use)."""
    fresh = type(e).__new__(type(e), *e.args)
    fresh.__dict__.update(e.__dict__)
    fresh.__cause__, fresh.__suppress_context__ = e.__cause__, e.__suppress_context__
    return fresh


class HostCallbackError(JitserveError, ValueError):
    """The jitted function calls back into the caller's Python, which a server cannot do.

    ``jax.debug.print``, ``jax.debug.callback``, ``jax.pure_callback`` and
    ``jax.experimental.io_callback`` run Python of the calling process in the
    middle of the program. Return the value as an output and print or use it on
    the client; compute a ``pure_callback``'s value on the client, or in jax.numpy.
    """


class TransportError(JitserveError):
    """The request got no HTTP answer (connection refused, reset, timed out...)."""


class ConnectError(TransportError):
    """The server could not be reached."""


class JitserveTimeout(JitserveError, builtins.TimeoutError):
    """A deadline passed: a request, or waiting for a future's outputs."""


class RequestTimeout(TransportError, JitserveTimeout):
    """One HTTP exchange ran out of time (see ``Timeout``)."""


class ProtocolError(JitserveError):
    """The server's answer does not follow the API (wrong shape, undecodable body)."""


class APIError(JitserveError):
    """The server answered with an error document.

    Attributes:
      status_code: the HTTP status.
      code: the error code (``"not_found"``, ``"compile_failed"``...).
      details: the error document's other fields.
      response: the ``httpx.Response``.
    """

    def __init__(self, message: str, *, status_code: int, code: str,
                 details: Mapping[str, Any] | None = None,
                 request: httpx.Request | None = None,
                 response: httpx.Response | None = None) -> None:
        super().__init__(message, request=request)
        self.status_code = status_code
        self.code = code
        self.details: dict[str, Any] = dict(details or {})
        self.response = response

    def __str__(self) -> str:
        return f"{self.status_code} {self.code}: {self.message}"


class BadRequest(APIError):
    """The server refused the request as malformed (400, or another 4xx)."""


class ProgramError(BadRequest):
    """The program, or its inputs, cannot be compiled or run (the compiler's codes)."""


class PayloadTooLarge(BadRequest):
    """The request body is over the server's limit."""


class Unauthorized(APIError):
    """A missing or wrong API key, or a future created with another key."""


class NotFound(APIError):
    """Unknown, expired or deleted program or future id."""


class TooManyRequests(APIError):
    """The server is busy; ``retry_after`` says how many seconds to back off."""

    def __init__(self, message: str, *, retry_after: float | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.retry_after = retry_after


class FutureError(APIError):
    """A future that has no outputs to give."""


class FuturePending(FutureError):
    """The future is not done yet."""


class FutureFailed(FutureError):
    """The future's execution failed; ``error`` is the server's error document."""

    @property
    def error(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, **self.details}


class CompileError(FutureFailed, ProgramError):
    """The future failed because its program did not compile (or was refused by the compiler).

    Calls return before the compile ends, so a compile error arrives as the
    future's: ``code`` is the compiler's (``compile_failed``, ``compile_timeout``,
    ``unsafe_program``...), and ``except ProgramError`` catches it as it catches
    the same error answered to a request.
    """


class FutureCancelled(FutureError):
    """The future was cancelled (deleted before it ran)."""


class FutureExpired(FutureError):
    """The future's outputs were dropped after its time to live."""


class ServerError(APIError):
    """The server failed (5xx)."""


# By code first (the shared table of codes, jitserve.wire.ErrorCode), then by status.
_BY_CODE: dict[str, type[APIError]] = {  # ErrorCode is a str enum: plain strings look up
    ErrorCode.BAD_REQUEST: BadRequest, ErrorCode.UNAUTHORIZED: Unauthorized,
    ErrorCode.NOT_FOUND: NotFound, ErrorCode.PAYLOAD_TOO_LARGE: PayloadTooLarge,
    ErrorCode.TOO_MANY_REQUESTS: TooManyRequests, ErrorCode.FUTURE_PENDING: FuturePending,
    ErrorCode.FUTURE_FAILED: FutureFailed, ErrorCode.FUTURE_CANCELLED: FutureCancelled,
    ErrorCode.FUTURE_EXPIRED: FutureExpired, ErrorCode.REPLICA_LOST: FutureFailed,
    **{code: ProgramError for code in PROGRAM_ERRORS},
}

_BY_STATUS: dict[int, type[APIError]] = {
    401: Unauthorized, 403: Unauthorized, 404: NotFound, 413: PayloadTooLarge,
    429: TooManyRequests,
}


def error_class(status_code: int, code: str) -> type[APIError]:
    """The exception class for an error answer: by code, then by status."""
    if code in _BY_CODE:
        return _BY_CODE[code]
    if status_code >= 500:
        return ServerError
    return _BY_STATUS.get(status_code, BadRequest if status_code >= 400 else APIError)


def _retry_after(response: httpx.Response) -> float | None:
    try:
        return float(response.headers["retry-after"])
    except (KeyError, ValueError):
        return None  # absent, or an HTTP date: leave the choice to the caller


def error_from_response(response: httpx.Response, body: Any) -> APIError:
    """The ``APIError`` for a 4xx/5xx ``response`` whose decoded body is ``body``."""
    status = response.status_code
    err = body.get("error") if isinstance(body, Mapping) else None
    if isinstance(err, Mapping) and isinstance(err.get("code"), str):
        code, message = err["code"], str(err.get("message", ""))
        details = {k: v for k, v in err.items() if k not in ("code", "message")}
    else:  # not a jitserve error document (a proxy's page, say)
        code = "internal" if status >= 500 else f"http_{status}"
        message = _text(response) or response.reason_phrase
        details = {}
    cls = error_class(status, code)
    cause = details.get("cause")
    if cls is FutureFailed and isinstance(cause, Mapping) and cause.get("code") in PROGRAM_ERRORS:
        cls, code = CompileError, str(cause["code"])
    kw: dict[str, Any] = {"status_code": status, "code": code, "details": details,
                          "request": _request(response), "response": response}
    if cls is TooManyRequests:
        kw["retry_after"] = _retry_after(response)
    return cls(message, **kw)


def _text(response: httpx.Response) -> str:
    try:
        return response.text[:500]
    except (httpx.ResponseNotRead, UnicodeDecodeError, LookupError):
        return ""


def _request(response: httpx.Response) -> httpx.Request | None:
    try:
        return response.request
    except RuntimeError:  # a Response built by hand, with no request
        return None
