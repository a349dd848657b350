"""The server's configuration: one pydantic-settings object read from ``JITSERVE_*``.

    JITSERVE_PORT=9000 JITSERVE_API_KEYS=k1,k2 jitserve serve

Every knob has a default that runs on a fresh machine with no Redis. Outside
``JITSERVE_ENV=development`` the settings refuse placeholder API keys such as
``changeme``, so a sample config cannot ship to production by accident.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from jitserve.compiler import CacheSecret, Limits, RedisSettings
from jitserve.compiler.disk import DEFAULT_CACHE_DIR, DEFAULT_MAX_BYTES
from jitserve.compiler.jaxpr import JaxprLimits

if TYPE_CHECKING:
    from jitserve.compiler.compile import CompilerConfig

__all__ = ["PLACEHOLDER_SECRETS", "Settings"]

MiB = 1 << 20
GiB = 1 << 30

# Values people paste from examples; never accepted as a real API key.
PLACEHOLDER_SECRETS = frozenset(
    {"changeme", "change-me", "change_me", "secret", "password", "example",
     "test", "key", "apikey", "api-key", "xxx", "todo", "default", "token"}
)


class Settings(BaseSettings):
    """Everything the server reads from its environment (prefix ``JITSERVE_``)."""

    # hide_input_in_errors: a model-level error would otherwise print every input,
    # secrets (JITSERVE_CACHE_SECRET, API keys, the Redis password) included.
    model_config = SettingsConfigDict(
        env_prefix="JITSERVE_", extra="ignore", validate_default=True, populate_by_name=True,
        hide_input_in_errors=True,
    )

    env: Literal["development", "test", "production"] = "production"
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # The Open Inference Protocol's gRPC service (service/v2, docs/v2.md) on this port of
    # `host`; unset: no gRPC (the /v2 REST routes are always served).
    grpc_port: int | None = Field(None, ge=0, le=65535)
    # JAX's own remote-backend protocol, the IFRT proxy (service/ifrt, docs/ifrt.md), on
    # this port of `host`: unmodified JAX programs run here with JAX_PLATFORMS=jitserve.
    # Unset: off.
    ifrt_port: int | None = Field(None, ge=0, le=65535)
    # A session that sends nothing for this long is closed, and what it held freed.
    ifrt_session_idle_s: float = Field(600.0, gt=0)
    # How long a request waits for a host buffer the client has not finished sending.
    ifrt_host_buffer_wait_s: float = Field(60.0, gt=0)
    # Bytes of host buffers one session may have waiting in the API process (sent, not
    # yet used by a request; or made, not yet read), and its stores on their way: a store
    # past either waits for room (JITSERVE_IFRT_HOST_BUFFER_WAIT_S), then is refused.
    # Copies to host not read yet may hold what its arrays hold on the devices plus this.
    ifrt_max_host_bytes: int = Field(2 * GiB, gt=0)
    # Sessions open at once, all keys together: one more is refused when it opens
    # (RESOURCE_EXHAUSTED). Unset: as many as half the host's memory holds at
    # JITSERVE_IFRT_MAX_HOST_BYTES each (at least 4), so that what sessions may hold in
    # this process stays under it. With keys, each key gets a fair share
    # (JITSERVE_TENANT_MAX_IFRT_SESSIONS).
    ifrt_max_sessions: int | None = Field(None, gt=0)
    # TLS for the IFRT port (PEM files): set both, or neither (plaintext, for loopback
    # and private networks). Clients reach it as grpcs://host:port (docs/ifrt.md).
    ifrt_tls_cert: Path | None = None
    ifrt_tls_key: Path | None = None

    @model_validator(mode="after")
    def _check_ifrt_tls(self) -> Settings:
        if (self.ifrt_tls_cert is None) != (self.ifrt_tls_key is None):
            raise ValueError("set both JITSERVE_IFRT_TLS_CERT and JITSERVE_IFRT_TLS_KEY, or neither")
        for path in (self.ifrt_tls_cert, self.ifrt_tls_key):
            if path is not None and not path.is_file():
                raise ValueError(f"{path} (JITSERVE_IFRT_TLS_CERT/KEY) is not a readable file")
        return self
    cache_dir: Path = DEFAULT_CACHE_DIR
    # The shared L2 cache of programs and executables (docs/redis.md); REDIS_URL is
    # the common name. Unset: everything stays on this host.
    redis_url: str | None = Field(
        None, validation_alias=AliasChoices("redis_url", "JITSERVE_REDIS_URL", "REDIS_URL")
    )
    redis_prefix: str = "default"
    redis_ttl_s: float | None = Field(None, gt=0)
    redis_lock_ttl_s: float = Field(10.0, gt=0)
    redis_wait_s: float = Field(60.0, ge=0)
    # The disk tier (executables and programs under cache_dir); off for pods whose disk
    # dies with them, where Redis is the shared tier.
    disk_cache: bool = True
    # Disk cache bound
    # The disk tier's blobs (executables and programs) stay under this many bytes; past
    # it the least recently used are evicted (compiler/disk.py), and recompiled on need.
    disk_cache_max_bytes: int = Field(DEFAULT_MAX_BYTES, gt=0)
    log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    # text for people; json: one object per line, for log shippers (service/logs.py)
    log_format: Literal["text", "json"] = "text"
    # Keep freed big blocks for reuse (service/memory.py): big requests skip fresh
    # page faults, at the price of an RSS that does not shrink after them.
    retain_freed_memory: bool = True
    api_keys: Annotated[tuple[str, ...], NoDecode] = ()
    # Admin keys: those of api_keys that may also use the admin routes
    # (DELETE /v1/executables/{id}); with keys on and none of them admin, nobody may.
    admin_keys: Annotated[tuple[str, ...], NoDecode] = ()
    # A manifest of programs x signatures compiled at start (service/calls/warming.py);
    # /readyz answers 503 "warming" until it is done.
    warm: Path | None = None

    # Request limits.
    max_body_bytes: int = Field(1 * GiB, gt=0)
    max_wait_ms: int = Field(60_000, ge=0)

    # Compiler limits and caches.
    max_program_bytes: int = Field(64 * MiB, gt=0)
    max_ops: int = Field(200_000, gt=0)
    max_inputs: int = Field(4096, gt=0)
    max_nesting: int = Field(64, gt=0)
    max_tensor_bytes: int = Field(16 * GiB, gt=0)
    # Bounds on a jaxpr document (docs/jaxpr-format.md); its bytes count against
    # max_program_bytes.
    jaxpr_max_eqns: int = Field(100_000, gt=0)
    jaxpr_max_depth: int = Field(32, ge=0)
    jaxpr_max_vars: int = Field(1_000_000, gt=0)
    jaxpr_max_literal_elements: int = Field(1 << 20, ge=0)
    jaxpr_max_array_elements: int = Field(1 << 32, gt=0)
    jaxpr_max_rank: int = Field(32, ge=0)
    jaxpr_max_unroll: int = Field(1024, gt=0)
    compile_timeout_s: float = Field(120.0, gt=0)
    compile_workers: int = Field(2, gt=0)
    l1_max_entries: int = Field(256, gt=0)
    l1_max_bytes: int = Field(2 * GiB, gt=0)
    # Decoded programs kept in memory; the disk and Redis tiers (when on) keep every program.
    programs_max_entries: int = Field(256, gt=0)
    programs_max_bytes: int = Field(1 * GiB, gt=0)

    # Futures and execution.
    future_ttl_s: float = Field(600.0, gt=0)
    sweep_interval_s: float = Field(1.0, gt=0)
    max_live_futures: int = Field(10_000, gt=0)
    # Device bytes live futures' outputs and running executions' intermediates may hold,
    # all runtimes together. Unset: derived from the devices when the server starts
    # (service.runtimes.device_limits): on a GPU what XLA lets the runtimes hold
    # (memory x JITSERVE_RUNTIME_DEVICE_MEMORY_FRACTION), on the CPU half the runtimes'
    # memory caps; 8 GiB where neither is known.
    max_device_bytes: int | None = Field(None, gt=0)
    executor_threads: int = Field(2, gt=0)
    # A run whose executable's last run took under this is done by the runtime thread
    # that read it, before it reads the next request (no hand-off to another thread);
    # 0 hands every run off (service/runtimes/child.py).
    runtime_quick_run_ms: float = Field(2.0, ge=0)

    # Runtimes: the supervised processes that decode, compile and run programs
    # (service/runtimes, docs/runtimes.md). Unset: one per core on CPU (at most 8),
    # one on GPU.
    runtimes: int | None = Field(None, gt=0)
    # On CPU: the host's devices (XLA's simulated host devices), which the device
    # groups share out, so programs sharded across N devices run (jax.export with
    # nr_devices=N, StableHLO with mhlo.num_partitions): for tests, and SPMD on CPU.
    cpu_devices: int | None = Field(None, gt=0, le=256)
    # Which devices each runtime gets (service/runtimes/devices.py): "each" (a group
    # per device), "all" (one group), or groups such as "0-3;4-7" or "0,1;2;3";
    # JITSERVE_RUNTIMES runtimes serve each group. Unset: "each" on GPU, "all" on CPU.
    runtime_devices: str | None = Field(None, min_length=1, max_length=1000)
    # The longest an execution may run (from its start); a caller may ask for less.
    # Past it, its runtime is killed and restarted and the future fails with
    # execution_timeout.
    execution_timeout_s: float = Field(300.0, gt=0)
    # The longest a runtime may take to decode and validate an upload; past it the
    # upload is refused (400 invalid_program) and the runtime restarted. MLIR takes
    # time quadratic in nesting depth before its depth can be checked.
    decode_timeout_s: float = Field(30.0, gt=0)
    # Address space of each runtime on CPU: past it allocations fail (out_of_memory)
    # instead of the OOM killer choosing a victim. Unset: 80% of RAM shared out, at
    # least 2 GiB.
    runtime_max_memory_bytes: int | None = Field(None, ge=1 << 30)
    # Share of the GPU's memory each runtime may take; unset: 0.75 shared out.
    runtime_device_memory_fraction: float | None = Field(None, gt=0, le=1)

    # Tenants: scoping and quotas
    # Per API key, with keys on (service/calls/quotas.py, docs/service.md "Tenants"). Unset:
    # live futures, device bytes and IFRT sessions get a fair share of the totals above
    # (divided by the number of keys), executables l1_max_entries, program bytes
    # programs_max_bytes.
    tenant_max_live_futures: int | None = Field(None, gt=0)
    tenant_max_device_bytes: int | None = Field(None, gt=0)
    tenant_compiles_per_minute: int = Field(120, gt=0)
    tenant_max_executables: int | None = Field(None, gt=0)
    tenant_max_program_bytes: int | None = Field(None, gt=0)
    tenant_max_ifrt_sessions: int | None = Field(None, gt=0)
    # Share of the compile workers one key's compiles may hold at once (rounded up).
    tenant_compile_share: float = Field(0.5, gt=0, le=1)
    # Let API keys share compiled executables (one compile per signature for all keys).
    # Off: each key compiles and caches its own, so no key can tell from a cache tier,
    # a timing, a recompile reason or a record what another key ran (docs/api.md,
    # "Tenants"). On only where keys trust each other.
    tenant_share_executables: bool = False

    # Memory and connections (docs/service.md, "Memory" and "Connections").
    # Freed heap memory kept for reuse is capped (service/memory.py): 1 GiB keeps
    # what a 256 MiB round trip frees (its body and msgpack's copy of the array).
    retain_freed_max_bytes: int = Field(1 * GiB, ge=32 * MiB)
    # Device bytes one execution may allocate on a device (intermediates + outputs, from
    # XLA's memory analysis); unset: the least a runtime may hold on one of its devices
    # (as derived for max_device_bytes), at most max_device_bytes.
    max_execution_bytes: int | None = Field(None, gt=0)
    # No body bytes for this long: the request is answered 400 and its connection closed.
    body_timeout_s: float = Field(30.0, gt=0)
    # A request head (request line and headers) must arrive within this, and be at
    # most max_head_bytes; an idle keep-alive connection is closed after keepalive_timeout_s.
    header_timeout_s: float = Field(10.0, gt=0)
    max_head_bytes: int = Field(64 * 1024, ge=1024)
    keepalive_timeout_s: float = Field(5.0, gt=0)
    # Open connections plus running requests; past it new requests get 503. Unset: no limit.
    max_connections: int | None = Field(None, gt=0)

    # Replicas (with REDIS_URL; service/cluster/, docs/deploy.md "Many replicas").
    # The address peers reach this replica at; unset: http://<host>:<port>, with the
    # host's own address when it binds every interface (the pod IP in Kubernetes).
    peer_url: str | None = None
    # Signs requests forwarded between replicas (HMAC); the same in every replica.
    # Unset: derived from JITSERVE_CACHE_SECRET, which replicas already share.
    peer_secret: SecretStr | None = None
    # Each replica says it is alive this often; one silent for 3 periods is lost, and
    # its futures fail with replica_lost.
    heartbeat_s: float = Field(1.0, gt=0, le=60)
    # On SIGTERM: new executes get 503 and running ones finish; finished results stay
    # fetchable this long (or until all are fetched), and open IFRT sessions go on this
    # long (or until they close); then the process exits, its remaining futures report
    # replica_lost, and its sessions end saying the server shut down.
    drain_timeout_s: float = Field(30.0, ge=0)

    @property
    def lookup_timeout_s(self) -> float:
        """The longest a lookup (lowering, compile, load) may take in a runtime: a compile
        waits at most ``compile_timeout_s`` for a worker and ``compile_timeout_s`` to
        compile, and a minute covers the lowering and the load."""
        return 2 * self.compile_timeout_s + 60

    @property
    def call_timeout_s(self) -> float:
        """The longest a call may take from its request to its outputs: its lookup, then
        its run under ``execution_timeout_s``."""
        return self.lookup_timeout_s + self.execution_timeout_s

    @property
    def device_bytes_limit(self) -> int:
        """``max_device_bytes``: as set or derived (``runtimes.device_limits``, which the
        server applies when it starts), else 8 GiB."""
        return self.max_device_bytes or 8 * GiB

    @property
    def ifrt_sessions_limit(self) -> int:
        """``ifrt_max_sessions``, or as many sessions as half the host's memory holds at
        ``ifrt_max_host_bytes`` each, at least 4."""
        if self.ifrt_max_sessions:
            return self.ifrt_max_sessions
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError):
            memory = 0
        return max(4, memory // 2 // self.ifrt_max_host_bytes)

    @property
    def execution_bytes_limit(self) -> int:
        """``max_execution_bytes``, or ``device_bytes_limit`` when it is unset."""
        return self.max_execution_bytes or self.device_bytes_limit

    @field_validator("cache_dir")
    @classmethod
    def _expand_home(cls, value: Path) -> Path:
        return value.expanduser()

    @field_validator("api_keys", "admin_keys", mode="before")
    @classmethod
    def _split_keys(cls, value: object) -> object:
        # The environment gives "k1, k2"; Python callers may give a list.
        if isinstance(value, str):
            return tuple(k.strip() for k in value.split(",") if k.strip())
        return value

    @model_validator(mode="after")
    def _refuse_placeholders(self) -> Settings:
        if self.env == "development":
            return self
        bad = [k for k in self.api_keys if k.lower() in PLACEHOLDER_SECRETS or len(k) < 8]
        if bad:
            raise ValueError(
                "JITSERVE_API_KEYS holds a placeholder or too-short key (under 8 characters); "
                "set real keys, or JITSERVE_ENV=development to allow them"
            )
        return self

    @model_validator(mode="after")
    def _check_admin_keys(self) -> Settings:
        if set(self.admin_keys) - set(self.api_keys):
            raise ValueError("JITSERVE_ADMIN_KEYS holds a key that is not in JITSERVE_API_KEYS; "
                             "an admin key must also be an API key")
        return self

    @model_validator(mode="after")
    def _check_redis(self) -> Settings:
        self.redis_settings()  # a bad URL or prefix fails at start, naming the setting
        return self

    def redis_settings(self) -> RedisSettings | None:
        """The Redis tier's settings, or ``None`` when no Redis is configured."""
        if not self.redis_url:
            return None
        try:
            return RedisSettings.from_url(
                self.redis_url, prefix=self.redis_prefix, ttl_s=self.redis_ttl_s,
                lock_ttl_s=self.redis_lock_ttl_s, wait_s=self.redis_wait_s)
        except ValueError as e:
            raise ValueError(f"REDIS_URL / JITSERVE_REDIS_*: {e}") from e

    def compiler_config(self) -> CompilerConfig:
        """The ``CompilerConfig`` of a runtime: L1, disk (unless off), Redis (if set)."""
        from jitserve.compiler.compile import CompilerConfig  # imports jax: runtimes only

        # An unreachable Redis does not stop the start: its tiers begin degraded and retry.
        return CompilerConfig(
            cache_dir=self.cache_dir if self.disk_cache else None,
            l1_max_entries=self.l1_max_entries, l1_max_bytes=self.l1_max_bytes,
            programs_max_entries=self.programs_max_entries,
            programs_max_bytes=self.programs_max_bytes,
            compile_timeout_s=self.compile_timeout_s, compile_workers=self.compile_workers,
            disk_max_bytes=self.disk_cache_max_bytes, limits=self.compiler_limits(),
            redis=self.redis_settings(), cache_secret=self.compiler_cache_secret())

    def compiler_limits(self) -> Limits:
        """What an untrusted program may be (``compiler.records.Limits``), from these settings."""
        jaxpr = JaxprLimits(
            max_document_bytes=self.max_program_bytes, max_eqns=self.jaxpr_max_eqns,
            max_depth=self.jaxpr_max_depth, max_vars=self.jaxpr_max_vars,
            max_literal_elements=self.jaxpr_max_literal_elements,
            max_array_elements=self.jaxpr_max_array_elements, max_rank=self.jaxpr_max_rank,
            max_unroll=self.jaxpr_max_unroll)
        return Limits(max_program_bytes=self.max_program_bytes, max_ops=self.max_ops,
                      max_nesting=self.max_nesting, max_tensor_bytes=self.max_tensor_bytes,
                      max_inputs=self.max_inputs, jaxpr=jaxpr)

    @property
    def auth_enabled(self) -> bool:
        """Whether ``/v1`` routes require a bearer token."""
        return bool(self.api_keys)

    def key_digests(self) -> tuple[bytes, ...]:
        """sha256 digests of the API keys, the form auth compares and owners store."""
        return tuple(hashlib.sha256(k.encode()).digest() for k in self.api_keys)

    def is_admin(self, owner: str | None) -> bool:
        """Whether the caller ``owner`` (``service.auth``'s digest) may use admin routes:
        anyone when auth is off, else the holders of ``admin_keys``."""
        if not self.auth_enabled:
            return True
        return owner is not None and any(
            hashlib.sha256(k.encode()).hexdigest() == owner for k in self.admin_keys)

    # Cache signing: the HMAC secret of executable entries on disk and in Redis, which
    # binds each entry to its key (docs/redis.md, "Trust boundary"). Unset: the
    # compiler keeps a random one in <cache_dir>/cache-secret (one per process with
    # the disk tier off). Required with REDIS_URL: every process on the Redis must
    # sign with the same one. Outside development a placeholder or short one is refused.
    cache_secret: SecretStr | None = None

    @model_validator(mode="after")
    def _check_cache_secret(self) -> Settings:
        value = self.cache_secret.get_secret_value() if self.cache_secret else ""
        if not value and self.redis_url:
            raise ValueError(
                "JITSERVE_CACHE_SECRET is not set, but REDIS_URL is: every process sharing the "
                "Redis signs and checks cache entries with this secret, so set the same long "
                "random value in each (e.g. `openssl rand -hex 32`)")
        if value and self.env != "development" and self._weak_secret(value):
            raise ValueError(
                "JITSERVE_CACHE_SECRET is a placeholder, too short (under 32 characters) or "
                "too plain (under 8 distinct characters); set a long random value "
                "(`openssl rand -hex 32`), or JITSERVE_ENV=development to allow it")
        return self

    @staticmethod
    def _weak_secret(value: str) -> bool:
        words = value.lower()
        for word in sorted(PLACEHOLDER_SECRETS, key=len, reverse=True):
            words = words.replace(word, "")  # "changemechangeme..." is still a placeholder
        return (len(value) < 32 or len(set(value)) < 8
                or not any(c.isalnum() for c in words))

    def compiler_cache_secret(self) -> CacheSecret | None:
        """The secret that signs cache entries; ``None`` lets the compiler keep its own."""
        value = self.cache_secret.get_secret_value() if self.cache_secret else ""
        return CacheSecret.from_value(value, "JITSERVE_CACHE_SECRET") if value else None

    def peer_secret_bytes(self) -> bytes:
        """The key that signs forwarded requests: ``peer_secret``, else one derived from
        ``cache_secret`` (required with Redis, so every replica has the same)."""
        if self.peer_secret is not None and self.peer_secret.get_secret_value():
            return self.peer_secret.get_secret_value().encode()
        base = self.cache_secret.get_secret_value() if self.cache_secret else ""
        return hashlib.sha256(b"jitserve-peer\0" + base.encode()).digest()
