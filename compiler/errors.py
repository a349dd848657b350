"""The compiler's exceptions.

Every error a program can provoke is a ``CompilerError`` with a stable ``code``
(``jitserve.wire.ErrorCode``, which also gives its HTTP status) that the service
turns into a 4xx answer; the message names what is wrong::

    CompilerError
    ├── InvalidProgram      the bytes are not a program of the stated format
    ├── UnsafeProgram       a custom call, op or effect that is not allowed
    ├── LimitExceeded       too big: bytes, ops, nesting, tensor sizes
    ├── PlatformMismatch    the program was exported for other platforms
    ├── SignatureMismatch   the inputs do not fit the program's signature
    ├── CompileFailed       XLA refused the program (or crashed on it)
    └── CompileTimeout      the compile ran past its time limit
"""

from __future__ import annotations

from jitserve.wire import ErrorCode

__all__ = [
    "CompileFailed",
    "CompileTimeout",
    "CompilerError",
    "InvalidProgram",
    "LimitExceeded",
    "PlatformMismatch",
    "SignatureMismatch",
    "UnsafeProgram",
]


class CompilerError(Exception):
    """Base class: a program (or its inputs) that the compiler will not run."""

    code = ErrorCode.COMPILER_ERROR


class InvalidProgram(CompilerError):
    code = ErrorCode.INVALID_PROGRAM


class UnsafeProgram(CompilerError):
    code = ErrorCode.UNSAFE_PROGRAM


class LimitExceeded(CompilerError):
    code = ErrorCode.LIMIT_EXCEEDED


class PlatformMismatch(CompilerError):
    code = ErrorCode.PLATFORM_MISMATCH


class SignatureMismatch(CompilerError):
    code = ErrorCode.SIGNATURE_MISMATCH


class CompileFailed(CompilerError):
    code = ErrorCode.COMPILE_FAILED


class CompileTimeout(CompilerError):
    code = ErrorCode.COMPILE_TIMEOUT
