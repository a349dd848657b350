"""The XLA options a client may choose: ``jax.jit(..., compiler_options={...})``.

jax passes a jit's ``compiler_options`` to XLA as ``env_option_overrides``: XLA
options set by name (``DebugOptions`` fields, and a few build options). A server
applies only the names listed here, whether they come from ``Client.jit`` (an
execute's ``compiler_options``) or from an IFRT proxy client's compile request
(``compiler.ifrt``): numerics jax itself sets from its config, and how hard XLA
optimizes. Everything else (dump paths, cache directories, autotuning files,
memory sizes) is the server's own. Values are XLA's to check: a bad one fails the
compile with XLA's message.

No jax or protobuf here: the API process checks a call's options before anything
is queued.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from jitserve.compiler.errors import InvalidProgram

__all__ = ["ALLOWED_DEBUG_OPTIONS", "ALLOWED_OVERRIDES", "BUILD_OVERRIDES", "MAX_OPTIONS",
           "check_compiler_options", "overrides_text"]

# DebugOptions fields a client chooses: numerics jax itself sets from its config.
ALLOWED_DEBUG_OPTIONS = frozenset({
    "xla_cpu_enable_fast_math", "xla_cpu_fast_math_honor_nans", "xla_cpu_fast_math_honor_infs",
    "xla_cpu_fast_math_honor_division", "xla_cpu_fast_math_honor_functions",
    "xla_cpu_enable_fast_min_max", "xla_gpu_enable_fast_min_max", "xla_enable_fast_math",
    "xla_allow_excess_precision", "xla_cpu_ftz",
})
# Every option name a client may set (``env_option_overrides``), the above included.
ALLOWED_OVERRIDES = ALLOWED_DEBUG_OPTIONS | frozenset({
    "xla_embed_ir_in_executable", "xla_llvm_disable_expensive_passes",
    "xla_backend_optimization_level", "exec_time_optimization_effort", "memory_fitting_effort",
    "optimization_level", "memory_fitting_level", "xla_gpu_auto_spmd_partitioning_memory_budget_ratio",
    # a cap on dumps, which cannot happen: xla_dump_to is not allowed
    "xla_dump_max_hlo_modules",
})
# Override names XLA reads from ExecutableBuildOptions rather than DebugOptions: jax
# sets them as attributes, which take a number (efforts) or a level's number, and
# nothing else (XLA parses the other options' values from text, and says what is wrong).
_EFFORTS = frozenset({"exec_time_optimization_effort", "memory_fitting_effort"})
_LEVELS = frozenset({"optimization_level", "memory_fitting_level"})
BUILD_OVERRIDES = _EFFORTS | _LEVELS
#: Options in one call: more than there are names to allow.
MAX_OPTIONS = len(ALLOWED_OVERRIDES)
_MAX_VALUE_CHARS = 256
_NAN = float("nan")


def check_compiler_options(options: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...]:
    """``options`` as sorted ``(name, value)`` pairs; ``InvalidProgram`` naming the first
    option that is not allowed, or a value that is not a bool, number or short string.

    The one home of the rule: the API process checks a call's options with it, and
    the compiler again before it compiles."""
    if not options:
        return ()
    if not isinstance(options, Mapping):
        raise InvalidProgram(f"compiler_options must be a map of option names to values, "
                             f"got {type(options).__name__}")
    if len(options) > MAX_OPTIONS:
        raise InvalidProgram(f"compiler_options has {len(options)} options; at most "
                             f"{MAX_OPTIONS} can be allowed")
    out = []
    for name, value in sorted(options.items()):
        if not isinstance(name, str) or name not in ALLOWED_OVERRIDES:
            raise InvalidProgram(f"compile option {str(name)[:100]!r} is not allowed on this "
                                 f"server (allowed: {', '.join(sorted(ALLOWED_OVERRIDES))})")
        if isinstance(value, str):
            if len(value) > _MAX_VALUE_CHARS:
                raise InvalidProgram(f"compile option {name!r}: a value of {len(value)} "
                                     f"characters (at most {_MAX_VALUE_CHARS})")
        elif not isinstance(value, (bool, int, float)):
            raise InvalidProgram(f"compile option {name!r}: the value must be a bool, a "
                                 f"number or a string, got {type(value).__name__}")
        wanted = (int, float) if name in _EFFORTS else int if name in _LEVELS else None
        if wanted is not None and (isinstance(value, (bool, str)) or not isinstance(value, wanted)):
            kind = "a number" if name in _EFFORTS else "an integer (the level)"
            raise InvalidProgram(f"compile option {name!r} takes {kind}, got {value!r:.40}")
        if isinstance(value, float) and math.isnan(value):
            value = _NAN  # one nan, so that a call's options equal the last call's (``is``)
        out.append((name, value))
    return tuple(out)


def overrides_text(options: tuple[tuple[str, Any], ...]) -> str:
    """``check_compiler_options``'s pairs as one string, for keys and records:
    ``name=value`` joined by ``;``, values as JSON writes them (``true``, ``1``, ``"x"``),
    so that ``True`` and ``"True"`` stay apart."""
    import json

    return ";".join(f"{name}={json.dumps(value)}" for name, value in options)
