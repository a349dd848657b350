"""The compiler: programs and concrete avals in, loaded XLA executables out.

``Compiler.lookup`` resolves a program for concrete input avals through the
tiers: L1 (loaded executables in this process), the L2 tiers (serialized
executables: disk by default, Redis when configured), then an XLA compile in a
worker process. Concurrent lookups of one key share a single flight: one caller
compiles, the others wait for its result. With a shared tier (``SharedTier``,
e.g. Redis) the flight spans processes: one process compiles under the tier's
lock, the others wait for the entry to appear and load it. Lookups block; a
server calls them from a thread pool so its event loop stays free.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jaxlib
from jax._src.lib import xla_client as xc
from jax.extend import backend as xb

from jitserve.compiler import stablehlo
from jitserve.compiler._worker import CompilePool, compile_options
from jitserve.compiler.cache import (
    CorruptEntry,
    DiskTier,
    Entry,
    MemoryCache,
    SharedTier,
    Tier,
    decode_entry,
    encode_entry,
)
from jitserve.compiler.errors import LimitExceeded, SignatureMismatch
from jitserve.compiler.keys import cache_key, key_parts
from jitserve.compiler.programs import Program, decode_program, lower
from jitserve.compiler.safety import Limits, check_module
from jitserve.wire import Aval, TierName

__all__ = ["Compiler", "CompilerConfig", "Executable", "Lookup"]

logger = logging.getLogger("jitserve.compiler")

jax.config.update("jax_enable_x64", True)  # float64 and complex128 run as written


@dataclasses.dataclass(frozen=True)
class CompilerConfig:
    """How a ``Compiler`` caches and compiles.

    Attributes:
      cache_dir: root of the disk tier; ``None`` for no disk tier.
      l1_max_entries, l1_max_bytes: bounds of the in-process cache of loaded
        executables (bytes as serialized).
      compile_timeout_s: a compile past this is stopped (its worker is killed).
      compile_workers: compiles that may run at once, each in its own process.
      limits: what an untrusted program may be (``compiler.safety.Limits``).
      extra_tiers: L2 tiers consulted after the disk tier (e.g.
        ``compiler.redis_tier.RedisTier``); the first ``SharedTier`` among them
        also elects one compiler per key across processes.
    """

    cache_dir: Path | None = None
    l1_max_entries: int = 256
    l1_max_bytes: int = 1 << 30
    compile_timeout_s: float = 120.0
    compile_workers: int = 1
    limits: Limits = Limits()
    extra_tiers: tuple[Tier, ...] = ()


class Executable:
    """A loaded executable with its static signature. ``run`` is safe from any thread."""

    def __init__(self, loaded: Any, executable_id: str, meta: dict[str, Any], nbytes: int) -> None:
        self._loaded = loaded
        self.executable_id = executable_id
        self.in_avals = tuple(Aval.from_json(a) for a in meta["in_avals"])
        self.out_avals = tuple(Aval.from_json(a) for a in meta["out_avals"])
        self.out_tree = meta.get("out_tree")
        self.meta = meta
        self.nbytes = nbytes

    def check_inputs(self, avals: Sequence[Aval]) -> None:
        """Raise ``SignatureMismatch`` naming the first input that does not fit."""
        if len(avals) != len(self.in_avals):
            raise SignatureMismatch(f"program takes {len(self.in_avals)} inputs, got {len(avals)}")
        for i, (want, got) in enumerate(zip(self.in_avals, avals)):
            if want.shape != got.shape or want.dtype != got.dtype:
                raise SignatureMismatch(f"input {i}: expected {want}, got {got}")

    def run(self, args: Sequence[jax.Array]) -> list[jax.Array]:
        """Dispatch on the device; the outputs are device arrays, possibly not ready yet."""
        results = self._loaded.execute_sharded(list(args))
        return [shards[0] for shards in results.disassemble_into_single_device_arrays()]


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

    Example::

        compiler = Compiler(CompilerConfig(cache_dir=Path("/var/cache/jitserve")))
        program = compiler.decode(exported.serialize())
        lookup = compiler.lookup(program)            # compiles, or hits a cache
        outs = lookup.executable.run([jax.device_put(x, compiler.device)])
    """

    def __init__(self, config: CompilerConfig | None = None) -> None:
        self.config = config or CompilerConfig()
        self._backend = xb.get_backend()
        self.device = self._backend.devices()[0]
        self._devices = xc.DeviceList((self.device,))
        self._options = compile_options()
        self._l1: MemoryCache[Executable] = MemoryCache(self.config.l1_max_entries,
                                                       self.config.l1_max_bytes)
        disk = [DiskTier(self.config.cache_dir)] if self.config.cache_dir else []
        self.tiers: tuple[Tier, ...] = (*disk, *self.config.extra_tiers)
        self._pool = CompilePool(workers=self.config.compile_workers,
                                 timeout_s=self.config.compile_timeout_s,
                                 platform=self._backend.platform)
        self._inflight: dict[str, concurrent.futures.Future[Executable]] = {}
        self._lock = threading.Lock()
        self._compilations = 0

    @property
    def platform(self) -> str:
        return self._backend.platform

    def backend_info(self) -> dict[str, Any]:
        return {"platform": self.platform, "platform_version": self._backend.platform_version,
                "device_kind": self.device.device_kind, "device_count": 1,
                "jax_version": jax.__version__, "jaxlib_version": jaxlib.__version__}

    def warm(self) -> None:
        """Start a compile worker ahead of the first compile (blocks until it is up)."""
        self._pool.warm()

    def decode(self, data: bytes, format: str | None = None) -> Program:
        """Decode and validate an uploaded program (``compiler.programs.decode_program``)."""
        return decode_program(data, format, platform=self.platform, limits=self.config.limits)

    def lookup(self, program: Program, in_avals: Sequence[Aval] | None = None,
               static_key: str = "") -> Lookup:
        """The executable of ``program`` for ``in_avals`` (default: the program's own)."""
        concrete = self._concrete_avals(program, in_avals)
        key = self._key(program, concrete, static_key)
        hit = self._l1.get(key)
        if hit is not None:
            return Lookup(hit, key, TierName.MEMORY, 0.0)
        future, leader = self._join_flight(key)
        if not leader:
            return Lookup(future.result(), key, TierName.MEMORY, 0.0)
        try:
            lookup = self._resolve(program, concrete, static_key, key)
        except BaseException as e:
            future.set_exception(e)
            raise
        finally:
            with self._lock:
                self._inflight.pop(key, None)
        future.set_result(lookup.executable)
        return lookup

    def executable_id(self, program: Program, in_avals: Sequence[Aval] | None = None,
                      static_key: str = "") -> str:
        """The cache key ``lookup`` would use, without looking anything up."""
        return self._key(program, self._concrete_avals(program, in_avals), static_key)

    def cached(self, program: Program, in_avals: Sequence[Aval] | None = None,
               static_key: str = "") -> Lookup | None:
        """``lookup`` from L1 alone, or ``None``: never blocks, so an event loop may call it."""
        key = self._key(program, self._concrete_avals(program, in_avals), static_key)
        hit = self._l1.get(key)
        return None if hit is None else Lookup(hit, key, TierName.MEMORY, 0.0)

    def loaded(self) -> list[Executable]:
        """The executables loaded in this process (L1), least recently used first."""
        return self._l1.values()

    def stats(self) -> dict[str, int]:
        return {"compilations": self._compilations, "l1_entries": len(self._l1),
                "l1_bytes": self._l1.nbytes}

    def close(self) -> None:
        self._pool.close()

    # -- internals -----------------------------------------------------------------

    def _key(self, program: Program, concrete: Sequence[Aval], static_key: str) -> str:
        return cache_key(key_parts(
            program_id=program.program_id, in_avals=concrete, static_key=static_key,
            platform=self.platform, platform_version=self._backend.platform_version,
            device_kind=self.device.device_kind, device_count=1))

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
                 key: str) -> Lookup:
        hit = self._from_tiers(key)
        if hit is not None:
            return hit
        with self._shared_flight(key) as should_compile:
            if not should_compile:
                hit = self._from_tiers(key)  # another process compiled it while we waited
                if hit is not None:
                    return hit
            return self._compile_and_store(program, concrete, static_key, key)

    def _from_tiers(self, key: str) -> Lookup | None:
        for i, tier in enumerate(self.tiers):
            loaded = self._load_from(tier, key)
            if loaded is not None:
                executable, data = loaded
                self._put(key, data, self.tiers[:i])  # fill the faster tiers, same bytes
                return Lookup(executable, key, tier.name, 0.0)
        return None

    def _shared_flight(self, key: str) -> contextlib.AbstractContextManager[bool]:
        """Single flight across processes: the first shared tier's compile lock, if any."""
        for tier in self.tiers:
            if isinstance(tier, SharedTier):
                return tier.compile_lock(key)
        return contextlib.nullcontext(True)

    def _compile_and_store(self, program: Program, concrete: tuple[Aval, ...], static_key: str,
                           key: str) -> Lookup:
        start = time.perf_counter()
        executable, serialized = self._compile(program, concrete, static_key, key)
        seconds = time.perf_counter() - start
        executable.meta["compile_seconds"] = seconds
        self._l1.put(key, executable, executable.nbytes)
        # Store the worker's bytes, never a re-serialization of the loaded
        # executable: on CPU (jaxlib 0.10.2) serializing a deserialized executable
        # drops its object code, and loading that fails at run time.
        self._put(key, encode_entry(Entry(serialized, executable.meta)), self.tiers)
        return Lookup(executable, key, TierName.COMPILED, seconds)

    def _compile(self, program: Program, concrete: tuple[Aval, ...], static_key: str,
                 key: str) -> tuple[Executable, bytes]:
        """Compile in a worker; the loaded executable and the bytes it was loaded from."""
        limits = self.config.limits
        with stablehlo.new_context() as ctx:
            module = stablehlo.specialize(lower(program, concrete, ctx, limits), concrete)
            check_module(module, limits)  # static now: every tensor size is known
            _, out_avals = stablehlo.main_signature(module)
            bytecode = stablehlo.to_bytecode(module)
        serialized = self._pool.compile(bytecode)
        self._compilations += 1
        meta = self._meta(key, program, concrete, out_avals, static_key)
        return Executable(self._deserialize(serialized), key, meta, len(serialized)), serialized

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

    def _deserialize(self, serialized: bytes) -> Any:
        return self._backend.deserialize_executable(serialized, self._devices, self._options)

    def _load_from(self, tier: Tier, key: str) -> tuple[Executable, bytes] | None:
        """The executable of ``key`` in ``tier`` and its entry bytes; ``None`` on a miss."""
        try:
            data = tier.get(key)
            if data is None:
                return None
            entry = decode_entry(data, self._expected_meta(key))
            executable = Executable(self._deserialize(entry.executable), key, entry.meta,
                                    len(entry.executable))
        except CorruptEntry as e:
            logger.warning("dropping corrupt %s cache entry %s: %s", tier.name, key, e)
            self._forget(tier, key)
            return None
        except Exception as e:  # a tier failure is a miss, never a failed request
            logger.warning("%s cache tier failed reading %s: %r", tier.name, key, e)
            self._forget(tier, key)
            return None
        self._l1.put(key, executable, executable.nbytes)
        return executable, data

    def _put(self, key: str, data: bytes, tiers: Sequence[Tier]) -> None:
        for tier in tiers:
            try:
                tier.put(key, data)
            except Exception as e:
                logger.warning("%s cache tier failed writing %s: %r", tier.name, key, e)

    def _forget(self, tier: Tier, key: str) -> None:
        try:
            tier.delete(key)
        except Exception as e:
            logger.warning("%s cache tier failed deleting %s: %r", tier.name, key, e)
