"""jitserve's compiler: programs in, cached XLA executables out.

A pure library: decode a program (``jax_export``, ``stablehlo``, ``jaxpr``),
validate it (``safety``), key it (``keys``), compile it with XLA in a worker
process, and keep the executable in tiered caches (``cache``).
"""

from compiler.avals import DTYPES, Aval
from compiler.cache import DiskTier, Entry, MemoryCache, SharedTier, Tier
from compiler.compile import Compiler, CompilerConfig, Executable, Lookup
from compiler.errors import (
    CompileFailed,
    CompilerError,
    CompileTimeout,
    InvalidProgram,
    LimitExceeded,
    PlatformMismatch,
    SignatureMismatch,
    UnsafeProgram,
)
from compiler.programs import Program, ProgramFormat
from compiler.safety import ALLOWED_CUSTOM_CALLS, Limits

__all__ = [
    "ALLOWED_CUSTOM_CALLS",
    "Aval",
    "CompileFailed",
    "CompileTimeout",
    "Compiler",
    "CompilerConfig",
    "CompilerError",
    "DTYPES",
    "DiskTier",
    "Entry",
    "Executable",
    "InvalidProgram",
    "LimitExceeded",
    "Lookup",
    "MemoryCache",
    "PlatformMismatch",
    "Program",
    "ProgramFormat",
    "SharedTier",
    "SignatureMismatch",
    "Tier",
    "UnsafeProgram",
]
