"""jitserve's compiler: programs in, cached XLA executables out.

A pure library: decode a program (``jax_export``, ``stablehlo``, ``jaxpr``),
validate it (``safety``), key it (``keys``), compile it with XLA in a worker
process, and keep the executable in tiered caches (``cache``).
"""

from jitserve.compiler.cache import DiskTier, Entry, MemoryCache, SharedTier, Tier
from jitserve.compiler.compile import Compiler, CompilerConfig, Executable, Lookup
from jitserve.compiler.errors import (
    CompileFailed,
    CompilerError,
    CompileTimeout,
    InvalidProgram,
    LimitExceeded,
    PlatformMismatch,
    SignatureMismatch,
    UnsafeProgram,
)
from jitserve.compiler.programs import Program, ProgramFormat
from jitserve.compiler.safety import ALLOWED_CUSTOM_CALLS, Limits
from jitserve.wire import DTYPES, Aval

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
    "Limits",
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
