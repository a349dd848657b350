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
    catalog        Catalog: what the executable caches hold, for operators
    redis/         the shared Redis tiers (loaded only when Redis is configured)
    errors         CompilerError and its subclasses
    trees          pytree structures as JSON
    _worker        compile worker processes (``_compile_worker``: their entry point)
"""

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
from jitserve.compiler.catalog import CacheState, Catalog, EntryPage
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
from jitserve.compiler.programs import Program, ProgramFormat
from jitserve.compiler.redis.settings import RedisSettings
from jitserve.compiler.safety import ALLOWED_CUSTOM_CALLS, Limits
from jitserve.wire import DTYPES, Aval

__all__ = [
    "ALLOWED_CUSTOM_CALLS",
    "Aval",
    "BlobKind",
    "CacheSecret",
    "CacheState",
    "CacheUnavailable",
    "Catalog",
    "CompileFailed",
    "CompileTimeout",
    "Compiler",
    "CompilerConfig",
    "CompilerError",
    "DTYPES",
    "DiskTier",
    "EXECUTABLES",
    "Entry",
    "EntryPage",
    "Executable",
    "InvalidProgram",
    "LimitExceeded",
    "Limits",
    "Lookup",
    "MemoryCache",
    "PROGRAMS",
    "PlatformMismatch",
    "Program",
    "ProgramFormat",
    "RedisSettings",
    "SharedTier",
    "SignatureMismatch",
    "StoredPrograms",
    "Tier",
    "TieredStore",
    "UnsafeProgram",
]
