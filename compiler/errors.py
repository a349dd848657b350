"""The compiler's exceptions.

Every error a program can provoke is a ``CompilerError`` with a stable ``code``
that the service turns into a 4xx answer; the message names what is wrong::

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

    code = "compiler_error"


class InvalidProgram(CompilerError):
    code = "invalid_program"


class UnsafeProgram(CompilerError):
    code = "unsafe_program"


class LimitExceeded(CompilerError):
    code = "limit_exceeded"


class PlatformMismatch(CompilerError):
    code = "platform_mismatch"


class SignatureMismatch(CompilerError):
    code = "signature_mismatch"


class CompileFailed(CompilerError):
    code = "compile_failed"


class CompileTimeout(CompilerError):
    code = "compile_timeout"
