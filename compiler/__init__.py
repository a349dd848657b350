"""jitserve's compiler: programs in, cached XLA executables out.

A pure library: decode a program (``jax_export``, ``stablehlo``, ``jaxpr``),
validate it (``safety``), key it (``keys``), compile it with XLA in a worker
process, and keep programs and executables in tiered caches (``cache``)::

    compile        Compiler, CompilerConfig, Executable, Lookup: the entry point
    programs       Program and the formats' decoders; ``lower`` to StableHLO
    program_store  StoredPrograms: uploaded programs by id, through the tiers
    jaxpr/         the jaxpr document decoder
    stablehlo      parse modules, read and specialize ``@main``
    safety         Limits and the allowlists an untrusted program must pass
    keys           the cache key (sha256 over named parts)
    cache          one tier mechanism for every blob kind: TieredStore, MemoryCache,
                   DiskTier, the Tier protocol; executable entry framing, signed
                   with a CacheSecret
    catalog        Catalog: what the executable caches hold, for operators (their
                   LoadedExecutable records)
    redis/         the shared Redis tiers (loaded only when Redis is configured)
    errors         CompilerError and its subclasses
    trees          pytree structures as JSON
    _worker        compile worker processes (``_compile_worker``: their entry point)

Every name below loads on first use: importing ``jitserve.compiler`` (for a file-only
tool such as ``jitserve cache``, which uses ``compiler.disk``) does not import jax.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jitserve.compiler.cache import (
        EXECUTABLES,
        PROGRAMS,
        BlobKind,
        CacheSecret,
        CacheUnavailable,
        DiskTier,
        Entry,
        MemoryCache,
        SharedTier,
        Tier,
        TieredStore,
    )
    from jitserve.compiler.catalog import CacheState, Catalog, EntryPage, LoadedExecutable
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
    from jitserve.compiler.program_store import StoredPrograms
    from jitserve.compiler.records import Limits, Program
    from jitserve.compiler.redis.settings import RedisSettings
    from jitserve.compiler.safety import ALLOWED_CUSTOM_CALLS
    from jitserve.wire import DTYPES, Aval, ProgramFormat

# Each public name and the module that defines it.
_EXPORTS: dict[str, str] = {
    "ALLOWED_CUSTOM_CALLS": "jitserve.compiler.safety",
    "Aval": "jitserve.wire",
    "BlobKind": "jitserve.compiler.cache",
    "CacheSecret": "jitserve.compiler.cache",
    "CacheState": "jitserve.compiler.catalog",
    "CacheUnavailable": "jitserve.compiler.cache",
    "Catalog": "jitserve.compiler.catalog",
    "CompileFailed": "jitserve.compiler.errors",
    "CompileTimeout": "jitserve.compiler.errors",
    "Compiler": "jitserve.compiler.compile",
    "CompilerConfig": "jitserve.compiler.compile",
    "CompilerError": "jitserve.compiler.errors",
    "DTYPES": "jitserve.wire",
    "DiskTier": "jitserve.compiler.cache",
    "EXECUTABLES": "jitserve.compiler.cache",
    "Entry": "jitserve.compiler.cache",
    "EntryPage": "jitserve.compiler.catalog",
    "Executable": "jitserve.compiler.compile",
    "InvalidProgram": "jitserve.compiler.errors",
    "LimitExceeded": "jitserve.compiler.errors",
    "Limits": "jitserve.compiler.records",
    "LoadedExecutable": "jitserve.compiler.catalog",
    "Lookup": "jitserve.compiler.compile",
    "MemoryCache": "jitserve.compiler.cache",
    "PROGRAMS": "jitserve.compiler.cache",
    "PlatformMismatch": "jitserve.compiler.errors",
    "Program": "jitserve.compiler.records",
    "ProgramFormat": "jitserve.wire",
    "RedisSettings": "jitserve.compiler.redis.settings",
    "SharedTier": "jitserve.compiler.cache",
    "SignatureMismatch": "jitserve.compiler.errors",
    "StoredPrograms": "jitserve.compiler.program_store",
    "Tier": "jitserve.compiler.cache",
    "TieredStore": "jitserve.compiler.cache",
    "UnsafeProgram": "jitserve.compiler.errors",
}

# Written out (mypy reads a literal list only); the same names as _EXPORTS's keys
# (tests/test_layout.py).
__all__ = [
    "ALLOWED_CUSTOM_CALLS", "Aval", "BlobKind", "CacheSecret", "CacheState",
    "CacheUnavailable", "Catalog", "CompileFailed", "CompileTimeout", "Compiler",
    "CompilerConfig", "CompilerError", "DTYPES", "DiskTier", "EXECUTABLES", "Entry",
    "EntryPage", "Executable", "InvalidProgram", "LimitExceeded", "Limits",
    "LoadedExecutable", "Lookup", "MemoryCache", "PROGRAMS", "PlatformMismatch",
    "Program", "ProgramFormat", "RedisSettings", "SharedTier", "SignatureMismatch",
    "StoredPrograms", "Tier", "TieredStore", "UnsafeProgram",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'jitserve.compiler' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
