"""Supervised runtime processes: where programs are decoded, compiled and run.

The API process never touches a program's content. It sends each request to a
runtime (``service.runtimes.child``) chosen by ``RuntimePool.place``, and the
runtime's answer (or its death) settles it. See ``protocol`` for what the two
say to each other (every request an ``Op``), ``pool`` for supervision,
deadlines and placement, ``pipes`` and ``frames`` for how messages and arrays
cross, and docs/runtimes.md for the trade-offs.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr

from .devices import Group, group_env, host_device_count, parse_groups
from .pool import Buffer, NotStarted, RemoteError, Runtime, RuntimeLost, RuntimePool
from .protocol import Config, Op

if TYPE_CHECKING:
    from ..settings import Settings

__all__ = ["Buffer", "CPU_ARRAY_SHARE", "Group", "NotStarted", "Op", "RemoteError", "Runtime",
           "RuntimeLost", "RuntimePool", "derive_device_limits", "device_groups", "device_limits",
           "make_pool", "platform_kind"]

_GPU_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_rocm7_plugin", "jax_rocm6_plugin")
_MIN_MEMORY = 2 << 30
# A CPU runtime's arrays may take this share of its memory cap; the rest is XLA's
# (compiled code, scratch) and the host copies of transfers.
CPU_ARRAY_SHARE = 0.5


def platform_kind() -> str:
    """``cpu`` or ``gpu``: what the runtimes will find, without starting a backend here."""
    wanted = os.environ.get("JAX_PLATFORMS", "").split(",")[0].strip().lower()
    if wanted:
        return "cpu" if wanted == "cpu" else "gpu"
    if any(importlib.util.find_spec(name) is not None for name in _GPU_PLUGINS):
        return "gpu"
    return "cpu"


def _host_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def runtime_count(settings: Settings, platform: str, groups: int = 1) -> int:
    """Runtimes per device group: ``JITSERVE_RUNTIMES``, else one per core on CPU (at
    most 8) with one group, and one per group otherwise."""
    if settings.runtimes:
        return settings.runtimes
    return 1 if platform == "gpu" or groups > 1 else max(1, min(os.cpu_count() or 1, 8))


def device_groups(settings: Settings, platform: str) -> list[Group]:
    """The server's device groups (``runtimes.devices``): ``JITSERVE_RUNTIME_DEVICES``,
    else every device in one group on CPU and one group per device on GPU."""
    count = host_device_count(platform, settings.cpu_devices)
    spec = settings.runtime_devices or ("all" if platform == "cpu" else "each")
    rocm = any(importlib.util.find_spec(n) is not None for n in _GPU_PLUGINS if "rocm" in n)
    return [Group(i, ids, group_env(platform, ids, rocm))
            for i, ids in enumerate(parse_groups(spec, count))]


def memory_limit(settings: Settings, count: int) -> int | None:
    """Each CPU runtime's address-space cap: the setting, else 80% of RAM shared out."""
    if settings.runtime_max_memory_bytes:
        return settings.runtime_max_memory_bytes
    total = _host_memory()
    return max(int(total * 0.8) // count, _MIN_MEMORY) if total else None


def device_limits(settings: Settings, pool: RuntimePool) -> Settings:
    """``settings`` with the device-bytes limits left unset derived from the devices.

    ``max_device_bytes`` (what live futures and running executions may hold, all
    runtimes together) becomes the sum of the runtimes' shares of their devices, and
    ``max_execution_bytes`` (one run, per device, as XLA's memory analysis counts it)
    the smallest share of one device: a run that cannot fit its device is refused at
    once (422 ``limit_exceeded``) instead of failing there. A share is what XLA's
    allocator lets the runtime hold on a GPU (the device's memory times its fraction,
    reported at start), and ``CPU_ARRAY_SHARE`` of the runtime's memory cap on the CPU.
    Where neither is known, ``Settings.device_bytes_limit``'s fallback stands.
    """
    seen: dict[int, list[int | None]] = {}  # a group's devices' limits, from any of its runtimes
    for runtime in pool.runtimes:
        devices = runtime.info.get("devices") if runtime.info else None
        if devices and runtime.group.index not in seen:
            seen[runtime.group.index] = [d.get("memory_limit") for d in devices]
    per_runtime = [seen.get(r.group.index, [None] * r.group.size) for r in pool.runtimes]
    derived = derive_device_limits(per_runtime, pool.memory_cap)
    total = settings.max_device_bytes or (derived[0] if derived else settings.device_bytes_limit)
    per_run = settings.max_execution_bytes or min(derived[1] if derived else total, total)
    return settings.model_copy(update={"max_device_bytes": total, "max_execution_bytes": per_run})


def derive_device_limits(runtimes: Sequence[Sequence[int | None]],
                         cap: int | None) -> tuple[int, int] | None:
    """The bytes all ``runtimes`` may hold on their devices, and the least one device
    may give a run; ``None`` where a runtime's share is unknown.

    Each runtime is given as its devices' memory limits (``None`` where the backend
    reports none); ``cap``: each runtime's address-space cap (CPU), or ``None``.
    """
    total, least = 0, None
    for limits in runtimes:
        if limits and all(limits):
            shares = [int(x or 0) for x in limits]
        elif limits and cap:
            shares = [int(cap * CPU_ARRAY_SHARE) // len(limits)] * len(limits)
        else:
            return None
        total += sum(shares)
        least = min(shares) if least is None else min(least, *shares)
    return (total, least) if least is not None else None


def settings_document(settings: Settings) -> dict[str, Any]:
    """``settings`` as plain values, secrets included (it travels over a private pipe)."""
    doc = settings.model_dump(mode="json")
    for name in type(settings).model_fields:
        value = getattr(settings, name)
        if isinstance(value, SecretStr):
            doc[name] = value.get_secret_value()
    return doc


def make_pool(settings: Settings) -> RuntimePool:
    """A pool configured from ``settings`` (not started: call ``start``)."""
    platform = platform_kind()
    groups = device_groups(settings, platform)
    per_group = runtime_count(settings, platform, len(groups))
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false",
           "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
    limit = None
    if platform == "gpu":  # a device is shared by its own group's runtimes only
        fraction = settings.runtime_device_memory_fraction or round(0.75 / per_group, 3)
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(fraction)
    else:
        limit = memory_limit(settings, per_group * len(groups))
    # Without Redis a runtime needs no network at all: it gets none (docs/runtimes.md).
    config: Config = {"settings": settings_document(settings), "platform": platform,
                      "max_memory_bytes": limit, "log_level": settings.log_level,
                      "isolate_network": settings.redis_settings() is None,
                      "max_devices": max(g.size for g in groups)}
    return RuntimePool(per_group, config, env, groups=groups,
                       segment_cache_bytes=settings.retain_freed_max_bytes)
