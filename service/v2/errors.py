"""Refusals of the v2 interfaces: one place that reads an exception as a code and a message.

The Open Inference Protocol's error answers are plainer than ``/v1``'s envelope:
``{"error": "<message>"}`` with the HTTP status on REST, a status code and its
details on gRPC. Both come from the same ``Refusal``: the code of a
``ServiceError`` or ``CompilerError`` (``jitserve.wire.ErrorCode``), whose HTTP
status is the wire's and whose gRPC status is ``GRPC_STATUS``'s name.
"""

from __future__ import annotations

import dataclasses
import logging

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException

from jitserve.compiler.errors import CompilerError
from jitserve.wire import ErrorCode, WireError

from ..errors import ServiceError

__all__ = ["CallFailed", "GRPC_STATUS", "Refusal", "refusal_of"]

log = logging.getLogger("jitserve.v2")

#: The gRPC status (``grpc.StatusCode`` member name) of each code; absent codes
#: are INVALID_ARGUMENT (4xx) or INTERNAL (5xx).
GRPC_STATUS: dict[ErrorCode, str] = {
    ErrorCode.NOT_FOUND: "NOT_FOUND",
    ErrorCode.UNAUTHORIZED: "UNAUTHENTICATED",
    ErrorCode.PAYLOAD_TOO_LARGE: "RESOURCE_EXHAUSTED",
    ErrorCode.TOO_MANY_REQUESTS: "RESOURCE_EXHAUSTED",
    ErrorCode.LIMIT_EXCEEDED: "RESOURCE_EXHAUSTED",
    ErrorCode.OUT_OF_MEMORY: "RESOURCE_EXHAUSTED",
    ErrorCode.UNSAFE_PROGRAM: "FAILED_PRECONDITION",
    ErrorCode.PLATFORM_MISMATCH: "FAILED_PRECONDITION",
    ErrorCode.TOO_MANY_DEVICES: "FAILED_PRECONDITION",
    ErrorCode.COMPILE_FAILED: "FAILED_PRECONDITION",
    ErrorCode.COMPILER_ERROR: "FAILED_PRECONDITION",
    ErrorCode.COMPILE_TIMEOUT: "DEADLINE_EXCEEDED",
    ErrorCode.EXECUTION_TIMEOUT: "DEADLINE_EXCEEDED",
    ErrorCode.FUTURE_CANCELLED: "CANCELLED",
    ErrorCode.FUTURE_FAILED: "ABORTED",
    ErrorCode.RUNTIME_CRASHED: "UNAVAILABLE",
    ErrorCode.RUNTIME_STOPPED: "UNAVAILABLE",
    ErrorCode.REPLICA_LOST: "UNAVAILABLE",
    ErrorCode.UNAVAILABLE: "UNAVAILABLE",
    ErrorCode.INTERNAL: "INTERNAL",
}


# Starlette's own refusals (no such route, wrong method) by status.
_HTTP_CODES = {c.status: c for c in (ErrorCode.NOT_FOUND, ErrorCode.METHOD_NOT_ALLOWED,
                                     ErrorCode.UNAUTHORIZED, ErrorCode.PAYLOAD_TOO_LARGE)}


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Why a v2 request was refused: its code, the caller-facing message, extra headers."""

    code: ErrorCode
    message: str
    headers: dict[str, str] | None = None

    @property
    def status(self) -> int:
        return self.code.status

    @property
    def grpc_status(self) -> str:
        return GRPC_STATUS.get(self.code, "INVALID_ARGUMENT" if self.status < 500 else "INTERNAL")


class CallFailed(ServiceError):
    """A v2 inference whose run failed, with the future's own error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        try:
            self.code = ErrorCode(code)
        except ValueError:
            self.code = ErrorCode.INTERNAL


def refusal_of(exc: Exception) -> Refusal:
    """The refusal ``exc`` stands for; an unexpected one is logged and answers ``internal``."""
    if isinstance(exc, ServiceError):
        return Refusal(exc.code, exc.message, exc.headers())
    if isinstance(exc, CompilerError):
        return Refusal(_code(exc.code), str(exc))
    if isinstance(exc, WireError):
        return Refusal(ErrorCode.BAD_REQUEST, f"bad request: {exc}")
    if isinstance(exc, RequestValidationError):
        where = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg', '')}"
                          for e in exc.errors()[:5])
        return Refusal(ErrorCode.BAD_REQUEST, f"invalid request: {where}")
    if isinstance(exc, HTTPException) and exc.status_code < 500:
        return Refusal(_HTTP_CODES.get(exc.status_code, ErrorCode.BAD_REQUEST), str(exc.detail))
    log.error("a v2 request failed unexpectedly", exc_info=exc)
    return Refusal(ErrorCode.INTERNAL, "internal server error")


def _code(code: str) -> ErrorCode:
    try:
        return ErrorCode(code)
    except ValueError:
        return ErrorCode.COMPILER_ERROR
