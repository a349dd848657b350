"""The compiler: programs and concrete avals in, loaded XLA executables out.

``Compiler.lookup`` resolves a program for concrete input avals through the
tiers: L1 (loaded executables in this process), the L2 tiers (serialized
executables: disk by default, Redis when configured), then an XLA compile in a
worker process; ``compiler.cache.TieredStore`` reads through them and fills the
faster ones on a hit. Uploaded programs go through the same tiers
(``Compiler.programs``), and ``Compiler.catalog`` lists what is cached.
Concurrent lookups of one key share a single flight: one caller compiles, the
others wait for its result. With a shared tier (``SharedTier``, e.g. Redis) the
flight spans processes: one process compiles under the tier's lock, the others
wait for the entry to appear and load it. Lookups block; a server calls them
from a thread pool so its event loop stays free.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import jax
import jaxlib
from jax._src.lib import xla_client as xc
from jax.extend import backend as xb

from jitserve.compiler import stablehlo
from jitserve.compiler._worker import CompilePool, compile_options, configure_jax
from jitserve.compiler.cache import (
    EXECUTABLES,
    PROGRAMS,
    BlobKind,
    CacheSecret,
    CorruptEntry,
    DiskTier,
    Entry,
    ForeignEntry,
    MemoryCache,
    SharedTier,
    Tier,
    TieredStore,
    decode_entry,
    encode_entry,
)
from jitserve.compiler.catalog import Catalog
from jitserve.compiler.disk import DEFAULT_MAX_BYTES, DiskBudget
from jitserve.compiler.errors import (
    CompileFailed,
    InvalidProgram,
    LimitExceeded,
    SignatureMismatch,
    TooManyDevices,
)
from jitserve.compiler.keys import (
    Backend,
    KeyHistory,
    cache_key,
    key_parts,
    nearest_reasons,
    options_digest,
)
from jitserve.compiler.options import check_compiler_options, overrides_text
from jitserve.compiler.program_store import StoredPrograms
from jitserve.compiler.programs import decode_program, lower
from jitserve.compiler.records import Limits, MemoryStats, Program, check_donate, check_inputs
from jitserve.compiler.redis.settings import RedisSettings
from jitserve.compiler.safety import check_module
from jitserve.wire import DTYPES, Aval, TierName, carried_outputs

if TYPE_CHECKING:
    from jitserve.compiler.redis.tiers import RedisTiers

__all__ = ["Compiler", "CompilerConfig", "Executable", "Lookup", "cost_of"]

logger = logging.getLogger("jitserve.compiler")

_EXECUTABLE_ID = re.compile(r"[0-9a-f]{64}")
# A call's XLA options, checked and sorted (``compiler.options.check_compiler_options``).
Overrides = tuple[tuple[str, Any], ...]


@dataclasses.dataclass(frozen=True)
class CompilerConfig:
    """How a ``Compiler`` caches and compiles.

    Attributes:
      cache_dir: root of the disk tier; ``None`` for no disk tier.
      l1_max_entries, l1_max_bytes: bounds of the in-process cache of loaded
        executables (bytes as serialized).
      programs_max_entries, programs_max_bytes: bounds of the in-process cache of
        decoded programs (bytes as uploaded).
      compile_timeout_s: a compile past this is stopped (its worker is killed).
      compile_workers: compiles that may run at once, each in its own process.
      limits: what an untrusted program may be (``compiler.records.Limits``).
      redis: the deployment's shared Redis (``compiler.redis.RedisSettings``), an
        L2 tier after the disk for executables and programs, which also elects
        one compiler per key across processes; ``None`` for none. An unreachable
        Redis does not stop the start: its tiers begin degraded and retry.
      cache_secret: signs the executable entries of every L2 tier (HMAC over
        key and body, ``compiler.cache.CacheSecret``), so an entry loads only
        under the key it was made for. ``None``: a random secret kept in
        ``cache_dir`` (made once, mode 0600, reused after restarts), or one of
        this process alone without a ``cache_dir``. Required with ``redis``:
        every process sharing the Redis must sign with the same secret.
      disk_max_bytes: bound of the disk tier's blobs (executables and programs
        together); past it the least recently used are evicted
        (``compiler.disk.DiskBudget``), and a lookup of one recompiles.
      program_devices: the most devices an uploaded program may need (a server's
        largest device group); ``None``: this process's devices. A program for more
        devices than this process has decodes, but does not compile here.
    """

    cache_dir: Path | None = None
    l1_max_entries: int = 256
    l1_max_bytes: int = 1 << 30
    programs_max_entries: int = 256
    programs_max_bytes: int = 1 << 30
    compile_timeout_s: float = 120.0
    compile_workers: int = 1
    limits: Limits = Limits()
    redis: RedisSettings | None = None
    cache_secret: CacheSecret | None = None
    disk_max_bytes: int = DEFAULT_MAX_BYTES
    program_devices: int | None = None

    def __post_init__(self) -> None:
        if self.redis is not None and self.cache_secret is None:
            raise ValueError(
                "CompilerConfig.redis is set but cache_secret is not: every process sharing a "
                "Redis must sign its entries with the same secret (CacheSecret.from_value)")


def cost_of(loaded: Any) -> dict[str, float] | None:
    """XLA's cost analysis of a loaded executable: ``flops``, ``transcendentals`` and
    ``bytes_accessed`` (estimates for one run); ``None`` where the backend gives none."""
    try:
        analysis = loaded.cost_analysis()
        if isinstance(analysis, list):  # one per module in some jaxlib versions
            analysis = analysis[0] if analysis else {}
        cost = {"flops": analysis.get("flops"), "transcendentals": analysis.get("transcendentals"),
                "bytes_accessed": analysis.get("bytes accessed")}
    except Exception as e:  # a backend without cost analysis: nothing to report
        logger.debug("no cost analysis for an executable: %s", e)
        return None
    return {k: float(v) for k, v in cost.items() if isinstance(v, (int, float))}


class Executable:
    """A loaded executable with its static signature. ``run`` is safe from any thread.

    ``memory`` is XLA's account of the device bytes one run needs (``MemoryStats``),
    or ``None`` where the backend gives none; it is also in ``meta["memory"]``.
    ``meta["cost"]`` is XLA's cost analysis (``cost_of``), made at compile time.
    """

    def __init__(self, loaded: Any, executable_id: str, meta: dict[str, Any], nbytes: int,
                 devices: Sequence[Any] = (), serialized: bytes | None = None) -> None:
        self._loaded = loaded
        self.executable_id = executable_id
        # The devices one run takes, in the order it was loaded on (the first of the
        # process for a single-device executable).
        self.devices = tuple(devices)
        self.device_count = max(1, len(self.devices))
        self._shardings: tuple[tuple[Any, ...], tuple[Any, ...]] | None = None
        # A single-device executable of a process with several devices keeps its bytes,
        # to be loaded onto the others too (``Compiler.on_device``), and those copies.
        self.serialized = serialized
        self.copies: dict[tuple[int, ...], Executable] = {}
        self.in_avals = tuple(Aval.from_json(a) for a in meta["in_avals"])
        self.out_avals = tuple(Aval.from_json(a) for a in meta["out_avals"])
        self.out_tree = meta.get("out_tree")
        # An entry's meta has the stats its compile measured (for this jaxlib and device
        # kind, which the entry must match to load): a hit reuses them, since asking the
        # loaded executable again costs 5-10% of the hit (docs/redis.md, "What a hit costs").
        self.memory = MemoryStats.from_json(meta.get("memory")) or MemoryStats.of(loaded)
        if self.memory is not None:
            meta["memory"] = self.memory.to_json()
        if meta.get("cost") is None:  # an entry from before cost analyses were kept
            meta["cost"] = cost_of(loaded)
        self.meta = meta
        self.nbytes = nbytes
        # The bytes of one run's outputs, and those whose values come back with its
        # answer (``wire.carried_outputs``), known once (``None`` if a shape is not).
        static = all(a.is_static for a in self.out_avals)
        self.out_nbytes = sum(a.nbytes for a in self.out_avals) if static else None
        self.carried = (carried_outputs([a.nbytes for a in self.out_avals]) if static
                        else None)

    @property
    def loaded(self) -> Any:
        """jaxlib's ``LoadedExecutable``: its shardings, layouts and stats (``service.runtimes.ifrt``)."""
        return self._loaded

    def check_inputs(self, avals: Sequence[Aval]) -> None:
        """Raise ``SignatureMismatch`` naming the first input that does not fit."""
        check_inputs(self.in_avals, avals)

    @property
    def in_shardings(self) -> tuple[Any, ...]:
        """Where each input must be for a run of a sharded executable (jax ``Sharding``s):
        the compiled parameter shardings, which hold for raw StableHLO too."""
        return self._sharded()[0]

    @property
    def out_shardings(self) -> tuple[Any, ...]:
        """How each output of a sharded executable is laid out on its devices."""
        return self._sharded()[1]

    def _sharded(self) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        if self._shardings is None:
            from jax._src.sharding_impls import GSPMDSharding

            def of(shardings: Sequence[Any] | None, n: int) -> tuple[Any, ...]:
                # None: replicas (num_replicas > 1), each device a whole copy: each input
                # goes to every one, and replica 0's outputs are the answer.
                if shardings is None:
                    return (GSPMDSharding.get_replicated(self.devices),) * n
                return tuple(GSPMDSharding(self.devices, s) for s in shardings)

            loaded = self._loaded
            self._shardings = (of(loaded.get_parameter_shardings(), len(self.in_avals)),
                               of(loaded.get_output_shardings(), len(self.out_avals)))
        return self._shardings

    def run(self, args: Sequence[jax.Array]) -> list[jax.Array]:
        """Dispatch on the device(s); the outputs are device arrays, possibly not ready
        yet: of a sharded executable, global arrays over its devices. Its inputs must
        be placed as ``in_shardings`` says."""
        results = self._loaded.execute_sharded(list(args))
        handlers = self._handlers
        if handlers is not None:
            return cast(list[jax.Array], results.consume_with_handlers(handlers))
        shards = results.disassemble_into_single_device_arrays()
        if self.device_count == 1:
            return [pieces[0] for pieces in shards]
        return [jax.make_array_from_single_device_arrays(cast(tuple[int, ...], aval.shape),
                                                         sharding, pieces)
                for aval, sharding, pieces in zip(self.out_avals, self.out_shardings, shards)]

    @functools.cached_property
    def _handlers(self) -> list[Any] | None:
        """jaxlib's result handlers of a single-device executable's outputs, made once, as
        jax's own dispatch makes them: a run's outputs then come out as arrays in one
        call. Taking them apart instead (``disassemble_into_single_device_arrays``)
        cost about 5 us of CPU per output (a run of 64 outputs on this machine:
        166-241 us against 477-543 us of execute and outputs). ``None`` where they do
        not apply (several devices, no outputs, a shape not static), or this jax
        lacks them: the outputs are taken apart then."""
        if self.device_count == 1 and self.out_avals and all(a.is_static
                                                             for a in self.out_avals):
            try:
                from jax._src import core
                from jax._src.interpreters import pxla

                device = self.devices[0] if self.devices else self._loaded.local_devices()[0]
                sharding = jax.sharding.SingleDeviceSharding(device)
                return [pxla.global_aval_to_result_handler(
                    core.ShapedArray(cast(tuple[int, ...], a.shape), DTYPES[a.dtype],
                                     weak_type=a.weak_type), sharding, True)
                    for a in self.out_avals]
            except Exception as e:  # noqa: BLE001 - another jax: taken apart, as before
                logger.debug("no result handlers for executable %s: %s", self.executable_id, e)
        return None


def sharding_doc(executable: Executable, partitions: int, replicas: int) -> dict[str, Any]:
    """How a sharded executable lays out its inputs and outputs on its devices, for
    records and accounting: its counts, each parameter's and output's HLO sharding as
    text, and the device bytes each output takes on all its devices together (a
    replicated output costs as many times its size as it has copies)."""
    out_bytes = []
    for aval, sharding in zip(executable.out_avals, executable.out_shardings):
        shard = sharding.shard_shape(cast(tuple[int, ...], aval.shape))  # one per device
        out_bytes.append(math.prod(shard) * DTYPES[aval.dtype].itemsize * executable.device_count)
    return {"device_count": partitions * replicas, "partitions": partitions,
            "replicas": replicas, "in": hlo_text(executable.in_shardings, executable.in_avals),
            "out": hlo_text(executable.out_shardings, executable.out_avals),
            "out_device_bytes": out_bytes}


def hlo_text(shardings: Sequence[Any], avals: Sequence[Aval]) -> list[str]:
    """Each sharding as HLO sharding text (``{devices=[2,2]<=[4]}``, ``{replicated}``)."""
    return [str(s._to_xla_hlo_sharding(len(a.shape))) for s, a in zip(shardings, avals)]


@dataclasses.dataclass(frozen=True)
class Lookup:
    """The answer to ``Compiler.lookup``.

    Attributes:
      tier: who answered: ``memory``, an L2 tier's name (``disk``, ``redis``), or
        ``compiled``. A caller that waited on another caller's compile sees ``memory``.
      compile_seconds: seconds spent compiling for this lookup (0 unless ``compiled``).
    """

    executable: Executable
    executable_id: str
    tier: str
    compile_seconds: float


class Compiler:
    """Decodes, validates, compiles and caches programs for this host's first device.

    Attributes:
      programs: uploaded programs by id, kept in the same tiers as executables
        (``compiler.program_store.StoredPrograms``).
      catalog: what the executable caches hold, for operators (``compiler.catalog.Catalog``).

    Example::

        compiler = Compiler(CompilerConfig(cache_dir=Path("/var/cache/jitserve")))
        program = compiler.decode(exported.serialize())
        lookup = compiler.lookup(program)            # compiles, or hits a cache
        outs = lookup.executable.run([jax.device_put(x, compiler.device)])
    """

    def __init__(self, config: CompilerConfig | None = None) -> None:
        self.config = config or CompilerConfig()
        configure_jax()
        self._backend = xb.get_backend()
        # A sharded program runs on the first nr_devices of these; any other on the first.
        self.devices: tuple[Any, ...] = tuple(self._backend.devices())
        self.device = self.devices[0]
        self._options = compile_options()
        self._key_backend = Backend(
            platform=self.platform, platform_version=self._backend.platform_version,
            runtime_type=self._backend.runtime_type, device_kind=self.device.device_kind,
            device_count=1, options_digest=options_digest(self._options))
        self._secret = _cache_secret(self.config)
        self._shared = _open_redis(self.config.redis, self._secret)
        self._disk_budget = (DiskBudget(self.config.cache_dir, self.config.disk_max_bytes)
                             if self.config.cache_dir else None)
        self._executables: TieredStore[Executable] = TieredStore(
            EXECUTABLES, self._l2_tiers(EXECUTABLES),
            MemoryCache(self.config.l1_max_entries, self.config.l1_max_bytes),
            self._load_executable, lambda e: e.nbytes)
        self.programs = StoredPrograms(
            self._l2_tiers(PROGRAMS),
            MemoryCache(self.config.programs_max_entries, self.config.programs_max_bytes),
            self.decode)
        self.catalog = Catalog(self.loaded, self._shared)
        self._pool = CompilePool(workers=self.config.compile_workers,
                                 timeout_s=self.config.compile_timeout_s,
                                 platform=self.platform)
        self._inflight: dict[str, concurrent.futures.Future[Executable]] = {}
        self._lock = threading.Lock()
        self._compilations = 0
        self._history = KeyHistory()  # each program's keys' parts: why a compile happened
        self._sharded_backends: dict[int, Backend] = {}  # _backend_for, by device count

    @property
    def platform(self) -> str:
        """The lowering platform: ``cpu``, ``cuda``, ``rocm`` or ``tpu``.

        Not the backend's own name, which is ``gpu`` for both kinds of GPU: exports
        name the platform they were lowered for, and a CUDA export must not load
        on ROCm.
        """
        return jax.export.default_export_platform()

    def backend_info(self) -> dict[str, Any]:
        return {"platform": self.platform, "platform_version": self._backend.platform_version,
                "device_kind": self.device.device_kind, "device_count": len(self.devices),
                "jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__}

    def warm(self) -> None:
        """Start a compile worker ahead of the first compile (blocks until it is up)."""
        self._pool.warm()

    def decode(self, data: bytes, format: str | None = None) -> Program:
        """Decode and validate an uploaded program (``compiler.programs.decode_program``)."""
        return decode_program(data, format, platform=self.platform, limits=self.config.limits,
                              devices=self.config.program_devices or len(self.devices))

    def lookup(self, program: Program, in_avals: Sequence[Aval] | None = None,
               static_key: str = "", donate: Sequence[int] = (), scope: str = "", *,
               overrides: Mapping[str, Any] | None = None) -> Lookup:
        """The executable of ``program`` for ``in_avals`` (default: the program's own).

        ``donate``: the inputs the executable may consume (XLA buffer donation, as
        ``jax.jit``'s ``donate_argnums``): an output of the same type reuses its
        buffer. A run must pass it a buffer nobody else holds.

        ``scope``: the tenant asking, when tenants do not share executables: its keys
        are its own (``keys.key_parts``), so nothing it observes (tier, timings,
        recompile reasons) depends on another tenant's calls. An executable of no
        scope (one the operator warmed) serves it too: that says nothing of others.

        ``overrides``: the caller's XLA options (``jax.jit``'s ``compiler_options``),
        of those ``compiler.options`` allows (``InvalidProgram`` for any other).
        """
        if program.nr_devices > len(self.devices):
            raise TooManyDevices(f"program needs {program.nr_devices} devices; this runtime has "
                                 f"{len(self.devices)}")
        concrete = self._concrete_avals(program, in_avals)
        donate = check_donate(donate, len(concrete))
        chosen = check_compiler_options(overrides)
        parts = self._parts(program, concrete, static_key, donate, scope, chosen)
        key = cache_key(parts)

        def resolve() -> Lookup:
            if scope:
                public = self._key(program, concrete, static_key, donate, "", chosen)
                hit = self._executables.cached(public)
                found = (Lookup(hit, public, TierName.MEMORY, 0.0) if hit is not None
                         else self._from_tiers(public))
                if found is not None:
                    return found
            lookup = self._resolve(program, concrete, static_key, donate, key, parts, chosen)
            self._history.record(program.program_id, key, parts,
                                 lookup.executable.meta.get("created"))
            return lookup

        return self._single_flight(key, resolve)

    def _single_flight(self, key: str, resolve: Callable[[], Lookup]) -> Lookup:
        """L1's hit for ``key``, or ``resolve()``'s, called by one thread while others
        asking for the same key wait for it."""
        hit = self._executables.cached(key)
        if hit is not None:
            return Lookup(hit, key, TierName.MEMORY, 0.0)
        future, leader = self._join_flight(key)
        if not leader:
            return Lookup(future.result(), key, TierName.MEMORY, 0.0)
        try:
            lookup = resolve()
        except BaseException as e:
            future.set_exception(e)
            raise
        finally:
            with self._lock:
                self._inflight.pop(key, None)
        future.set_result(lookup.executable)
        return lookup

    def server_options(self) -> bytes:
        """This server's compile options, serialized: where a client's sanitized ones start
        (``compiler.ifrt.sanitize_options``)."""
        serialized: bytes = self._options.SerializeAsString()
        return serialized

    def lookup_module(self, data: bytes, options: bytes, *, compile: bool = True,
                      scope: str = "") -> Lookup | None:
        """The executable of a whole StableHLO module compiled with ``options``: an IFRT
        proxy client's program (``service.runtimes.ifrt``).

        ``data``: MLIR bytecode, text or a portable artifact, checked as any upload is
        (``safety``: limits, op and custom-call allowlists); ``options``: a serialized
        ``CompileOptionsProto``, already sanitized. Its device assignment says which of
        this process's devices the executable runs on (the first, without one); the key
        has the module's bytes, the options' digest with the assignment made the first
        devices in order (``_normalized``), and this backend's parts for that many
        devices, so a second session, process or replica finds it in the tiers whatever
        devices it asks for. ``compile=False``: ``None`` rather than a compile when no
        tier has it (a tenant out of compiles). ``scope``: the tenant's, as ``lookup``'s.
        """
        import hashlib

        options, partitions, replicas, devices = self._normalized(options)
        n = partitions * replicas
        limits = self.config.limits
        with stablehlo.new_context() as ctx:
            module = stablehlo.parse_module(data, ctx, limits)
            check_module(module, limits, static=True)
            in_avals, out_avals = stablehlo.main_signature(module, tokens=True)
            out_tokens = [i for i, t in enumerate(stablehlo.main_result_types(module))
                          if str(t) == "!stablehlo.token"]
            bytecode = stablehlo.to_bytecode(module)
            name = stablehlo.module_name(module)
        program_id = hashlib.sha256(data).hexdigest()
        # jax lowers a function again for each signature, so each is another module: its
        # compiles are remembered by the module's name ("jit_train_step"), and a new
        # signature of it says so (recompiled_because), as a /v1 program's does.
        history_id = f"ifrt:{name}" if name else program_id
        backend = dataclasses.replace(self._backend_for(n),
                                      options_digest=hashlib.sha256(options).hexdigest())
        parts = key_parts(program_id=program_id, in_avals=in_avals, static_key="ifrt",
                          backend=backend, scope=scope)
        key = cache_key(parts)

        def on_assigned(found: Lookup | None) -> Lookup | None:
            if found is None:
                return None
            return dataclasses.replace(found, executable=self.on_devices(found.executable, devices))

        if not compile:
            cached = self._executables.cached(key)
            return on_assigned(Lookup(cached, key, TierName.MEMORY, 0.0) if cached
                               else self._from_tiers(key))

        def resolve() -> Lookup:
            hit = self._from_tiers(key)
            if hit is not None:
                return hit
            with self._shared_flight(key) as should_compile:
                hit = None if should_compile else self._from_tiers(key)
                if hit is not None:
                    return hit
                start = time.perf_counter()
                serialized = self._pool.compile(bytecode, options)
                self._compilations += 1
                meta = {**self._expected_meta(key), "program_id": program_id, "format": "ifrt",
                        "name": name, "static_key": "ifrt", "in_avals": [a.to_json() for a in in_avals],
                        "out_avals": [a.to_json() for a in out_avals], "out_tree": None,
                        "out_tokens": out_tokens, "created": time.time(),
                        "key_parts": dict(parts),
                        "recompiled_because": _ifrt_reasons(
                            self._recompile_reasons(history_id, key, parts)),
                        "device_count": n, "partitions": partitions, "replicas": replicas}
                meta["compile_seconds"] = seconds = time.perf_counter() - start
                executable = Executable(self._deserialize(serialized, meta), key, meta,
                                        len(serialized), self.devices[:n], self._kept(serialized, n))
                if n > 1:
                    meta["sharding"] = sharding_doc(executable, partitions, replicas)
                self._executables.put(key, encode_entry(key, Entry(serialized, meta), self._secret),
                                      executable)
                return Lookup(executable, key, TierName.COMPILED, seconds)

        def resolve_and_record() -> Lookup:
            lookup = resolve()
            self._history.record(history_id, key, parts, lookup.executable.meta.get("created"))
            return lookup

        return on_assigned(self._single_flight(key, resolve_and_record))

    def _normalized(self, options: bytes) -> tuple[bytes, int, int, tuple[Any, ...]]:
        """IFRT compile ``options`` with their device assignment made this process's first
        devices in order (what the key hashes and the worker compiles with), their
        partitions and replicas, and the devices they assigned (run order: replica-major,
        as XLA numbers them); ``InvalidProgram`` for devices this process has not."""
        from jitserve.compiler.ifrt_protos import message

        proto = message("xla.CompileOptionsProto").FromString(options)
        build = proto.executable_build_options
        partitions, replicas = max(1, build.num_partitions), max(1, build.num_replicas)
        n = partitions * replicas
        if n > len(self.devices):
            raise TooManyDevices(f"program needs {n} devices; this runtime has {len(self.devices)}")
        by_id = {d.id: d for d in self.devices}
        if build.HasField("device_assignment"):
            assignment = build.device_assignment
            columns = [list(c.replica_device_ids) for c in assignment.computation_devices]
            if (assignment.replica_count, assignment.computation_count) != (replicas, partitions) \
                    or len(columns) != partitions or any(len(c) != replicas for c in columns):
                raise InvalidProgram(f"the device assignment is not {replicas} replicas x "
                                     f"{partitions} partitions")
            ids = [columns[p][r] for r in range(replicas) for p in range(partitions)]
            if len(set(ids)) != n or any(i not in by_id for i in ids):
                raise InvalidProgram(f"the device assignment names devices {ids}; this runtime "
                                     f"has {sorted(by_id)}, each at most once")
            devices = tuple(by_id[i] for i in ids)
        else:
            devices = tuple(self.devices[:n])
        build.ClearField("device_assignment")
        build.device_assignment.replica_count, build.device_assignment.computation_count = (
            replicas, partitions)
        for p in range(partitions):
            build.device_assignment.computation_devices.add().replica_device_ids.extend(
                self.devices[r * partitions + p].id for r in range(replicas))
        return proto.SerializeToString(deterministic=True), partitions, replicas, devices

    def executable_id(self, program: Program, in_avals: Sequence[Aval] | None = None,
                      static_key: str = "", donate: Sequence[int] = (), scope: str = "", *,
                      overrides: Mapping[str, Any] | None = None) -> str:
        """The cache key ``lookup`` would compile under, without looking anything up."""
        concrete = self._concrete_avals(program, in_avals)
        return self._key(program, concrete, static_key, check_donate(donate, len(concrete)),
                         scope, check_compiler_options(overrides))

    def cached(self, program: Program, in_avals: Sequence[Aval] | None = None,
               static_key: str = "", donate: Sequence[int] = (), scope: str = "", *,
               overrides: Mapping[str, Any] | None = None) -> Lookup | None:
        """``lookup`` from L1 alone, or ``None``: never blocks, so an event loop may call it."""
        keys = [self.executable_id(program, in_avals, static_key, donate, scope,
                                   overrides=overrides)]
        if scope:  # as ``lookup``: the operator's own (warmed) executable serves too
            keys.append(self.executable_id(program, in_avals, static_key, donate,
                                           overrides=overrides))
        for key in keys:
            hit = self._executables.cached(key)
            if hit is not None:
                return Lookup(hit, key, TierName.MEMORY, 0.0)
        return None

    def load(self, executable_id: str) -> Lookup | None:
        """The executable ``executable_id`` from L1 or an L2 tier, or ``None`` if none has it.

        Needs no program: the key is known, so nothing is decoded, lowered or hashed
        before the read, which is what a fresh process (a restarted runtime) pays for
        a hit when it is told which executable to run. The entry is still checked
        (its MAC binds it to ``executable_id``; versions, platform and device kind
        must match). Never compiles: on ``None`` the caller goes through ``lookup``.
        Blocks on the tiers (call it from a thread pool, as ``lookup``).

        Example::

            found = compiler.load(executable_id) or compiler.lookup(program, avals)
        """
        if not _EXECUTABLE_ID.fullmatch(executable_id):
            return None  # not a key: nothing to read (and no odd names on the disk)
        return self._from_tiers(executable_id)

    def loaded_executable(self, executable_id: str) -> Executable | None:
        """The executable ``executable_id`` if it is loaded here (L1), else ``None``; never blocks."""
        return self._executables.cached(executable_id)

    def loaded(self) -> list[Executable]:
        """The executables loaded in this process (L1), least recently used first."""
        return self._executables.memory.values()

    @property
    def tiers(self) -> tuple[Tier, ...]:
        """The L2 tiers of executables, fastest first."""
        return self._executables.tiers

    def stats(self) -> dict[str, int]:
        memory = self._executables.memory
        return {"compilations": self._compilations, "l1_entries": len(memory),
                "l1_bytes": memory.nbytes}

    def forget(self, executable_id: str) -> list[str]:
        """Drop ``executable_id`` from every tier (L1, disk, Redis) and from the keys'
        history; the names of the tiers that held it. A later lookup compiles it again."""
        self._history.forget(executable_id)
        return self._executables.delete(executable_id)

    def close(self) -> None:
        """Stop the compile workers, and the Redis connection if there is one."""
        self._pool.close()
        if self._shared is not None:
            self._shared.close()

    # -- internals -----------------------------------------------------------------

    def _key(self, program: Program, concrete: Sequence[Aval], static_key: str,
             donate: tuple[int, ...], scope: str = "", overrides: Overrides = ()) -> str:
        return cache_key(self._parts(program, concrete, static_key, donate, scope, overrides))

    def _parts(self, program: Program, concrete: Sequence[Aval], static_key: str,
               donate: tuple[int, ...], scope: str = "", overrides: Overrides = ()
               ) -> list[tuple[str, str]]:
        return key_parts(program_id=program.program_id, in_avals=concrete,
                         static_key=static_key, backend=self._backend_for(program.nr_devices),
                         donate=donate, scope=scope, overrides=overrides_text(overrides))

    def _backend_for(self, n: int) -> Backend:
        """The key's backend parts for an executable of ``n`` devices: their count, the
        options (normalized: the first ``n`` devices in order) and, for more than one,
        how they are connected (the topology's fingerprint). One device: as ever, so
        single-device entries are shared by processes of any device count."""
        if n == 1:
            return self._key_backend
        backend = self._sharded_backends.get(n)
        if backend is None:
            topology = ""
            with contextlib.suppress(Exception):  # a backend without topologies: count and kind
                topology = str(xc.get_topology_for_devices(list(self.devices[:n])).fingerprint())
            backend = self._sharded_backends[n] = dataclasses.replace(
                self._key_backend, device_count=n, topology=topology,
                options_digest=options_digest(compile_options(n)))
        return backend

    def _recompile_reasons(self, program_id: str, key: str,
                           parts: Sequence[tuple[str, str]]) -> list[str] | None:
        """Why ``key`` compiles although ``program_id`` has other keys: the parts that differ
        from the nearest of them (this process's, and the shared tier's); ``None`` for a
        program's first key."""
        previous = self._history.previous(program_id, key)
        if self._shared is not None:
            for other, (at, other_parts) in self._shared.executables.history(program_id).items():
                if other != key:
                    previous.setdefault(other, (at, other_parts))
        # Only the same tenant's keys: another's calls are none of this one's business.
        current = dict(parts)
        scope = current.get("tenant", "")
        recent_first = sorted((item for item in previous.values()
                               if item[1].get("tenant", "") == scope),
                              key=lambda item: item[0], reverse=True)
        return nearest_reasons([p for _, p in recent_first], current)

    def _concrete_avals(self, program: Program, in_avals: Sequence[Aval] | None) -> tuple[Aval, ...]:
        if in_avals is None:
            if not program.is_static:
                raise SignatureMismatch(
                    "program has dynamic dimensions "
                    f"({', '.join(map(str, program.in_avals))}); give concrete in_avals")
            return program.in_avals
        if len(in_avals) != len(program.in_avals):
            raise SignatureMismatch(
                f"program takes {len(program.in_avals)} inputs, got {len(in_avals)}")
        out = []
        for i, (want, got) in enumerate(zip(program.in_avals, in_avals)):
            if not got.is_static or not want.matches(got):
                raise SignatureMismatch(f"input {i}: program expects {want}, got {got}")
            if got.nbytes > self.config.limits.max_tensor_bytes:
                raise LimitExceeded(f"input {i} ({got}) is over the per-tensor byte limit")
            out.append(Aval(got.shape, got.dtype, want.weak_type))
        return tuple(out)

    def _join_flight(self, key: str) -> tuple[concurrent.futures.Future[Executable], bool]:
        with self._lock:
            future = self._inflight.get(key)
            if future is not None:
                return future, False
            future = self._inflight[key] = concurrent.futures.Future()
            return future, True

    def _resolve(self, program: Program, concrete: tuple[Aval, ...], static_key: str,
                 donate: tuple[int, ...], key: str, parts: list[tuple[str, str]],
                 overrides: Overrides = ()) -> Lookup:
        hit = self._from_tiers(key)
        if hit is not None:
            return hit
        with self._shared_flight(key) as should_compile:
            if not should_compile:
                hit = self._from_tiers(key)  # another process compiled it while we waited
                if hit is not None:
                    return hit
            return self._compile_and_store(program, concrete, static_key, donate, key, parts,
                                           overrides)

    def _from_tiers(self, key: str) -> Lookup | None:
        found = self._executables.get(key)
        return None if found is None else Lookup(found[0], key, found[1], 0.0)

    def _shared_flight(self, key: str) -> contextlib.AbstractContextManager[bool]:
        """Single flight across processes: the first shared tier's compile lock, if any."""
        for tier in self.tiers:
            if isinstance(tier, SharedTier):
                return tier.compile_lock(key)
        return contextlib.nullcontext(True)

    def _compile_and_store(self, program: Program, concrete: tuple[Aval, ...], static_key: str,
                           donate: tuple[int, ...], key: str,
                           parts: list[tuple[str, str]], overrides: Overrides = ()) -> Lookup:
        start = time.perf_counter()
        executable, serialized = self._compile(program, concrete, static_key, donate, key,
                                               overrides)
        executable.meta["key_parts"] = dict(parts)
        executable.meta["recompiled_because"] = self._recompile_reasons(
            program.program_id, key, parts)
        seconds = time.perf_counter() - start
        executable.meta["compile_seconds"] = seconds
        # Store the worker's bytes, never a re-serialization of the loaded
        # executable: on CPU (jaxlib 0.10.2) serializing a deserialized executable
        # drops its object code, and loading that fails at run time.
        self._executables.put(key, encode_entry(key, Entry(serialized, executable.meta),
                                                self._secret), executable)
        return Lookup(executable, key, TierName.COMPILED, seconds)

    def _compile(self, program: Program, concrete: tuple[Aval, ...], static_key: str,
                 donate: tuple[int, ...], key: str, overrides: Overrides = ()
                 ) -> tuple[Executable, bytes]:
        """Compile in a worker; the loaded executable and the bytes it was loaded from."""
        limits = self.config.limits
        with stablehlo.new_context() as ctx:
            module = lower(program, concrete, ctx, limits, self.devices)
            partitions, replicas = stablehlo.partitions(module)
            module = stablehlo.specialize(module, concrete, donate)
            check_module(module, limits, static=True)  # every tensor size is known now
            _, out_avals = stablehlo.main_signature(module)
            bytecode = stablehlo.to_bytecode(module)
        n = partitions * replicas
        if n != program.nr_devices:  # lowering decides, and must agree with the upload
            raise CompileFailed(f"program was uploaded for {program.nr_devices} devices but "
                                f"lowers for {n}")
        options = (None if n == 1 and not overrides else
                   compile_options(partitions, replicas, overrides=overrides).SerializeAsString())
        serialized = self._pool.compile(bytecode, options)
        self._compilations += 1
        meta = self._meta(key, program, concrete, out_avals, static_key)
        meta["donate"] = list(donate)
        if overrides:
            meta["compiler_options"] = dict(overrides)
        meta["device_count"] = n
        meta["partitions"], meta["replicas"] = partitions, replicas
        executable = Executable(self._deserialize(serialized, meta), key, meta, len(serialized),
                                self.devices[:n], self._kept(serialized, n))
        if n > 1:
            meta["sharding"] = sharding_doc(executable, partitions, replicas)
        return executable, serialized

    def _meta(self, key: str, program: Program, concrete: Sequence[Aval],
              out_avals: Sequence[Aval], static_key: str) -> dict[str, Any]:
        return {**self._expected_meta(key), "program_id": program.program_id,
                "format": program.format.value, "static_key": static_key,
                "in_avals": [a.to_json() for a in concrete],
                "out_avals": [a.to_json() for a in out_avals], "out_tree": program.out_tree,
                "compile_seconds": 0.0, "created": time.time()}

    def _expected_meta(self, key: str) -> dict[str, Any]:
        # An entry loads only where these all match: an executable is code for
        # one jaxlib on one kind of device.
        return {"key": key, "jaxlib_version": jaxlib.__version__, "platform": self.platform,
                "device_kind": self.device.device_kind}

    def _deserialize(self, serialized: bytes, meta: dict[str, Any] | None = None) -> Any:
        """Load ``serialized`` onto the first devices its ``meta`` counts (one without)."""
        meta = meta or {}
        n = int(meta.get("device_count", 1))
        if n == 1:
            return self._backend.deserialize_executable(
                serialized, xc.DeviceList(self.devices[:1]), self._options)
        options = compile_options(int(meta.get("partitions", n)), int(meta.get("replicas", 1)))
        return self._backend.deserialize_executable(
            serialized, xc.DeviceList(self.devices[:n]), options)

    def _load_executable(self, key: str, data: bytes) -> Executable:
        """The executable in entry ``data`` of ``key``; ``CorruptEntry`` if it is not one for here."""
        entry = decode_entry(key, data, self._secret, self._expected_meta(key))
        n = entry.meta.get("device_count", 1)
        # Loading onto a device list of another size is an XLA CHECK failure, which
        # kills the process: the count is checked here, from the signed meta, first.
        if not isinstance(n, int) or n < 1 or (
                n > 1 and entry.meta.get("partitions", 0) * entry.meta.get("replicas", 0) != n):
            raise CorruptEntry(f"entry says it is for {n!r} devices")
        if n > len(self.devices):
            raise ForeignEntry(f"entry is for {n} devices; this process has {len(self.devices)}")
        return Executable(self._deserialize(entry.executable, entry.meta), key, entry.meta,
                          len(entry.executable), self.devices[:n], self._kept(entry.executable, n))

    def _kept(self, serialized: bytes, n: int) -> bytes | None:
        """The bytes an executable keeps when this process has other devices to load it
        onto (``on_devices``)."""
        return serialized if len(self.devices) > 1 else None

    def on_device(self, executable: Executable, index: int) -> Executable:
        """``executable`` (single-device) loaded onto this process's device ``index``: the
        same code, so a group's devices all serve single-device programs."""
        return self.on_devices(executable, (self.devices[index],))

    def on_devices(self, executable: Executable, devices: Sequence[Any]) -> Executable:
        """``executable`` loaded onto ``devices`` (as many as it runs on, in run order):
        the same code on other devices of this process (serialized N-device executables
        load onto any N devices). Loaded once per device list, then kept with the
        executable (and evicted with it)."""
        devices = tuple(devices)
        if devices == executable.devices or executable.serialized is None:
            return executable
        ids = tuple(d.id for d in devices)
        copy = executable.copies.get(ids)
        if copy is None:
            with self._lock:
                copy = executable.copies.get(ids)
                if copy is None:
                    meta = executable.meta
                    # The options name the devices too: with the default ones, the
                    # executable would be assigned to the first whatever the list says.
                    options = compile_options(int(meta.get("partitions", len(ids))),
                                              int(meta.get("replicas", 1)), device_ids=ids)
                    loaded = self._backend.deserialize_executable(
                        executable.serialized, xc.DeviceList(devices), options)
                    copy = executable.copies[ids] = Executable(
                        loaded, executable.executable_id, meta, executable.nbytes, devices)
        return copy

    def _l2_tiers(self, kind: BlobKind) -> tuple[Tier, ...]:
        """The serialized tiers of ``kind``, fastest first: the disk, then Redis."""
        disk = ((DiskTier(self.config.cache_dir, kind, self._disk_budget),)
                if self.config.cache_dir else ())
        shared = (self._shared.tier(kind),) if self._shared is not None else ()
        return (*disk, *shared)


def _cache_secret(config: CompilerConfig) -> CacheSecret:
    """The secret that signs entries: configured, else kept in the cache dir, else this process's."""
    if config.cache_secret is not None:
        secret = config.cache_secret
    elif config.cache_dir is not None:
        secret = CacheSecret.in_directory(config.cache_dir)
    else:
        secret = CacheSecret.per_process()
    logger.info("executable entries are signed with a cache secret: %s", secret.source)
    return secret


def _open_redis(settings: RedisSettings | None, secret: CacheSecret) -> RedisTiers | None:
    if settings is None:
        return None
    # Imported here: a compiler without Redis never loads the redis package.
    from jitserve.compiler.redis.tiers import RedisTiers

    return RedisTiers(settings, secret)


def _ifrt_reasons(reasons: list[str] | None) -> list[str] | None:
    """An IFRT compile's reasons without the module's change when others say why: jax
    writes another module for each new signature, so that one goes without saying."""
    if not reasons:
        return reasons
    said = [r for r in reasons if not r.startswith("program:")]
    return said or reasons
