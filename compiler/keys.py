"""The cache key: a sha256 over a named list of parts, computed as jax computes its own.

jax's persistent compilation cache (``jax/_src/cache_key.py``) keys an executable
by the computation, the jaxlib version, the backend's platform and version, the
XLA flags (sorted, without the ones that only steer dumps), the *serialized*
compile options (with their dump-only debug options cleared) and the devices.
jitserve keys the same things, plus what its own API adds: the program id, the
concrete input avals, the static arguments, and the runtime type.

Each part is logged at debug level, so that a miss can be explained by diffing
two logs. The key is also the ``executable_id`` the API reports. When a program
compiles again for other parts, ``recompile_reasons`` says which parts differ
from the nearest earlier key of the same program (``KeyHistory`` keeps them)::

    recompile_reasons(dict(old_parts), dict(new_parts))
    # ["shape: arg 0 float32[8] -> float32[16]"]
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import jaxlib

from jitserve.wire import Aval

__all__ = ["KEY_SCHEMA_VERSION", "Backend", "KeyHistory", "cache_key", "key_parts", "nearest_reasons",
           "options_digest", "recompile_reasons", "xla_flags"]

logger = logging.getLogger("jitserve.compiler.keys")

# Bump when anything that goes into an executable changes meaning.
# 2026-11-21: 1, first schema.
# 2026-11-23: 2, serialized compile options, filtered and sorted XLA flags, and
#             the runtime type, as jax's own cache key has them.
KEY_SCHEMA_VERSION = 2

# Flags that only steer XLA's dumps and paths, never the code it emits: jax leaves
# the same ones out of its key (xla_flags_to_exclude_from_cache_key), so that
# turning on a dump does not empty the cache.
_EXCLUDED_FLAGS = frozenset({
    "--xla_dump_compress_protos", "--xla_dump_module_metadata", "--xla_dump_max_hlo_modules",
    "--xla_dump_include_timestamp", "--xla_dump_hlo_pass_re", "--xla_dump_hlo_module_re",
    "--xla_dump_hlo_snapshots", "--xla_dump_fusion_visualization", "--xla_dump_hlo_as_url",
    "--xla_dump_hlo_as_proto", "--xla_dump_hlo_as_text", "--xla_dump_hlo_as_long_text",
    "--xla_dump_hlo_as_html", "--xla_dump_hlo_as_dot", "--xla_dump_to",
    "--xla_force_host_platform_device_count", "--xla_dump_disable_metadata",
    "--xla_dump_hlo_pipeline_re", "--xla_gpu_cuda_data_dir",
    "--xla_gpu_experimental_autotune_cache_mode",
})

# The same flags as fields of DebugOptions, cleared before the options are hashed.
_CLEARED_DEBUG_OPTIONS = {
    "xla_force_host_platform_device_count": 0, "xla_dump_to": "",
    "xla_dump_hlo_module_re": "", "xla_dump_hlo_pass_re": "", "xla_dump_hlo_as_text": False,
    "xla_dump_hlo_as_proto": False, "xla_dump_hlo_as_dot": False, "xla_dump_hlo_as_url": False,
    "xla_dump_hlo_as_html": False, "xla_dump_fusion_visualization": False,
    "xla_dump_hlo_snapshots": False, "xla_dump_max_hlo_modules": 0,
    "xla_dump_module_metadata": False, "xla_dump_compress_protos": False,
    "xla_dump_hlo_as_long_text": False, "xla_dump_disable_metadata": False,
    "xla_dump_hlo_pipeline_re": "", "xla_gpu_experimental_autotune_cache_mode": 0,
    "xla_gpu_cuda_data_dir": "",
}


@dataclasses.dataclass(frozen=True)
class Backend:
    """What a key says about where an executable runs.

    Attributes:
      platform, platform_version: the backend's (``"cpu"``, ``"cuda"`` and their versions).
      runtime_type: the backend's runtime (``"pjrt_ifrt"``...): another runtime may
        load executables differently.
      device_kind, device_count: the devices the executable is compiled for.
      options_digest: ``options_digest`` of the compile options every compile uses.
      topology: how several devices are connected (the fingerprint of their
        topology); empty for one device.
    """

    platform: str
    platform_version: str
    runtime_type: str
    device_kind: str
    device_count: int
    options_digest: str
    topology: str = ""


def options_digest(options: Any) -> str:
    """sha256 of the serialized ``CompileOptions``, dump-only debug options cleared."""
    options = copy.deepcopy(options)  # the caller compiles with the original
    debug = options.executable_build_options.debug_options
    for name, value in _CLEARED_DEBUG_OPTIONS.items():
        if hasattr(debug, name):
            setattr(debug, name, value)
    excluded = {f.lstrip("-") for f in _EXCLUDED_FLAGS}
    options.env_option_overrides = [kv for kv in options.env_option_overrides
                                    if kv[0] not in excluded]
    return hashlib.sha256(options.SerializeAsString()).hexdigest()


def xla_flags(environ: Mapping[str, str] | None = None) -> str:
    """``XLA_FLAGS`` and ``LIBTPU_INIT_ARGS``, sorted, without the dump-only flags."""
    env = os.environ if environ is None else environ
    flags = [*env.get("XLA_FLAGS", "").split(), *env.get("LIBTPU_INIT_ARGS", "").split()]
    return " ".join(sorted(f for f in flags if f.split("=")[0] not in _EXCLUDED_FLAGS))


def key_parts(*, program_id: str, in_avals: Sequence[Aval], static_key: str,
              backend: Backend, donate: Sequence[int] = (),
              scope: str = "", overrides: str = "") -> list[tuple[str, str]]:
    """The named parts of a key, in a fixed order (donated inputs, the tenant's scope
    and the caller's compiler options only when there are some, so that other keys
    stay what they were).

    ``scope``: the tenant whose executables these are, when tenants do not share
    compiled code (``service.calls.tenants``): each has keys of its own.
    ``overrides``: the call's ``compiler_options`` (``compiler.options.overrides_text``).
    """
    donated = [("donate", ",".join(map(str, donate)))] if donate else []
    scoped = [("tenant", scope)] if scope else []
    chosen = [("compiler_options", overrides)] if overrides else []
    return [
        ("schema", str(KEY_SCHEMA_VERSION)),
        ("program", program_id),
        ("in_avals", ";".join(f"{a}{'~weak' if a.weak_type else ''}" for a in in_avals)),
        ("static", static_key),
        *donated,
        *scoped,
        *chosen,
        ("compile_options", backend.options_digest),
        ("platform", f"{backend.platform} {backend.platform_version}"),
        ("runtime_type", backend.runtime_type),
        ("device_kind", backend.device_kind),
        ("device_count", str(backend.device_count)),
        *([("topology", backend.topology)] if backend.topology else []),
        ("jax", jax.__version__),
        ("jaxlib", jaxlib.__version__),
        ("xla_flags", xla_flags()),
    ]


def cache_key(parts: Sequence[tuple[str, str]]) -> str:
    """sha256 hex over ``parts``; each part is logged at debug level."""
    h = hashlib.sha256()
    for name, value in parts:
        h.update(f"{name}={len(value)}:{value}\n".encode())
    key = h.hexdigest()
    if logger.isEnabledFor(logging.DEBUG):
        for name, value in parts:
            logger.debug("cache key %s part %s = %.500s", key[:16], name, value)
    return key


# What kind of difference each part is, as a recompile reason names it.
_PART_KINDS = {
    "static": "static", "donate": "donate", "program": "program",
    "compile_options": "flags", "compiler_options": "flags", "xla_flags": "flags",
    "schema": "versions", "jax": "versions", "jaxlib": "versions",
    "platform": "backend", "runtime_type": "backend", "device_kind": "backend",
    "device_count": "backend",
}
_AVAL = re.compile(r"^(?P<dtype>[^\[]+)\[(?P<shape>[^\]]*)\](?P<weak>~weak)?$")


def _short(name: str, value: str) -> str:
    if name == "compile_options":
        return value[:12] or "''"
    return repr(value) if len(value) <= 80 else repr(value[:77] + "...")


def _aval_reasons(old: str, new: str) -> list[str]:
    """What differs between two ``in_avals`` parts, input by input."""
    before, after = (old.split(";") if old else []), (new.split(";") if new else [])
    if len(before) != len(after):
        return [f"shape: {len(before)} -> {len(after)} inputs"]
    out: list[str] = []
    for i, (a, b) in enumerate(zip(before, after)):
        if a == b:
            continue
        ma, mb = _AVAL.match(a), _AVAL.match(b)
        kinds = ([k for k, field in (("dtype", "dtype"), ("shape", "shape"), ("weak_type", "weak"))
                  if ma.group(field) != mb.group(field)] if ma and mb else ["shape"])
        out.extend(f"{kind}: arg {i} {a} -> {b}" for kind in kinds)
    return out


def recompile_reasons(previous: Mapping[str, str], current: Mapping[str, str]) -> list[str]:
    """The parts of key ``current`` that differ from ``previous``, in the parts' order, as
    ``"<kind>: <what> <old> -> <new>"``; kinds: ``shape``, ``dtype``, ``weak_type``,
    ``static``, ``donate``, ``flags``, ``versions``, ``backend``, ``program``.

    Both are ``dict(key_parts(...))``; a part missing from one (``donate`` when none
    was donated) counts as empty.
    """
    out = []
    for name in [*current, *(n for n in previous if n not in current)]:
        old, new = previous.get(name, ""), current.get(name, "")
        if old == new:
            continue
        if name == "in_avals":
            out.extend(_aval_reasons(old, new))
        else:
            kind = _PART_KINDS.get(name, name)
            out.append(f"{kind}: {name} {_short(name, old)} -> {_short(name, new)}")
    return out


def nearest_reasons(previous: Iterable[Mapping[str, str]],
                    current: Mapping[str, str]) -> list[str] | None:
    """``recompile_reasons`` against the nearest of ``previous`` (most recent first: the
    fewest differences, the most recent of equals); ``None`` when there is none."""
    best: list[str] | None = None
    for parts in previous:
        reasons = recompile_reasons(parts, current)
        if reasons and (best is None or len(reasons) < len(best)):
            best = reasons
    return best


class KeyHistory:
    """The named parts of each program's recent keys, in this process (thread-safe, bounded).

    ``recompile_reasons`` compares a new key with these. A shared tier (Redis)
    keeps its own copy, so other processes' keys count too.

    Args:
      max_programs: programs remembered, least recently used forgotten first.
      per_program: keys remembered per program, oldest forgotten first.
    """

    def __init__(self, max_programs: int = 1024, per_program: int = 64) -> None:
        self.max_programs, self.per_program = max_programs, per_program
        self._by_program: collections.OrderedDict[
            str, collections.OrderedDict[str, tuple[float, dict[str, str]]]] = (
            collections.OrderedDict())
        self._lock = threading.Lock()

    def record(self, program_id: str, key: str,
               parts: Mapping[str, str] | Iterable[tuple[str, str]],
               at: float | None = None) -> None:
        """Remember ``key`` (whose parts are ``parts``, a mapping or its pairs) of ``program_id``."""
        with self._lock:
            keys = self._by_program.pop(program_id, None) or collections.OrderedDict()
            keys.pop(key, None)
            keys[key] = (time.time() if at is None else at, dict(parts))
            while len(keys) > self.per_program:
                keys.popitem(last=False)
            self._by_program[program_id] = keys
            while len(self._by_program) > self.max_programs:
                self._by_program.popitem(last=False)

    def previous(self, program_id: str, but: str = "") -> dict[str, tuple[float, dict[str, str]]]:
        """``program_id``'s remembered keys other than ``but``: ``{key: (when, parts)}``."""
        with self._lock:
            keys: Mapping[str, tuple[float, dict[str, str]]] = self._by_program.get(program_id) or {}
            return {k: v for k, v in keys.items() if k != but}

    def forget(self, key: str) -> None:
        """Drop ``key`` from every program's history (a deleted executable)."""
        with self._lock:
            for keys in self._by_program.values():
                keys.pop(key, None)
