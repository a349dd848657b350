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

Messages quote what went wrong below them (a library's exception, a value from
the document) through ``first_line``, ``message_of`` and ``shorten``, which
bound the quote: hostile input can make either megabytes long.
"""

from __future__ import annotations

from typing import Any

from jitserve.wire import ErrorCode

__all__ = [
    "CompileFailed",
    "CompileTimeout",
    "CompilerError",
    "InvalidProgram",
    "LimitExceeded",
    "PlatformMismatch",
    "SignatureMismatch",
    "TooManyDevices",
    "UnsafeProgram",
    "first_line",
    "message_of",
    "shorten",
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


class TooManyDevices(CompilerError):
    code = ErrorCode.TOO_MANY_DEVICES


class SignatureMismatch(CompilerError):
    code = ErrorCode.SIGNATURE_MISMATCH


class CompileFailed(CompilerError):
    code = ErrorCode.COMPILE_FAILED


class CompileTimeout(CompilerError):
    code = ErrorCode.COMPILE_TIMEOUT


def shorten(obj: Any, limit: int = 80) -> str:
    """``repr(obj)`` cut to ``limit`` characters (``...`` marks a cut): enough to say which value."""
    return _cut(repr(obj), limit)


def first_line(e: BaseException, limit: int = 1000, *, typed: bool = False) -> str:
    """The first line of ``e``'s message (its type name when it has none), cut to ``limit``.

    ``typed`` puts the type name first (``TypeError: ...``), for errors of library
    code whose type says as much as its message (JAX's shape rules raise several).
    """
    lines = str(e).strip().splitlines()
    if not lines:
        return _cut(type(e).__name__, limit)
    return _cut(f"{type(e).__name__}: {lines[0]}" if typed else lines[0], limit)


def message_of(e: BaseException, limit: int = 2000) -> str:
    """``e``'s whole message (its type name when it has none), cut to ``limit``.

    For errors whose first line is only a heading: MLIR's ``Unable to parse module
    assembly:`` is followed by the diagnostics that say what was wrong.
    """
    return _cut(str(e).strip() or type(e).__name__, limit)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:max(limit - 3, 0)] + "..."
