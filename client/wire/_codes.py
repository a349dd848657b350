"""Error codes with their HTTP statuses, and the statuses of a future.

Every 4xx/5xx answer is ``{"error": {"code": str, "message": str, ...}}``
(docs/api.md, "Errors"). The service answers each code with the status below;
the client picks its exception by the code first and the status second, so a code
added here later still lands on the right branch of an older client.
"""

from __future__ import annotations

import enum
from typing import Final

__all__ = ["ERROR_STATUS", "ErrorCode", "FutureStatus", "PROGRAM_ERRORS"]


class ErrorCode(enum.StrEnum):
    """The ``code`` of an error document; ``status`` is its HTTP status."""

    # the request itself
    BAD_REQUEST = "bad_request"
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    NOT_FOUND = "not_found"
    METHOD_NOT_ALLOWED = "method_not_allowed"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    TOO_MANY_REQUESTS = "too_many_requests"
    # a program, or its inputs (the compiler's codes)
    INVALID_PROGRAM = "invalid_program"
    SIGNATURE_MISMATCH = "signature_mismatch"
    UNSAFE_PROGRAM = "unsafe_program"
    LIMIT_EXCEEDED = "limit_exceeded"
    PLATFORM_MISMATCH = "platform_mismatch"
    TOO_MANY_DEVICES = "too_many_devices"
    COMPILE_FAILED = "compile_failed"
    COMPILE_TIMEOUT = "compile_timeout"
    COMPILER_ERROR = "compiler_error"
    # a program whose signature cannot batch calls (docs/batching.md)
    NOT_BATCHABLE = "not_batchable"
    # a future
    FUTURE_PENDING = "future_pending"
    FUTURE_FAILED = "future_failed"
    FUTURE_CANCELLED = "future_cancelled"
    FUTURE_EXPIRED = "future_expired"
    # the server
    EXECUTION_TIMEOUT = "execution_timeout"
    RUNTIME_CRASHED = "runtime_crashed"
    RUNTIME_STOPPED = "runtime_stopped"
    REPLICA_LOST = "replica_lost"
    OUT_OF_MEMORY = "out_of_memory"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"

    @property
    def status(self) -> int:
        return ERROR_STATUS[self]


ERROR_STATUS: Final[dict[ErrorCode, int]] = {
    ErrorCode.BAD_REQUEST: 400,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorCode.UNAUTHORIZED: 401,
    # A valid key without the right: an admin route (JITSERVE_ADMIN_KEYS).
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.TOO_MANY_REQUESTS: 429,
    # Not a valid request: the bytes are no program, or the inputs do not fit it.
    ErrorCode.INVALID_PROGRAM: 400,
    ErrorCode.SIGNATURE_MISMATCH: 400,
    # Understood, but refused.
    ErrorCode.UNSAFE_PROGRAM: 422,
    ErrorCode.LIMIT_EXCEEDED: 422,
    ErrorCode.PLATFORM_MISMATCH: 422,
    # A sharded program needs more devices than any runtime of the server has.
    ErrorCode.TOO_MANY_DEVICES: 422,
    ErrorCode.COMPILE_FAILED: 422,
    ErrorCode.COMPILE_TIMEOUT: 422,
    ErrorCode.COMPILER_ERROR: 422,
    ErrorCode.NOT_BATCHABLE: 422,
    ErrorCode.FUTURE_PENDING: 409,
    ErrorCode.FUTURE_FAILED: 422,
    ErrorCode.FUTURE_CANCELLED: 409,
    ErrorCode.FUTURE_EXPIRED: 410,
    # A future's failure, also the answer where a call waited for it.
    ErrorCode.EXECUTION_TIMEOUT: 504,
    ErrorCode.RUNTIME_CRASHED: 502,
    # Stopped with its runtime, which the server killed for another's sake: a run
    # beside it passed its deadline, or every run there was cancelled.
    ErrorCode.RUNTIME_STOPPED: 502,
    # The replica that held a future's data stopped (crashed, or drained and left).
    ErrorCode.REPLICA_LOST: 502,
    ErrorCode.OUT_OF_MEMORY: 422,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.INTERNAL: 500,
}

#: The codes that say a program (or its inputs) cannot be compiled or run.
PROGRAM_ERRORS: Final = frozenset({
    ErrorCode.INVALID_PROGRAM, ErrorCode.SIGNATURE_MISMATCH, ErrorCode.UNSAFE_PROGRAM,
    ErrorCode.LIMIT_EXCEEDED, ErrorCode.PLATFORM_MISMATCH, ErrorCode.TOO_MANY_DEVICES,
    ErrorCode.COMPILE_FAILED, ErrorCode.COMPILE_TIMEOUT, ErrorCode.COMPILER_ERROR,
})


class FutureStatus(enum.StrEnum):
    """Where an execution stands (the ``status`` of a future).

    ``compiling``: its executable is being compiled (or loaded); then ``pending``
    (waiting to run), ``running``, and one of the final three.
    """

    COMPILING = "compiling"
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self in _FINAL


_FINAL = (FutureStatus.DONE, FutureStatus.FAILED, FutureStatus.CANCELLED)
